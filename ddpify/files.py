"""Finding Python files, reading them faithfully, and writing them back atomically."""

from __future__ import annotations

import fnmatch
import io
import os
import tempfile
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Files larger than this are not parsed: real training scripts are far smaller, and
# a multi-megabyte file is almost always generated code or data.
MAX_FILE_BYTES = 5 * 1024 * 1024

SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".tox",
        ".nox",
        ".venv",
        "venv",
        "env",
        "__pycache__",
        "build",
        "dist",
        "node_modules",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".eggs",
        "site-packages",
        ".ddpify_cache",
    }
)


class SourceError(Exception):
    """A file that cannot be read or decoded; the message is shown to the user."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    encoding: str
    newline: str
    has_bom: bool

    def encode(self, text: str) -> bytes:
        data = text.encode(self.encoding)
        return (b"\xef\xbb\xbf" + data) if self.has_bom and self.encoding == "utf-8" else data


def decode_source(data: bytes, path: str) -> SourceFile:
    """Decode like Python does: BOM, then a PEP 263 coding cookie, then UTF-8."""
    if len(data) > MAX_FILE_BYTES:
        raise SourceError(
            f"file is {len(data) / 1e6:.1f} MB, over the {MAX_FILE_BYTES // 2**20} MiB limit"
        )
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "unknown encoding" in str(exc):
            raise SourceError(f"{exc}") from None
        encoding = "utf-8"  # undecodable first lines: let the decode below say where
    has_bom = encoding == "utf-8-sig"
    if has_bom:
        encoding = "utf-8"
        data = data[3:]
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        reason = exc.reason if isinstance(exc, UnicodeDecodeError) else str(exc)
        position = f" at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else ""
        raise SourceError(
            f"cannot decode as {encoding}{position}: {reason} "
            "(declare the encoding with a '# -*- coding: ... -*-' line)"
        ) from None
    return SourceFile(path, text, encoding, _newline_of(text), has_bom)


def read_source(path: str | Path) -> SourceFile:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None
    return decode_source(data, str(path))


def _newline_of(text: str) -> str:
    index = text.find("\n")
    if index > 0 and text[index - 1] == "\r":
        return "\r\n"
    if index == -1 and "\r" in text:
        return "\r"
    return "\n"


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never half."""
    path = Path(path)
    mode = path.stat().st_mode if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ddpify")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class GitIgnore:
    """The subset of .gitignore semantics that matters for skipping files."""

    def __init__(self, root: Path, patterns: list[str]):
        self.root = root
        self.rules = []
        for raw in patterns:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            line = line[1:] if negated else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            # A slash at the start or in the middle anchors the pattern to this directory.
            anchored = "/" in line
            self.rules.append((line.lstrip("/"), negated, dir_only, anchored))

    @classmethod
    def load(cls, directory: Path) -> GitIgnore | None:
        file = directory / ".gitignore"
        try:
            return cls(directory, file.read_text(encoding="utf-8", errors="replace").splitlines())
        except OSError:
            return None

    def ignores(self, path: Path, is_dir: bool) -> bool:
        try:
            rel = path.relative_to(self.root).as_posix()
        except ValueError:
            return False
        ignored = False
        for pattern, negated, dir_only, anchored in self.rules:
            if dir_only and not is_dir:
                continue
            target = rel if anchored else path.name
            if fnmatch.fnmatchcase(target, pattern) or (
                not anchored and fnmatch.fnmatchcase(rel, pattern)
            ):
                ignored = not negated
        return ignored


def iter_python_files(
    root: Path, exclude: Iterable[str] = (), respect_gitignore: bool = True
) -> Iterator[Path]:
    """Yield .py files under `root` in a stable order, skipping tool and ignored dirs."""
    exclude = tuple(exclude)

    def excluded(path: Path) -> bool:
        return any(
            fnmatch.fnmatchcase(path.name, pat) or fnmatch.fnmatchcase(path.as_posix(), pat)
            for pat in exclude
        )

    def walk(directory: Path, ignores: list[GitIgnore]) -> Iterator[Path]:
        if respect_gitignore:
            own = GitIgnore.load(directory)
            ignores = ignores + [own] if own else ignores
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            path = Path(entry.path)
            is_dir = entry.is_dir()
            if excluded(path) or any(ig.ignores(path, is_dir) for ig in ignores):
                continue
            if is_dir:
                if entry.name in SKIPPED_DIRS or (path / "pyvenv.cfg").exists():
                    continue
                yield from walk(path, ignores)
            elif entry.name.endswith((".py", ".pyi")) and entry.is_file():
                yield path

    yield from walk(root, [])
