"""`ddpify check --stdin-filename PATH -`: how editors and formatters-on-save call ddpify."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpify.rules import RULES_BY_CODE

DP_SCRIPT = "import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n"
LEGACY_AMP = "import torch\n\nscaler = torch.cuda.amp.GradScaler()  # keep this comment\n"


def ddpify(*argv, stdin: bytes, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpify", "check", *argv],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        timeout=120,
    )


def test_buffer_is_linted_under_the_given_name(tmp_path):
    result = ddpify(
        "--stdin-filename",
        "src/train.py",
        "-",
        "--isolated",
        stdin=DP_SCRIPT.encode(),
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stdout.decode().startswith("src/train.py:2:9: DDP070 ")


def test_dash_alone_reads_stdin(tmp_path):
    result = ddpify(
        "-", "--output-format", "json", "--isolated", stdin=DP_SCRIPT.encode(), cwd=tmp_path
    )
    assert result.returncode == 1
    [finding] = [d for d in json.loads(result.stdout) if d["code"] == "DDP070"]
    assert finding["filename"] == "-"


def test_clean_buffer_exits_zero_and_disk_is_untouched(tmp_path):
    on_disk = tmp_path / "train.py"
    on_disk.write_text(DP_SCRIPT)
    clean = b"import torch\nmodel = torch.nn.Linear(2, 2)\n"
    result = ddpify("--stdin-filename", str(on_disk), "-", "--select", "DDP070", stdin=clean)
    assert (result.returncode, result.stdout) == (0, b"")
    assert on_disk.read_text() == DP_SCRIPT


def test_per_file_ignores_apply_to_the_stdin_filename(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.ddpify]\nper-file-ignores = { "scripts/*" = ["DDP070"] }\n'
    )
    ignored = ddpify(
        "--stdin-filename",
        "scripts/a.py",
        "--select",
        "DDP070",
        "-",
        stdin=DP_SCRIPT.encode(),
        cwd=tmp_path,
    )
    assert (ignored.returncode, ignored.stdout) == (0, b"")
    kept = ddpify(
        "--stdin-filename",
        "src/a.py",
        "--select",
        "DDP070",
        "-",
        stdin=DP_SCRIPT.encode(),
        cwd=tmp_path,
    )
    assert kept.returncode == 1 and b"src/a.py:2:9: DDP070" in kept.stdout


@pytest.mark.skipif("DDP043" not in RULES_BY_CODE, reason="the fixable rule DDP043 is absent")
def test_fix_writes_the_whole_fixed_buffer_to_stdout(tmp_path):
    on_disk = tmp_path / "train.py"
    on_disk.write_text(LEGACY_AMP)
    source = ("\ufeff" + LEGACY_AMP.replace("\n", "\r\n")).encode()
    result = ddpify(
        "--stdin-filename", str(on_disk), "--fix", "--select", "DDP043", "-", stdin=source
    )
    assert result.returncode == 0
    fixed = result.stdout
    assert fixed.startswith(b"\xef\xbb\xbf") and b"torch.cuda.amp" not in fixed
    assert b"  # keep this comment\r\n" in fixed
    compile(fixed.decode("utf-8-sig"), "train.py", "exec")
    assert on_disk.read_text() == LEGACY_AMP
    # Stable: fixing the fixed buffer returns it unchanged.
    again = ddpify(
        "--stdin-filename", str(on_disk), "--fix", "--select", "DDP043", "-", stdin=fixed
    )
    assert again.stdout == fixed


def test_fix_reports_what_remains_on_stderr(tmp_path):
    result = ddpify(
        "--stdin-filename",
        "t.py",
        "--fix",
        "--select",
        "DDP070",
        "-",
        stdin=DP_SCRIPT.encode(),
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stdout == DP_SCRIPT.encode()
    assert b"t.py:2:9: DDP070" in result.stderr


@pytest.mark.skipif("DDP043" not in RULES_BY_CODE, reason="the fixable rule DDP043 is absent")
def test_diff_from_stdin(tmp_path):
    result = ddpify(
        "--stdin-filename",
        "t.py",
        "--diff",
        "--select",
        "DDP043",
        "-",
        stdin=LEGACY_AMP.encode(),
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert b"--- a/t.py\n+++ b/t.py\n" in result.stdout
    assert b"-scaler = torch.cuda.amp.GradScaler()" in result.stdout


def test_stdin_cannot_be_mixed_with_paths(tmp_path):
    (tmp_path / "a.py").write_text(DP_SCRIPT)
    result = ddpify("-", "a.py", stdin=b"", cwd=tmp_path)
    assert result.returncode == 2
    assert b"cannot be combined" in result.stderr


def test_undecodable_buffer_is_an_error_not_a_traceback(tmp_path):
    result = ddpify(
        "--stdin-filename", "t.py", "-", stdin=b"import torch\nx = '\xff\xfe'\n", cwd=tmp_path
    )
    assert result.returncode == 2
    assert b"cannot decode" in result.stderr and b"Traceback" not in result.stderr
