"""Notebooks: checked cell by cell, positions as cell and line, fixes written back with
outputs, metadata and layout intact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddpify.cli import main
from ddpify.notebooks import read_notebook

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "notebooks" / "ddp_training.ipynb"


def run(capsys, *argv):
    code = main([*argv, "--no-cache"])
    out, err = capsys.readouterr()
    return code, out, err


def test_findings_are_placed_by_cell_and_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(FIXTURE, "nb.ipynb")
    code, out, _ = run(capsys, "check", ".", "--output-format", "concise")
    assert code == 1
    lines = out.splitlines()
    # Cell 4 (the third code cell), row 8: `scaler = GradScaler()`; cell 3, row 3: set_device.
    assert any(line.startswith("nb.ipynb:cell 4:8:10: DDP043 [*]") for line in lines)
    assert any(line.startswith("nb.ipynb:cell 3:3:1: DDP010") for line in lines)
    assert any(line.startswith("nb.ipynb:cell 4:2:11: DDP022") for line in lines)
    _, out, _ = run(capsys, "check", "nb.ipynb", "--output-format", "json")
    cells = {(d["code"], d["cell"], d["location"]["row"]) for d in json.loads(out)}
    assert ("DDP043", 6, 4) in cells


def test_magics_and_shell_lines_are_not_python_errors():
    notebook = read_notebook(FIXTURE.read_bytes(), "nb.ipynb")
    compile(notebook.text, "nb.ipynb", "exec")
    assert "!pip install -q torch" in notebook.ipython_lines
    assert "%%capture --no-display" in notebook.ipython_lines


def test_assigned_shell_results_and_continued_magics_are_not_python_errors():
    # Colab set-up cells: `version = !python --version`, and a `%run` split over lines.
    cells = [
        "import torch\nPython_version = !python --version\nfiles, = %sx ls\n",
        "if torch.cuda.is_available():\n    %run train.py --config a.json \\\n--lr 1e-4 \\\n"
        "--epochs 3\nprint('done')\n",
    ]
    document = {
        "cells": [{"cell_type": "code", "source": c, "metadata": {}} for c in cells],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    notebook = read_notebook(json.dumps(document).encode(), "nb.ipynb")
    compile(notebook.text, "nb.ipynb", "exec")
    assert "Python_version = !python --version" in notebook.ipython_lines
    assert "--epochs 3" in notebook.ipython_lines
    assert "print('done')" not in notebook.ipython_lines


def test_fix_rewrites_only_the_code_it_fixes(capsys, tmp_path):
    path = tmp_path / "nb.ipynb"
    shutil.copy(FIXTURE, path)
    before = json.loads(FIXTURE.read_text(encoding="utf-8"))
    code, out, _ = run(capsys, "check", str(path), "--fix", "--output-format", "concise")
    after_text = path.read_text(encoding="utf-8")
    after = json.loads(after_text)
    assert "DDP043" not in out and "DDP022" not in out
    # Layout: nbformat's one-space indentation and raw non-ASCII text are kept.
    assert after_text.startswith('{\n "cells": [\n') and "résumé" in after_text
    assert list(after) == list(before)
    for old, new in zip(before["cells"], after["cells"]):
        assert list(new) == list(old)
        assert {k: v for k, v in new.items() if k != "source"} == {
            k: v for k, v in old.items() if k != "source"
        }
    sources = ["".join(cell["source"]) for cell in after["cells"]]
    assert sources[1].startswith("!pip install -q torch\n%matplotlib inline\n")
    assert "from torch.amp import GradScaler, autocast" in sources[1]
    assert 'scaler = GradScaler("cuda")  # fp16 loss scaling' in sources[3]
    assert sources[4] == "%%capture --no-display\nprint('warming up')"
    assert 'with autocast("cuda"):' in sources[5]
    assert "sampler.set_epoch(epoch)" in sources[5]
    assert sources[0] == "".join(before["cells"][0]["source"])
    # Fixing again changes nothing.
    run(capsys, "check", str(path), "--fix")
    assert path.read_text(encoding="utf-8") == after_text


def test_a_broken_notebook_is_ddp000_and_the_others_are_checked(capsys, tmp_path):
    (tmp_path / "broken.ipynb").write_text('{"cells": [', encoding="utf-8")
    shutil.copy(FIXTURE, tmp_path / "good.ipynb")
    code, out, err = run(capsys, "check", str(tmp_path), "--output-format", "concise")
    assert "internal error" not in err
    assert "broken.ipynb:1:1: DDP000" in out
    assert "good.ipynb:cell 4:8:10: DDP043" in out
    assert code == 1


def test_an_editor_buffer_of_a_notebook_is_fixed_and_given_back(capsysbinary, monkeypatch):
    import io
    import sys

    data = FIXTURE.read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = main(["check", "--fix", "--stdin-filename", "nb.ipynb", "-"])
    out, err = capsysbinary.readouterr()
    fixed = json.loads(out)
    fixed_cell = "".join(fixed["cells"][3]["source"])
    assert 'scaler = GradScaler("cuda")  # fp16 loss scaling' in fixed_cell
    assert fixed["cells"][1]["outputs"] == json.loads(data)["cells"][1]["outputs"]
    assert b"nb.ipynb:cell 3:3:1: DDP010" in err
    assert code == 1


def test_migrate_refuses_a_notebook_with_a_reason(capsys, tmp_path):
    path = tmp_path / "nb.ipynb"
    shutil.copy(FIXTURE, path)
    code = main(["migrate", str(path)])
    assert code == 2
    assert "migrate takes Python scripts" in capsys.readouterr().err
    assert path.read_bytes() == FIXTURE.read_bytes()


def test_diff_shows_each_changed_cell_and_writes_nothing(capsys, tmp_path):
    path = tmp_path / "nb.ipynb"
    shutil.copy(FIXTURE, path)
    code, out, _ = run(capsys, "check", str(path), "--diff")
    assert code == 1
    assert f"--- a/{path}:cell 4\n+++ b/{path}:cell 4\n" in out
    assert '+scaler = GradScaler("cuda")  # fp16 loss scaling\n' in out
    assert "ddpify:" not in out  # none of the virtual script's cell markers
    assert path.read_bytes() == FIXTURE.read_bytes()


def test_cached_results_keep_their_cells(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(FIXTURE, "nb.ipynb")
    first = main(["check", "nb.ipynb", "--output-format", "concise"])
    cold = capsys.readouterr().out
    assert (tmp_path / ".ddpify_cache").is_dir()
    second = main(["check", "nb.ipynb", "--output-format", "concise"])
    assert (first, cold) == (second, capsys.readouterr().out)
    assert "nb.ipynb:cell 4:8:10: DDP043" in cold
