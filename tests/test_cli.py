"""The check command as users and editors drive it: exit codes, formats, odd inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpify import __version__
from ddpify.cli import main

DP_SCRIPT = "import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n"
CLEAN_SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2)\n"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def write(tmp_path):
    def _write(name, content, mode="w"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, newline="")
        return path

    return _write


def test_clean_file_exits_zero(capsys, write):
    code, out, _ = run(capsys, "check", str(write("ok.py", CLEAN_SCRIPT)))
    assert code == 0
    assert "Checked 1 file: 0 errors, 0 warnings, 0 infos." in out


def test_finding_exits_one_and_names_the_place(capsys, write):
    path = write("dp.py", DP_SCRIPT)
    code, out, _ = run(capsys, "check", str(path), "--output-format", "concise")
    assert code == 1
    assert f"{path}:2:9: DDP070 " in out


def test_full_format_shows_the_offending_line(capsys, write):
    code, out, _ = run(capsys, "check", str(write("dp.py", DP_SCRIPT)), "--output-format", "full")
    assert code == 1
    assert "2 | model = torch.nn.DataParallel(torch.nn.Linear(2, 2))" in out
    assert "^^^^^^^^^^^^^^^^^^^^^ DDP070" in out


def test_json_shape(capsys, write):
    path = write("dp.py", DP_SCRIPT)
    code, out, _ = run(capsys, "check", str(path), "--output-format", "json")
    assert code == 1
    [item] = json.loads(out)
    assert item == {
        "code": "DDP070",
        "name": "dataparallel-usage",
        "severity": "warning",
        "message": item["message"],
        "filename": str(path),
        "cell": None,  # the notebook cell, as in ruff's JSON
        "location": {"row": 2, "column": 9},
        "end_location": {"row": 2, "column": 30},
        "fix": None,
    }
    assert "DataParallel" in item["message"]


def test_missing_path_is_a_usage_error(capsys, write):
    code, _, err = run(capsys, "check", str(write("ok.py", CLEAN_SCRIPT)), "nope/train.py")
    assert code == 2
    assert "nope/train.py: no such file or directory" in err
    assert "Traceback" not in err


def test_unknown_rule_selector(capsys, write):
    code, _, err = run(capsys, "check", str(write("ok.py", CLEAN_SCRIPT)), "--select", "DDP999")
    assert code == 2
    assert "DDP999" in err


def test_select_and_ignore_by_prefix(capsys, write):
    path = str(write("dp.py", DP_SCRIPT))
    assert run(capsys, "check", path, "--select", "DDP07")[0] == 1
    assert run(capsys, "check", path, "--ignore", "DDP07")[0] == 0
    assert run(capsys, "check", path, "--select", "DDP070", "--ignore", "DDP07")[0] == 1


def test_syntax_error_is_a_diagnostic_not_a_crash(capsys, write):
    path = write("broken.py", "import torch\n\ndef train(:\n    pass\n")
    code, out, err = run(capsys, "check", str(path), "--output-format", "concise")
    assert code == 1
    assert f"{path}:3:" in out and "DDP000 cannot parse" in out
    assert "Traceback" not in out + err


def test_non_utf8_file_gets_a_clear_message(capsys, write):
    path = write("latin.py", "import torch\n# entraîné sur un GPU\n".encode("latin-1"))
    code, out, _ = run(capsys, "check", str(path), "--output-format", "concise")
    assert code == 1
    assert "DDP000 cannot read file: cannot decode as utf-8" in out
    assert "coding" in out


def test_declared_latin1_encoding_is_honoured(capsys, write):
    text = "# -*- coding: latin-1 -*-\nimport torch\n# entraîné\nm = torch.nn.DataParallel(x)\n"
    path = write("latin.py", text.encode("latin-1"))
    code, out, _ = run(capsys, "check", str(path), "--output-format", "concise")
    assert code == 1
    assert f"{path}:4:5: DDP070" in out


def test_utf8_bom_positions(capsys, write):
    path = write("bom.py", b"\xef\xbb\xbf" + DP_SCRIPT.encode())
    _, out, _ = run(capsys, "check", str(path), "--output-format", "concise")
    assert f"{path}:2:9: DDP070" in out


def test_crlf_line_endings_give_the_same_positions(capsys, write):
    lf = write("lf.py", "import torch\n\n\nm = torch.nn.DataParallel(x)  # DP\n")
    crlf = write("crlf.py", "import torch\r\n\r\n\r\nm = torch.nn.DataParallel(x)  # DP\r\n")
    _, out, _ = run(capsys, "check", str(lf), str(crlf), "--output-format", "json")
    rows = [(d["location"], d["end_location"]) for d in json.loads(out)]
    assert len(rows) == 2 and rows[0] == rows[1]


def test_empty_file(capsys, write):
    code, out, _ = run(capsys, "check", str(write("empty.py", "")))
    assert code == 0
    assert "Checked 1 file" in out


def test_noqa_bare_and_by_code(capsys, write):
    text = (
        "import torch\n"
        "a = torch.nn.DataParallel(x)  # noqa\n"
        "b = torch.nn.DataParallel(x)  # noqa: DDP070\n"
        "c = torch.nn.DataParallel(x)  # noqa: DDP022\n"
    )
    _, out, _ = run(capsys, "check", str(write("n.py", text)), "--output-format", "concise")
    assert [line.split(":")[1] for line in out.splitlines() if "DDP070" in line] == ["4"]


def test_directory_walk_mixes_torch_and_plain_files(capsys, tmp_path, write):
    write("proj/train.py", DP_SCRIPT)
    write("proj/utils/strings.py", "def shout(s):\n    return s.upper()\n")
    write("proj/utils/broken_but_no_torch.py", "def (:\n")
    write("proj/.venv/lib/site.py", DP_SCRIPT)
    write("proj/build/generated.py", DP_SCRIPT)
    write("proj/scratch/tmp_train.py", DP_SCRIPT)
    write("proj/.gitignore", "scratch/\n")
    write("proj/README.md", "not python")
    code, out, _ = run(capsys, "check", str(tmp_path / "proj"), "--output-format", "concise")
    assert code == 1
    flagged = {line.split(":")[0] for line in out.splitlines() if "DDP0" in line}
    assert flagged == {str(tmp_path / "proj" / "train.py")}
    assert "Checked 3 files" in out


def test_directory_without_python_files(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(capsys, "check", str(tmp_path))
    assert code == 0
    assert "no Python files found" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ddpify {__version__}"


def test_rule_command_prints_the_page(capsys):
    code, out, _ = run(capsys, "rule", "DDP070")
    assert code == 0
    assert "Why is this bad?" in out and "DataParallel" in out
    assert run(capsys, "rule", "DDP999")[0] == 2


def test_python_dash_m_entry_point(tmp_path):
    path = tmp_path / "dp.py"
    path.write_text(DP_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "ddpify", "check", str(path), "--output-format", "concise"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "DDP070" in done.stdout


def test_check_does_not_import_torch(tmp_path):
    """check must run in a pre-commit environment that has no torch installed."""
    path = tmp_path / "dp.py"
    path.write_text(DP_SCRIPT)
    code = (
        "import sys; from ddpify.cli import main; rc = main(['check', sys.argv[1], '-q']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; raise SystemExit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
