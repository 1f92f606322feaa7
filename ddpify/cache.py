"""A content-hash cache of per-file results, so an unchanged tree re-checks in I/O time.

Keyed by the file's bytes, its name (diagnostics carry it), the enabled rule codes and
a fingerprint of ddpify's own code (version, and each module's size and mtime, so an
edited checkout never serves stale results): any change to one of them is a miss.
Stored as one JSON document, written atomically at the end of a run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpify import __version__
from ddpify.diagnostics import Applicability, Diagnostic, Edit, Fix, Location, Severity
from ddpify.engine import FileResult
from ddpify.files import SourceError, read_bounded, write_atomic

CACHE_DIR = ".ddpify_cache"
CACHE_FILE = "check-results.json"
CACHE_ENV = "DDPIFY_CACHE_DIR"


def cache_dir_from_env() -> Path:
    """$DDPIFY_CACHE_DIR, or the default when it is unset or empty (an empty value must
    not mean "the current directory")."""
    return Path(os.environ.get(CACHE_ENV, "").strip() or CACHE_DIR)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _location(data: dict[str, int]) -> Location:
    return Location(data["row"], data["column"])


def _encode(d: Diagnostic) -> dict[str, Any]:
    from ddpify.output.json_format import to_dict

    return {**to_dict(d), "source_lines": list(d.source_lines)}


def _decode(data: dict[str, Any]) -> Diagnostic:
    fix = None
    if data["fix"] is not None:
        edits = tuple(
            Edit(e["content"], _location(e["location"]), _location(e["end_location"]))
            for e in data["fix"]["edits"]
        )
        fix = Fix(data["fix"]["message"], Applicability(data["fix"]["applicability"]), edits)
    return Diagnostic(
        data["code"],
        data["name"],
        Severity(data["severity"]),
        data["message"],
        data["filename"],
        _location(data["location"]),
        _location(data["end_location"]),
        fix,
        tuple(data["source_lines"]),
        data.get("cell"),
    )


def _digest_of(path: str) -> str | None:
    try:
        return hashlib.sha256(read_bounded(path)).hexdigest()
    except SourceError:
        return None


class ResultCache:
    def __init__(self, directory: Path, codes: Sequence[str]) -> None:
        self.path = directory / CACHE_FILE
        self.salt = f"{code_fingerprint()}\0{','.join(sorted(codes))}".encode()
        self.entries: dict[str, Any] = {}
        self.used: dict[str, Any] = {}
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                self.entries = loaded
        except (OSError, ValueError):
            pass  # no cache yet, or a damaged one: start afresh

    def key(self, filename: str, data: bytes) -> str:
        digest = hashlib.sha256(self.salt)
        digest.update(filename.encode("utf-8", "surrogateescape") + b"\0")
        digest.update(data)
        return digest.hexdigest()

    def get(self, key: str) -> FileResult | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            result = FileResult(
                entry["filename"], [_decode(d) for d in entry["diagnostics"]], entry["skipped"]
            )
        except (KeyError, TypeError, ValueError):
            return None
        depends_on = entry.get("depends_on") or {}
        if not all(_digest_of(path) == digest for path, digest in depends_on.items()):
            return None  # a helper module it read has changed
        result.depends_on = dict(depends_on)
        self.used[key] = entry
        return result

    def put(self, key: str, result: FileResult) -> None:
        if result.crashes:
            return  # never cache the output of a bug
        self.used[key] = {
            "filename": result.filename,
            "skipped": result.skipped,
            "diagnostics": [_encode(d) for d in result.diagnostics],
            "depends_on": result.depends_on,
        }

    def save(self) -> None:
        """Keep what this run used; entries for files that changed or vanished go."""
        directory = self.path.parent
        try:
            ours = not directory.exists() or directory.name == CACHE_DIR
            directory.mkdir(parents=True, exist_ok=True)
            gitignore = directory / ".gitignore"
            # Only a directory that is the cache's own gets a `*` .gitignore: written
            # into a project directory it would hide every new file from git.
            if ours and not gitignore.exists():
                gitignore.write_text("# created by ddpify\n*\n", encoding="utf-8")
            write_atomic(self.path, json.dumps(self.used).encode("utf-8"))
        except (OSError, SourceError):
            pass  # a read-only tree still gets its lint results
