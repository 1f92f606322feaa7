"""The library entry points the CLI, the language server and tests share."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpify.cache import ResultCache
from ddpify.diagnostics import Diagnostic, Severity
from ddpify.engine import FileResult, check_bytes, parse_error
from ddpify.files import SourceError, iter_python_files, read_bounded
from ddpify.guarded import GaveUp, isolated
from ddpify.notebooks import check_notebook, is_notebook
from ddpify.rules import RULES_BY_CODE
from ddpify.rules.base import Rule

# Below this many files, starting worker processes costs more than it saves.
PARALLEL_THRESHOLD = 24


@dataclass
class CheckReport:
    results: list[FileResult] = field(default_factory=list)
    # Paths that could not be checked at all (missing, unreadable): shown as errors.
    path_errors: list[str] = field(default_factory=list)
    # Directories given on the command line that held no Python file.
    empty_dirs: list[str] = field(default_factory=list)

    @property
    def diagnostics(self) -> list[Diagnostic]:
        return [d for result in self.results for d in result.diagnostics]

    @property
    def crashes(self) -> list[str]:
        """Internal errors: a rule that raised on a file (its other findings still count)."""
        return [f"{r.filename}: {crash}" for r in self.results for crash in r.crashes]

    @property
    def files_checked(self) -> int:
        return len(self.results)

    def count(self, severity: Severity) -> int:
        return sum(1 for d in self.diagnostics if d.severity is severity)

    @property
    def failed(self) -> bool:
        return any(d.fails for d in self.diagnostics)


def check_source(text: str, filename: str, rules: Sequence[type[Rule]]) -> list[Diagnostic]:
    """Lint source text (an editor buffer, stdin); never skipped for lack of `torch`."""
    return check_bytes(text.encode("utf-8"), filename, rules).diagnostics


def collect_files(
    paths: Iterable[str], exclude: Sequence[str] = ()
) -> tuple[list[Path], list[str], list[str]]:
    """Expand paths to Python files; return (files, path errors, empty directories)."""
    files: list[Path] = []
    errors: list[str] = []
    empty: list[str] = []
    for raw in paths:
        path = Path(raw)
        if os.path.isdir(path):
            found = list(iter_python_files(path, exclude))
            if not found:
                empty.append(raw)
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        elif path.exists() or path.is_symlink():
            errors.append(f"{raw}: not a regular file or directory")
        else:
            errors.append(f"{raw}: no such file or directory")
    unique = list(dict.fromkeys(files))
    return unique, errors, empty


def _read_failure(path: Path, exc: SourceError) -> FileResult:
    return FileResult(str(path), [parse_error(str(path), f"cannot read file: {exc}")])


def _check_data(args: tuple[str, bytes, Sequence[str]]) -> FileResult:
    filename, data, codes = args
    rules = [RULES_BY_CODE[code] for code in codes]
    if is_notebook(filename):
        return check_notebook(data, filename, rules)
    return check_bytes(data, filename, rules)


def _check_in_pool(work: list[tuple[str, bytes, Sequence[str]]], jobs: int) -> list[FileResult]:
    results: list[FileResult | None] = [None] * len(work)
    try:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for index, result in enumerate(pool.map(_check_data, work, chunksize=8)):
                results[index] = result
    except BrokenProcessPool:
        # A worker died inside native code. Check what is left one file per child, so the
        # file that kills it is named and every other file still gets its findings.
        pass
    return [
        result if result is not None else _check_alone(item) for result, item in zip(results, work)
    ]


def _check_alone(item: tuple[str, bytes, Sequence[str]]) -> FileResult:
    name = item[0]
    try:
        return isolated(_check_data, item)
    except GaveUp as exc:
        return FileResult(name, [parse_error(name, f"cannot analyse: {exc}")])


def check_paths(
    paths: Iterable[str],
    rules: Sequence[type[Rule]],
    *,
    exclude: Sequence[str] = (),
    jobs: int | None = None,
    cache_dir: Path | None = None,
    on_file: Callable[[FileResult], None] | None = None,
) -> CheckReport:
    """Lint files and directories. With `cache_dir`, unchanged files are not re-parsed."""
    files, errors, empty = collect_files(paths, exclude)
    report = CheckReport(path_errors=errors, empty_dirs=empty)
    codes = [rule.CODE for rule in rules]
    cache = ResultCache(cache_dir, codes) if cache_dir is not None else None

    results: dict[int, FileResult] = {}
    pending: list[tuple[int, str, bytes]] = []
    for index, path in enumerate(files):
        try:
            data = read_bounded(path)
        except SourceError as exc:
            results[index] = _read_failure(path, exc)
            continue
        hit = cache.get(cache.key(str(path), data)) if cache else None
        if hit is not None:
            results[index] = hit
        else:
            pending.append((index, str(path), data))

    work = [(name, data, codes) for _, name, data in pending]
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs > 1 and len(work) >= PARALLEL_THRESHOLD:
        fresh = _check_in_pool(work, jobs)
    else:
        fresh = [_check_data(item) for item in work]
    for (index, name, data), result in zip(pending, fresh):
        results[index] = result
        if cache:
            cache.put(cache.key(name, data), result)
    if cache:
        cache.save()

    for index in sorted(results):
        report.results.append(results[index])
        if on_file:
            on_file(results[index])
    return report
