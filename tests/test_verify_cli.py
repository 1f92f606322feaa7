"""verify's command line: bad numbers and bad scripts are refused before anything runs."""

from __future__ import annotations

import pytest

from ddpify.cli import main


@pytest.mark.parametrize(
    "option, value",
    [
        ("--rtol", "-1"),
        ("--atol", "nan"),
        ("--timeout", "nan"),
        ("--timeout", "0"),
        ("--timeout", "inf"),
        ("--lr-scale", "-2"),
        ("--nproc", "0"),
        ("--steps", "-3"),
    ],
)
def test_bad_numbers_are_usage_errors(capsys, tmp_path, option, value):
    script = tmp_path / "a.py"
    script.write_text("x = 1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", str(script), str(script), f"{option}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_a_syntax_error_is_named_before_anything_runs(capsys, tmp_path, monkeypatch):
    import ddpify.verify

    def must_not_run(*args, **kwargs):
        raise AssertionError("verify ran a script that does not compile")

    monkeypatch.setattr(ddpify.verify, "run_verify", must_not_run)
    good, bad = tmp_path / "train.py", tmp_path / "train_ddp.py"
    good.write_text("x = 1\n")
    bad.write_text("x = 1\ndef broken(:\n")
    code = main(["verify", str(good), str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        f"ddpify: error: {bad}:2: not valid Python: invalid syntax; nothing was run"
    )
