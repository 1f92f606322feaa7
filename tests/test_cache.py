"""The content-hash cache returns exactly what a fresh check would, and forgets stale files."""

from __future__ import annotations

from ddpify import api
from ddpify.rules import select_rules

DP = "import torch\nm = torch.nn.DataParallel(x)\n"


def run(tmp_path, select=None):
    return api.check_paths([str(tmp_path / "src")], select_rules(select), cache_dir=tmp_path / "c")


def test_warm_run_equals_cold_run_without_parsing(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(DP)
    cold = run(tmp_path).diagnostics
    monkeypatch.setattr(api, "check_bytes", lambda *a: (_ for _ in ()).throw(AssertionError))
    warm = run(tmp_path).diagnostics
    assert warm == cold and warm[0].source_lines == cold[0].source_lines


def test_edited_file_and_other_rules_are_cache_misses(tmp_path):
    (tmp_path / "src").mkdir()
    script = tmp_path / "src" / "a.py"
    script.write_text(DP)
    assert len(run(tmp_path).diagnostics) == 1
    script.write_text("import torch\n")
    assert run(tmp_path).diagnostics == []
    script.write_text(DP)
    assert run(tmp_path, select=["DDP01"]).diagnostics == []


def test_damaged_cache_is_ignored(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(DP)
    run(tmp_path)
    (tmp_path / "c" / "check-results.json").write_text("{not json")
    assert len(run(tmp_path).diagnostics) == 1


def test_cli_uses_the_cache_unless_told_not_to(tmp_path, monkeypatch, capsys):
    from ddpify.cli import main

    monkeypatch.setenv("DDPIFY_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / "a.py"
    script.write_text(DP)
    argv = ["check", str(script), "--output-format", "concise"]
    assert main(argv) == 1
    cold = capsys.readouterr().out
    assert (tmp_path / "cache" / "check-results.json").exists()
    assert main(argv) == 1
    assert capsys.readouterr().out == cold
    (tmp_path / "cache" / "check-results.json").unlink()
    assert main([*argv, "--no-cache"]) == 1
    assert not (tmp_path / "cache" / "check-results.json").exists()
