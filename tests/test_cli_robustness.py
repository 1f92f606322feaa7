"""The CLI on hostile input: a one-line message naming the file, a defined exit code, the
run going on with the other files, and nothing of the user's lost."""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import sys

import pytest

import ddpify.files
from ddpify.cli import main
from ddpify.gates import GateError

LEGACY_AMP = "import torch\n\nscaler = torch.cuda.amp.GradScaler()  # keep this comment\n"
FIXED_AMP = 'scaler = torch.amp.GradScaler("cuda")'
SINGLE_GPU = """\
import torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    model = torch.nn.Linear(4, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
"""


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def test_fix_refuses_a_read_only_file_and_fixes_the_others(capsys, tmp_path):
    locked, free = tmp_path / "locked.py", tmp_path / "free.py"
    for path in (locked, free):
        path.write_text(LEGACY_AMP)
    os.chmod(locked, 0o444)
    code, _, err = run(capsys, "check", str(tmp_path), "--fix", "--no-cache")
    assert code == 2
    assert f"{locked}: is read-only; not written" in err
    assert locked.read_text() == LEGACY_AMP
    assert FIXED_AMP in free.read_text()
    run(capsys, "check", str(locked), "--fix", "--no-cache", "--force-write")
    assert FIXED_AMP in locked.read_text()


def test_a_full_disk_is_a_message_naming_the_file(capsys, tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(LEGACY_AMP)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ddpify.files, "_write_all", full)
    code, _, err = run(capsys, "check", str(path), "--fix", "--no-cache")
    assert code == 2
    assert f"{path}: No space left on device" in err
    assert "internal error" not in err and "Traceback" not in err
    assert path.read_text() == LEGACY_AMP
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_an_edit_made_during_the_fix_is_not_overwritten(capsys, tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(LEGACY_AMP)
    import ddpify.commands.check as check_command

    real = check_command.fix_until_stable

    def slow_fix(*args, **kwargs):
        outcome = real(*args, **kwargs)
        path.write_text(LEGACY_AMP + "# the user typed this meanwhile\n")
        return outcome

    monkeypatch.setattr(check_command, "fix_until_stable", slow_fix)
    code, _, err = run(capsys, "check", str(path), "--fix", "--no-cache")
    assert code == 2
    assert f"{path}: changed on disk since ddpify read it" in err
    assert path.read_text().endswith("# the user typed this meanwhile\n")


def test_output_file_that_is_an_input_is_refused(capsys, tmp_path):
    path = tmp_path / "train.py"
    path.write_text(LEGACY_AMP)
    code, _, err = run(capsys, "check", str(path), "--output-file", str(path), "--no-cache")
    assert code == 2
    assert "is one of the files being checked" in err
    assert path.read_text() == LEGACY_AMP


def test_an_empty_cache_dir_variable_means_the_default(capsys, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(LEGACY_AMP)
    monkeypatch.setenv("DDPIFY_CACHE_DIR", "")
    run(capsys, "check", "train.py")
    assert not (tmp_path / ".gitignore").exists()
    assert (tmp_path / ".ddpify_cache" / ".gitignore").exists()


def test_undecodable_coding_cookies_are_ddp000_and_the_run_goes_on(capsys, tmp_path):
    for cookie in ("undefined", "punycode", "idna"):
        (tmp_path / f"{cookie}.py").write_bytes(
            f"# coding: {cookie}\nimport torch\n".encode() + b"x = '\xff'\n"
        )
    (tmp_path / "train.py").write_text(LEGACY_AMP)
    code, out, err = run(capsys, "check", str(tmp_path), "--no-cache", "--output-format", "concise")
    assert "internal error" not in err
    assert out.count("DDP000") == 3
    assert "DDP043" in out
    assert code == 1


def test_a_fifo_is_refused_not_waited_on(capsys, tmp_path):
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "migrate", str(fifo))
    assert code == 2
    assert "not a regular file" in err


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'[tool.ddpify]\n# caf\xe9\nselect = ["DDP0"]\n', "not UTF-8"),
        (b"[tool]\nddpify = 3\n", "must be a table"),
    ],
)
def test_bad_configuration_is_exit_2_with_the_file_named(capsys, tmp_path, content, problem):
    (tmp_path / "pyproject.toml").write_bytes(content)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(LEGACY_AMP)
    code, _, err = run(capsys, "check", "sub/train.py", "--no-cache")
    assert code == 2
    assert err.strip().splitlines() == [
        f"ddpify: error: {tmp_path / 'pyproject.toml'}: " + err.split(": ", 3)[-1].strip()
    ]
    assert problem in err


def test_a_tool_key_that_is_not_a_table_is_not_our_configuration(capsys, tmp_path):
    (tmp_path / "pyproject.toml").write_text("tool = 3\n")
    (tmp_path / "train.py").write_text(LEGACY_AMP)
    code, _, err = run(capsys, "check", "train.py", "--no-cache")
    assert code == 0 and err == ""


def test_stdin_fix_gives_the_buffer_back_when_the_fix_fails(capsysbinary, monkeypatch):
    import ddpify.commands.check as check_command

    def broken(*args, **kwargs):
        raise GateError("fix DDP043", "does not compile")

    monkeypatch.setattr(check_command, "fix_until_stable", broken)
    data = ("\ufeff" + LEGACY_AMP).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = main(["check", "--fix", "--stdin-filename", "train.py", "-"])
    out, err = capsysbinary.readouterr()
    assert code == 2
    assert out == data
    assert b"failed a safety gate" in err


def test_migrate_reads_its_defaults_from_the_configuration(capsys, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.ddpify.migrate]\nbatch-policy = "global"\nlr-scaling = "auto"\n'
    )
    (tmp_path / "train.py").write_text(SINGLE_GPU)
    code, out, _ = run(capsys, "migrate", "train.py", "--diff")
    assert code == 0
    assert "batch_size=8 // WORLD_SIZE" in out
    code, flagged, _ = run(capsys, "migrate", "train.py", "--diff", "--batch-policy", "per-rank")
    assert code == 0
    assert "batch_size=8 // WORLD_SIZE" not in flagged  # the flag wins


def test_migrate_does_not_overwrite_an_edit_made_meanwhile(capsys, tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(SINGLE_GPU)
    import ddpify.commands.migrate as migrate_command

    real = migrate_command.migrate_source

    def slow_migrate(*args, **kwargs):
        result = real(*args, **kwargs)
        path.write_text(SINGLE_GPU + "# edited meanwhile\n")
        return result

    monkeypatch.setattr(migrate_command, "migrate_source", slow_migrate)
    code, _, err = run(capsys, "migrate", "train.py")
    assert code == 2
    assert "train.py: changed on disk since ddpify read it" in err
    assert path.read_text().endswith("# edited meanwhile\n")


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="--verify is offered only with torch"
)
def test_in_place_migrate_verify_names_the_two_sides_apart(capsys, tmp_path, monkeypatch):
    import ddpify.verify
    from ddpify.verify import VerifyResult

    seen = {}

    def fake_verify(original, converted, **kwargs):
        seen["converted_source"] = kwargs["converted_source"]
        settings = {"original": str(original), "converted": str(converted), "nproc": 2}
        return VerifyResult(0, "match", "gradients match", settings=settings)

    monkeypatch.setattr(ddpify.verify, "run_verify", fake_verify)
    (tmp_path / "train.py").write_text(SINGLE_GPU)
    code, out, _ = run(capsys, "migrate", "train.py", "--verify")
    assert code == 0
    header = out.splitlines()[0]
    assert header.startswith("ddpify verify: train.py (1 process) vs the migration of train.py")
    assert "DistributedSampler" in seen["converted_source"]
