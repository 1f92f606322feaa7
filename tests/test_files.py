"""Reading and writing user files without losing anything."""

from __future__ import annotations

import os
import stat

import pytest

from ddpify.files import SourceError, decode_source, iter_python_files, read_source, write_atomic


def test_decode_keeps_newline_style_and_bom():
    source = decode_source(b"\xef\xbb\xbfimport torch\r\nx = 1\r\n", "t.py")
    assert source.text == "import torch\r\nx = 1\r\n"
    assert source.newline == "\r\n" and source.has_bom
    assert source.encode(source.text) == b"\xef\xbb\xbfimport torch\r\nx = 1\r\n"


def test_coding_cookie_is_honoured_both_ways():
    data = "# -*- coding: cp1252 -*-\n# café\n".encode("cp1252")
    source = decode_source(data, "t.py")
    assert "café" in source.text and source.encoding == "cp1252"
    assert source.encode(source.text) == data


def test_undecodable_bytes_name_the_problem():
    with pytest.raises(SourceError, match="cannot decode as utf-8 at byte 5"):
        decode_source(b"# caf\xe9\nimport torch\n", "t.py")


def test_unknown_declared_encoding():
    with pytest.raises(SourceError, match="unknown encoding"):
        decode_source(b"# -*- coding: klingon -*-\nimport torch\n", "t.py")


def test_huge_files_are_refused(monkeypatch):
    monkeypatch.setattr("ddpify.files.MAX_FILE_BYTES", 10)
    with pytest.raises(SourceError, match="over the"):
        decode_source(b"x = 1\n" * 10, "t.py")


def test_missing_file_message():
    with pytest.raises(SourceError, match="No such file"):
        read_source("/nonexistent/train.py")


def test_write_atomic_keeps_mode_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("old\n")
    os.chmod(path, 0o754)
    write_atomic(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o754
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_walk_skips_tool_dirs_gitignored_paths_and_virtualenvs(tmp_path):
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/c.txt",
        ".git/x.py",
        "node_modules/y.py",
        "env2/pyvenv.cfg",
        "env2/lib/z.py",
        "logs/run.py",
        "pkg/gen_1.py",
        "keep/gen_2.py",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / ".gitignore").write_text("logs/\n# comment\n/keep/*.py\n!keep/gen_2.py\n")
    (tmp_path / "pkg" / ".gitignore").write_text("gen_*.py\n")
    found = [p.relative_to(tmp_path).as_posix() for p in iter_python_files(tmp_path)]
    assert found == ["a.py", "keep/gen_2.py", "pkg/b.py"]
