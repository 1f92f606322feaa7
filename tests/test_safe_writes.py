"""Writing user files: nothing lost, nothing changed behind the user's back."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from ddpify.files import SourceError, read_bounded, read_source, write_file

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def test_a_file_changed_since_it_was_read_is_not_overwritten(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    source = read_source(path)
    path.write_bytes(b"edited by the user\n")
    with pytest.raises(SourceError, match="changed on disk"):
        write_file(path, b"fixed\n", expected=source.data)
    assert path.read_bytes() == b"edited by the user\n"


def test_writes_go_through_a_symlink_to_its_target(tmp_path):
    target = tmp_path / "real.py"
    target.write_bytes(b"old\n")
    link = tmp_path / "train.py"
    link.symlink_to(target)
    write_file(link, b"new\n", expected=b"old\n")
    assert link.is_symlink()
    assert target.read_bytes() == b"new\n"


def test_hard_links_stay_one_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    other = tmp_path / "copy.py"
    os.link(path, other)
    write_file(path, b"new\n", expected=b"old\n")
    assert other.read_bytes() == b"new\n"
    assert os.path.samefile(path, other)


def test_read_only_files_are_refused_unless_forced(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    os.chmod(path, 0o444)
    with pytest.raises(SourceError, match="read-only"):
        write_file(path, b"new\n")
    assert path.read_bytes() == b"old\n"
    write_file(path, b"new\n", force=True)
    assert path.read_bytes() == b"new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


@pytest.mark.skipif(not IS_ROOT, reason="only root can create a file of another user")
def test_foreign_files_are_refused_and_forced_writes_keep_owner_and_mode(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    os.chown(path, 1234, 1234)
    os.chmod(path, 0o4755)
    with pytest.raises(SourceError, match="owned by another user"):
        write_file(path, b"new\n")
    write_file(path, b"new\n", force=True)
    info = path.stat()
    assert (info.st_uid, info.st_gid) == (1234, 1234)
    assert stat.S_IMODE(info.st_mode) == 0o4755


def test_stale_temp_files_of_a_killed_write_are_cleaned(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".train.py.ddpify-{dead.stdout.strip()}-0000.tmp"
    stale.write_bytes(b"partial")
    unrelated = tmp_path / ".train.py.swp"
    unrelated.write_bytes(b"vim")
    write_file(path, b"new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".train.py.swp", "train.py"]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match="not a regular file"):
        read_bounded(fifo)


def test_a_device_is_refused_before_reading():
    with pytest.raises(SourceError, match="not a regular file"):
        read_bounded("/dev/zero")


def test_reads_stop_at_the_limit(tmp_path):
    path = tmp_path / "big.py"
    path.write_bytes(b"x = 1\n" * 100)
    with pytest.raises(SourceError, match="over the"):
        read_bounded(path, limit=50)


@pytest.mark.parametrize("cookie", ["undefined", "punycode", "idna"])
def test_odd_coding_cookies_are_a_source_error(tmp_path, cookie):
    path = tmp_path / "t.py"
    path.write_bytes(f"# coding: {cookie}\nimport torch\n".encode("ascii") + b"x = '\xff'\n")
    with pytest.raises(SourceError):
        read_source(path)


def test_a_file_with_a_bom_counts_as_unchanged(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(b"\xef\xbb\xbfx = 1\r\n")
    source = read_source(path)
    write_file(path, source.encode("x = 2\r\n"), expected=source.data)
    assert path.read_bytes() == b"\xef\xbb\xbfx = 2\r\n"


def test_when_the_owner_cannot_be_kept_the_file_is_rewritten_in_place(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_bytes(b"old\n")
    os.chmod(path, 0o640)
    before = path.stat()
    made = os.fstat

    def other_group(fd):  # the temporary file comes out in another group
        info = made(fd)
        fields = list(info)
        fields[stat.ST_GID] = info.st_gid + 1
        return os.stat_result(fields)

    def no_privilege(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fstat", other_group)
    monkeypatch.setattr(os, "fchown", no_privilege)
    write_file(path, b"new\n", expected=b"old\n")
    after = path.stat()
    assert path.read_bytes() == b"new\n"
    assert after.st_ino == before.st_ino  # the same file, so the same owner and group
    assert stat.S_IMODE(after.st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]
