"""`ddpify check`: lint files or stdin, optionally fix, render in the chosen format."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ddpify import engine
from ddpify.api import CheckReport, check_paths, collect_files
from ddpify.cache import cache_dir_from_env
from ddpify.config import Config, ConfigError, load_config
from ddpify.diagnostics import Diagnostic, Severity
from ddpify.files import SourceError, decode_source, read_bounded, read_source, write_file
from ddpify.fixes import fix_until_stable, fixable
from ddpify.gates import GateError
from ddpify.notebooks import cell_diff, is_notebook, read_notebook, to_cells, with_script
from ddpify.output import HUMAN_FORMATS, RENDERERS, statistics
from ddpify.rules import UnknownRuleError
from ddpify.rules.base import Rule

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
JSON_FORMATS = {"json", "json-lines"}

EXAMPLES = """\
examples:
  ddpify check train.py                 lint one script
  ddpify check src/ --select DDP05      only the rank-0 side-effect rules
  ddpify check . --ignore DDP052        everything but the logging advice
  ddpify check . --fix                  apply the safe fixes (--diff: show them only)
  ddpify check . --output-format sarif --output-file ddpify.sarif   for code scanning
  ddpify check --stdin-filename train.py - < train.py                for editors

Suppress one finding with `# noqa: DDP022` on its line. Explain a code: `ddpify rule DDP022`.
Settings live in [tool.ddpify] of the nearest pyproject.toml, or in a ddpify.toml.
"""


def codes(value: str) -> list[str]:
    return [part.strip().upper() for part in value.split(",") if part.strip()]


def codes_or_globs(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="lint scripts for DDP problems",
        description="Report DistributedDataParallel problems in Python files.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "paths", nargs="*", default=["."], help="files or directories (default: .); - for stdin"
    )
    parser.add_argument("--select", type=codes, help="comma-separated codes or prefixes to enable")
    parser.add_argument("--ignore", type=codes, default=[], help="codes or prefixes to disable")
    parser.add_argument(
        "--extend-select", type=codes, default=[], help="codes to enable on top of the defaults"
    )
    parser.add_argument(
        "--output-format",
        choices=sorted(RENDERERS),
        help="full (default on a terminal), concise (default otherwise), json, json-lines, "
        "sarif, github, pylint",
    )
    parser.add_argument("--output-file", metavar="PATH", help="write the report to PATH")
    parser.add_argument("--exclude", type=codes_or_globs, default=[], help="glob patterns to skip")
    fixing = parser.add_argument_group("fixes")
    fixing.add_argument("--fix", action="store_true", help="apply the safe fixes")
    fixing.add_argument(
        "--unsafe-fixes",
        action="store_true",
        default=None,
        help="also apply (with --fix) or show (with --diff) the unsafe fixes",
    )
    fixing.add_argument(
        "--no-unsafe-fixes",
        dest="unsafe_fixes",
        action="store_false",
        help="override `unsafe-fixes = true` in the configuration",
    )
    fixing.add_argument(
        "--diff", action="store_true", help="print the fixes as a diff; write nothing"
    )
    fixing.add_argument(
        "--force-write",
        action="store_true",
        help="with --fix, also rewrite read-only files and files owned by another user",
    )
    parser.add_argument(
        "--statistics", action="store_true", help="count findings per code instead of listing"
    )
    parser.add_argument("--exit-zero", action="store_true", help="exit 0 even when findings remain")
    parser.add_argument(
        "--stdin-filename",
        metavar="PATH",
        help="read the source from stdin, reported (and configured) as PATH",
    )
    settings = parser.add_mutually_exclusive_group()
    settings.add_argument("--config", metavar="PATH", help="use this pyproject.toml/ddpify.toml")
    settings.add_argument("--isolated", action="store_true", help="ignore every configuration file")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="re-check every file (results are cached in .ddpify_cache/ by content hash; "
        "DDPIFY_CACHE_DIR moves it)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary line")
    parser.set_defaults(run=run)


@dataclass
class FixTotals:
    fixed: int = 0
    diffs: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # gate failures: nothing written


def summary(report: CheckReport) -> str:
    counts = ", ".join(
        f"{report.count(severity)} {severity.value}{'s' if report.count(severity) != 1 else ''}"
        for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO)
    )
    files = report.files_checked
    return f"Checked {files} file{'s' if files != 1 else ''}: {counts}."


def fix_summary(fixed: int, remaining: int, applied: bool = True) -> str:
    verb = "Fixed" if applied else "Would fix"
    finding = "finding" if fixed == 1 else "findings"
    return f"{verb} {fixed} {finding}, {remaining} remaining."


def _config_start(paths: list[str], stdin_filename: str | None) -> Path:
    """Where the nearest-configuration search begins: the stdin file's place, or the
    deepest directory holding every path given."""
    if stdin_filename:
        return Path(stdin_filename).absolute()
    existing = [str(Path(p).absolute()) for p in paths if p != "-" and Path(p).exists()]
    if not existing:
        return Path.cwd()
    return Path(os.path.commonpath(existing))


def _output_among_inputs(output: str, inputs: list[str]) -> bool:
    """Whether writing the report to `output` would overwrite a checked file: one named on
    the command line, or one inside a directory named there."""
    out = Path(output).absolute()
    if not out.exists():
        return False
    for raw in inputs:
        path = Path(raw).absolute()
        if not path.exists():
            continue
        if os.path.isdir(path):
            if out.suffix in (".py", ".pyi", ".ipynb") and out.resolve().is_relative_to(
                path.resolve()
            ):
                return True
        elif os.path.samefile(out, path):
            return True
    return False


def _error(message: str) -> int:
    print(f"ddpify: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def run(args: argparse.Namespace) -> int:
    reading_stdin = args.stdin_filename is not None or "-" in args.paths
    if reading_stdin and args.paths not in (["."], ["-"]):
        return _error("`-` (stdin) cannot be combined with other paths")
    try:
        config = load_config(
            args.config,
            start=_config_start(args.paths, args.stdin_filename),
            isolated=args.isolated,
        )
        rules = config.rules(args.select, args.ignore, args.extend_select)
    except (ConfigError, UnknownRuleError) as exc:
        return _error(str(exc))
    unsafe = args.unsafe_fixes if args.unsafe_fixes is not None else bool(config.unsafe_fixes)
    if args.output_file:
        inputs = [args.stdin_filename] if reading_stdin else args.paths
        clash = _output_among_inputs(args.output_file, [p for p in inputs if p and p != "-"])
        if clash:
            return _error(
                f"--output-file {args.output_file} is one of the files being checked; "
                "the report would replace it"
            )
    if reading_stdin:
        return _run_stdin(args, config, rules, unsafe)
    return _run_paths(args, config, rules, unsafe)


def _linter(
    config: Config, rules: list[type[Rule]], filename: str, crashes: list[str] | None = None
):
    """Lint text as `filename`, per-file ignores applied; rule crashes go to `crashes`."""

    def lint(text: str) -> list[Diagnostic]:
        result = engine.check_source(text, filename, rules)
        if crashes is not None:
            crashes.extend(f"{filename}: {crash}" for crash in result.crashes)
        return config.filter(result.diagnostics, filename)

    return lint


def _unified_diff(before: str, after: str, filename: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{filename}",
        tofile=f"b/{filename}",
    )
    return "".join(line if line.endswith(("\n", "\r")) else line + "\n" for line in lines)


def _fix_file(
    path: str,
    config: Config,
    rules: list[type[Rule]],
    unsafe: bool,
    args: argparse.Namespace,
    totals: FixTotals,
) -> list[Diagnostic] | None:
    """Fix one file; return its remaining findings, or None when it was left alone."""
    notebook = None
    try:
        if is_notebook(path):
            notebook = read_notebook(read_bounded(path), path)
            text, expected = notebook.text, notebook.raw
        else:
            source = read_source(path)
            text, expected = source.text, source.data
        outcome = fix_until_stable(text, _linter(config, rules, path), unsafe=unsafe, filename=path)
    except SourceError:
        return None  # already reported by the lint pass
    except GateError as exc:
        totals.failures.append(_fix_failure(path, exc, "the file was left unchanged"))
        return None
    if outcome.changed:
        if args.diff and notebook is not None:
            try:
                totals.diffs.append(cell_diff(notebook, outcome.text))
            except SourceError as exc:
                totals.failures.append(f"{path}: {exc}")
                return None
        elif args.diff:
            totals.diffs.append(_unified_diff(outcome.original, outcome.text, path))
        else:
            try:
                if notebook is not None:
                    data = with_script(notebook, outcome.text)
                else:
                    data = source.encode(outcome.text)
                write_file(path, data, expected=expected, force=args.force_write)
            except SourceError as exc:
                totals.failures.append(f"{path}: {exc}")
                return None
    totals.fixed += len(outcome.fixed)
    if notebook is not None:
        return [to_cells(notebook, d) for d in outcome.remaining]
    return outcome.remaining


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8", newline="\n") as stream:
        yield stream


def _run_paths(
    args: argparse.Namespace, config: Config, rules: list[type[Rule]], unsafe: bool
) -> int:
    name_patterns = [p for p in config.exclude_patterns if "/" not in p.strip("/")]
    files, path_errors, empty_dirs = collect_files(args.paths, [*args.exclude, *name_patterns])
    files = [f for f in files if not config.is_excluded(f)]
    cache_dir = None if args.no_cache else cache_dir_from_env()
    report = check_paths([str(f) for f in files], rules, cache_dir=cache_dir)
    report.path_errors, report.empty_dirs = path_errors, empty_dirs
    for result in report.results:
        result.diagnostics = config.filter(result.diagnostics, result.filename)
    for error in report.path_errors:
        print(f"ddpify: error: {error}", file=sys.stderr)
    for directory in report.empty_dirs:
        print(f"ddpify: warning: no Python files found under {directory}", file=sys.stderr)

    totals = FixTotals()
    if args.fix or args.diff:
        for result in report.results:
            if fixable(result.diagnostics, unsafe):
                remaining = _fix_file(result.filename, config, rules, unsafe, args, totals)
                if remaining is not None:
                    result.diagnostics = remaining
    for failure in totals.failures:
        print(f"ddpify: error: {failure}", file=sys.stderr)
    crashes = list(dict.fromkeys(report.crashes))
    for crash in crashes:
        print(f"ddpify: internal error: {crash}", file=sys.stderr)
    if crashes:
        totals.failures.extend(crashes)

    if args.diff:
        return _finish_diff(args, report, totals)
    try:
        with _output(args.output_file) as stream:
            fmt = _format(args, stream)
            _render(args, fmt, report.diagnostics, stream)
            if not args.quiet:
                _print_summary(args, fmt, report, totals, stream)
    except BrokenPipeError:
        raise
    except OSError as exc:
        return _error(f"cannot write {args.output_file}: {exc.strerror or exc}")
    if report.path_errors or totals.failures:
        return EXIT_ERROR
    return EXIT_FINDINGS if report.failed and not args.exit_zero else EXIT_OK


def _format(args: argparse.Namespace, stream: TextIO) -> str:
    if args.output_format:
        return args.output_format
    return "full" if stream.isatty() else "concise"


def _render(args: argparse.Namespace, fmt: str, diagnostics: list[Diagnostic], stream) -> None:
    if args.statistics:
        statistics.render(diagnostics, stream, as_json=fmt in JSON_FORMATS)
    else:
        RENDERERS[fmt](diagnostics, stream)


def _print_summary(args, fmt: str, report: CheckReport, totals: FixTotals, stream) -> None:
    remaining = len(report.diagnostics)
    if fmt in HUMAN_FORMATS and not args.statistics:
        print(summary(report), file=stream)
        if args.fix:
            print(fix_summary(totals.fixed, remaining), file=stream)
    elif args.fix:
        # Machine formats keep stdout parseable; the count still reaches the person.
        print(fix_summary(totals.fixed, remaining), file=sys.stderr)


def _finish_diff(args: argparse.Namespace, report: CheckReport, totals: FixTotals) -> int:
    sys.stdout.write("".join(totals.diffs))
    if not args.quiet:
        remaining = len(report.diagnostics)
        print(fix_summary(totals.fixed, remaining, applied=False), file=sys.stderr)
    if report.path_errors or totals.failures:
        return EXIT_ERROR
    return EXIT_FINDINGS if totals.diffs and not args.exit_zero else EXIT_OK


def _fix_failure(path: str, exc: GateError, outcome: str) -> str:
    if exc.pass_name == "parse":  # the input, not a fix, is the problem
        return f"{path}: {exc.reason}; {outcome}"
    return f"{path}: the `{exc.pass_name}` fix failed a safety gate ({exc.reason}); {outcome}"


def _echo(data: bytes) -> None:
    """Give the editor its buffer back: with `--fix`, stdout replaces the buffer."""
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


class _Buffer:
    """An editor's buffer: a script, or a notebook linted as the script of its code cells."""

    def __init__(self, raw: bytes, filename: str) -> None:
        self.notebook = read_notebook(raw, filename) if is_notebook(filename) else None
        self.source = None if self.notebook else decode_source(raw, filename)
        self.text = self.notebook.text if self.notebook else self.source.text

    def encode(self, text: str) -> bytes:
        if self.notebook is not None:
            return with_script(self.notebook, text)
        return self.source.encode(text)

    def place(self, diagnostic: Diagnostic) -> Diagnostic:
        return to_cells(self.notebook, diagnostic) if self.notebook else diagnostic


def _run_stdin(
    args: argparse.Namespace, config: Config, rules: list[type[Rule]], unsafe: bool
) -> int:
    filename = args.stdin_filename or "-"
    raw = sys.stdin.buffer.read()
    try:
        buffer = _Buffer(raw, filename)
    except SourceError as exc:
        if args.fix:
            _echo(raw)
        return _error(f"{filename}: cannot read stdin: {exc}")
    crashes: list[str] = []
    lint = _linter(config, rules, filename, crashes)
    original = text = buffer.text
    diagnostics: list[Diagnostic] = []
    if args.fix or args.diff:
        try:
            outcome = fix_until_stable(text, lint, unsafe=unsafe, filename=filename)
            fixed = buffer.encode(outcome.text)
        except GateError as exc:
            if args.fix:
                _echo(raw)
            return _error(_fix_failure(filename, exc, "nothing was changed"))
        except SourceError as exc:
            if args.fix:
                _echo(raw)
            return _error(f"{filename}: {exc}; nothing was changed")
        except Exception as exc:  # noqa: BLE001 - an editor must get its buffer back
            if args.fix:
                _echo(raw)
            print(f"ddpify: internal error: {filename}: {exc!r}", file=sys.stderr)
            return EXIT_ERROR
        text, diagnostics = outcome.text, outcome.remaining
    else:
        diagnostics = lint(text)
    diagnostics = [buffer.place(d) for d in diagnostics]

    if args.diff:
        if text != original and buffer.notebook is not None:
            sys.stdout.write(cell_diff(buffer.notebook, text))
        elif text != original:
            sys.stdout.write(_unified_diff(original, text, filename))
        return EXIT_FINDINGS if text != original and not args.exit_zero else EXIT_OK
    if args.fix:
        # The whole buffer goes back on stdout (an editor replaces its text with it); the
        # findings that remain go to stderr, or to --output-file.
        _echo(fixed if text != original else raw)
    fmt = args.output_format or "concise"
    try:
        if args.output_file:
            with _output(args.output_file) as stream:
                _render(args, fmt, diagnostics, stream)
        else:
            _render(args, fmt, diagnostics, sys.stderr if args.fix else sys.stdout)
    except BrokenPipeError:
        raise
    except OSError as exc:
        return _error(f"cannot write {args.output_file}: {exc.strerror or exc}")
    for crash in dict.fromkeys(crashes):
        print(f"ddpify: internal error: {crash}", file=sys.stderr)
    if crashes:
        return EXIT_ERROR
    failed = any(d.fails for d in diagnostics)
    return EXIT_FINDINGS if failed and not args.exit_zero else EXIT_OK
