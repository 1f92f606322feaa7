"""Finding Python files, reading them faithfully, and writing them back atomically."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import stat
import tokenize
from collections.abc import Iterable, Iterator, Sequence
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
    """A file that cannot be read, decoded or written; the message is shown to the user."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    encoding: str
    newline: str
    has_bom: bool
    # The bytes as read: a write first checks the file still holds exactly these.
    data: bytes | None = None

    def encode(self, text: str) -> bytes:
        try:
            data = text.encode(self.encoding)
        except (UnicodeError, LookupError) as exc:
            raise SourceError(f"the new text cannot be encoded as {self.encoding}: {exc}") from None
        return (b"\xef\xbb\xbf" + data) if self.has_bom and self.encoding == "utf-8" else data


def _too_big(size: int) -> SourceError:
    return SourceError(f"file is {size / 1e6:.1f} MB, over the {MAX_FILE_BYTES // 2**20} MiB limit")


def decode_source(data: bytes, path: str) -> SourceFile:
    """Decode like Python does: BOM, then a PEP 263 coding cookie, then UTF-8."""
    if len(data) > MAX_FILE_BYTES:
        raise _too_big(len(data))
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "unknown encoding" in str(exc):
            raise SourceError(f"{exc}") from None
        encoding = "utf-8"  # undecodable first lines: let the decode below say where
    raw = data
    has_bom = encoding == "utf-8-sig"
    if has_bom:
        encoding = "utf-8"
        data = data[3:]
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise SourceError(
            f"cannot decode as {encoding} at byte {exc.start}: {exc.reason} "
            "(declare the encoding with a '# -*- coding: ... -*-' line)"
        ) from None
    except (UnicodeError, LookupError, ValueError) as exc:
        # Codecs such as `undefined`, `idna` or `punycode` fail in their own ways.
        raise SourceError(f"cannot decode with the declared encoding {encoding!r}: {exc}") from None
    return SourceFile(path, text, encoding, _newline_of(text), has_bom, data=raw)


def read_bounded(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file, refusing FIFOs, devices and directories before
    reading, and never reading more than `limit` (default MAX_FILE_BYTES) + 1 bytes."""
    limit = MAX_FILE_BYTES if limit is None else limit
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SourceError("not a regular file (a FIFO, device or directory); not read")
        if info.st_size > limit:
            raise _too_big(info.st_size)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:  # a file that grew, or a size the file system does not report
            raise _too_big(total)
        return b"".join(chunks)
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def read_source(path: str | Path) -> SourceFile:
    return decode_source(read_bounded(path), str(path))


def _newline_of(text: str) -> str:
    index = text.find("\n")
    if index > 0 and text[index - 1] == "\r":
        return "\r\n"
    if index == -1 and "\r" in text:
        return "\r"
    return "\n"


# Temporary files are named `.<target>.ddpify-<pid>-<random>.tmp`: recognisable, and a
# later run can tell that one belongs to a process that is gone (a killed write).
TEMP_MARK = ".ddpify-"
TEMP_SUFFIX = ".tmp"


def _temp_pid(name: str, target: str) -> int | None:
    prefix = f".{target}{TEMP_MARK}"
    if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)):
        return None
    pid = name[len(prefix) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def clean_stale_temp_files(target: Path) -> None:
    """Remove the temporary files a killed ddpify left next to `target`."""
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return
    for entry in entries:
        pid = _temp_pid(entry.name, target.name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _check_writable(path: Path, info: os.stat_result, force: bool) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise SourceError("not a regular file; not written")
    if force:
        return
    if not info.st_mode & 0o222 or not os.access(path, os.W_OK):
        raise SourceError("is read-only; not written (--force-write to rewrite it anyway)")
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise SourceError(
            "is owned by another user; not written (--force-write to rewrite it anyway)"
        )


def _check_unchanged(path: Path, expected: bytes) -> None:
    try:
        current = read_bounded(path, max(MAX_FILE_BYTES, len(expected)))
    except SourceError:
        current = None
    if current != expected:
        raise SourceError("changed on disk since ddpify read it; not written (run again)")


def write_file(
    path: str | Path, data: bytes, *, expected: bytes | None = None, force: bool = False
) -> None:
    """Write `data` to `path` without losing anything: through a symlink to its target;
    only if the file still holds `expected` (when given); read-only files and files of
    another user only with `force`; owner, group and mode kept; fsync, then an atomic
    rename; a file with several hard links is rewritten in place so the links stay one
    file. Raises SourceError with a one-line reason."""
    target = Path(os.path.realpath(path))
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None
    if info is not None:
        _check_writable(target, info, force)
    if expected is not None:
        _check_unchanged(target, expected)
    try:
        if info is not None and info.st_nlink > 1:
            _write_in_place(target, data)
        else:
            clean_stale_temp_files(target)
            try:
                _replace(target, data, info)
            except _OwnerNotKept:
                # A new file cannot get the old owner or group (no privilege to chown):
                # rewriting the file itself keeps them.
                _write_in_place(target, data)
    except OSError as exc:
        raise SourceError(exc.strerror or str(exc)) from None


def write_files(
    writes: Sequence[tuple[str | Path, bytes, bytes | None]], *, force: bool = False
) -> None:
    """Write several files, all or none: (path, data, expected bytes or None) each.

    Every file is checked first (writable, still holding `expected`); then each is
    written as `write_file` writes one. If a write fails, the files already written get
    their old bytes back, and SourceError names the file that failed."""
    for path, _data, expected in writes:
        target = Path(os.path.realpath(path))
        try:
            info = os.stat(target)
        except FileNotFoundError:
            info = None
        except OSError as exc:
            raise SourceError(f"{path}: {exc.strerror or exc}") from None
        try:
            if info is not None:
                _check_writable(target, info, force)
            if expected is not None:
                _check_unchanged(target, expected)
        except SourceError as exc:
            raise SourceError(f"{path}: {exc}") from None
    done: list[tuple[str | Path, bytes | None]] = []
    for path, data, expected in writes:
        try:
            write_file(path, data, expected=expected, force=force)
        except SourceError as exc:
            _restore(done)
            kept = "; the files written before it were restored" if done else ""
            raise SourceError(f"{path}: {exc}{kept}") from None
        done.append((path, expected))


def _restore(done: list[tuple[str | Path, bytes | None]]) -> None:
    for path, original in reversed(done):
        with contextlib.suppress(SourceError, OSError):
            if original is None:
                os.unlink(path)
            else:
                write_file(path, original, force=True)


class _OwnerNotKept(Exception):
    """The temporary file cannot be given the owner and group of the file it replaces."""


def _write_in_place(target: Path, data: bytes) -> None:
    fd = os.open(target, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _replace(target: Path, data: bytes, info: os.stat_result | None) -> None:
    tmp = (
        target.parent / f".{target.name}{TEMP_MARK}{os.getpid()}-{os.urandom(4).hex()}{TEMP_SUFFIX}"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            _write_all(fd, data)
            if info is not None:
                made = os.fstat(fd)
                if hasattr(os, "fchown") and (info.st_uid, info.st_gid) != (
                    made.st_uid,
                    made.st_gid,
                ):
                    # Ownership first: chown clears set-id bits, the chmod below restores
                    # exactly the old mode. Where it cannot be kept, the caller writes the
                    # file in place instead.
                    try:
                        os.fchown(fd, info.st_uid, info.st_gid)
                    except PermissionError:
                        raise _OwnerNotKept from None
                os.fchmod(fd, stat.S_IMODE(info.st_mode))
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(target.parent)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace a file ddpify owns (its cache) with `data`: readers see old or new, never half."""
    write_file(path, data, force=True)


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
    """Yield .py, .pyi and .ipynb files under `root` in a stable order, skipping tool and
    ignored dirs."""
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
                if entry.name in SKIPPED_DIRS or os.path.exists(path / "pyvenv.cfg"):
                    continue
                yield from walk(path, ignores)
            elif entry.name.endswith((".py", ".pyi", ".ipynb")) and entry.is_file():
                yield path

    yield from walk(root, [])
