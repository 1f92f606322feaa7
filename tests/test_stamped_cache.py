"""Files read for cross-module facts are kept while unchanged, one version per path."""

from __future__ import annotations

import os

from ddpify.analysis.project import StampedCache


def test_an_unchanged_file_is_computed_once(tmp_path):
    path = tmp_path / "utils.py"
    path.write_text("x = 1\n")
    cache, calls = StampedCache(), []
    for _ in range(3):
        assert cache.get(path, lambda p: calls.append(p) or p.read_text()) == "x = 1\n"
    assert calls == [path]


def test_a_changed_file_replaces_its_old_version(tmp_path):
    path = tmp_path / "utils.py"
    cache = StampedCache()
    for version in range(5):
        path.write_text(f"x = {version}\n")
        # a save within the filesystem's timestamp granularity must still count as a change
        os.utime(path, ns=(version * 10**9, version * 10**9))
        assert cache.get(path, lambda p: p.read_text()) == f"x = {version}\n"
    assert len(cache._entries) == 1


def test_a_file_that_disappears_is_dropped(tmp_path):
    path = tmp_path / "utils.py"
    path.write_text("x = 1\n")
    cache = StampedCache()
    cache.get(path, lambda p: p.read_text())
    path.unlink()
    assert cache.get(path, lambda p: p.read_text()) is None
    assert cache._entries == {}
