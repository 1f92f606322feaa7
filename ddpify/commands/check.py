from __future__ import annotations

import argparse
import sys

from ddpify.api import CheckReport, check_paths
from ddpify.diagnostics import Severity
from ddpify.output import HUMAN_FORMATS, RENDERERS
from ddpify.rules import UnknownRuleError, select_rules

EXAMPLES = """\
examples:
  ddpify check train.py                 lint one script
  ddpify check src/ --select DDP05      only the rank-0 side-effect rules
  ddpify check . --ignore DDP041        everything but the learning-rate advice
  ddpify check . --output-format json   machine-readable, for editors and CI

Suppress one finding with `# noqa: DDP022` on its line. Explain a code: `ddpify rule DDP022`.
"""


def codes(value: str) -> list[str]:
    return [part.strip().upper() for part in value.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="lint scripts for DDP problems",
        description="Report DistributedDataParallel problems in Python files.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", default=["."], help="files or directories (default: .)")
    parser.add_argument("--select", type=codes, help="comma-separated codes or prefixes to enable")
    parser.add_argument("--ignore", type=codes, default=[], help="codes or prefixes to disable")
    parser.add_argument(
        "--extend-select", type=codes, default=[], help="codes to enable on top of the defaults"
    )
    parser.add_argument(
        "--output-format",
        choices=sorted(RENDERERS),
        help="full (default on a terminal), concise (default otherwise), json",
    )
    parser.add_argument("--exclude", type=codes_or_globs, default=[], help="glob patterns to skip")
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary line")
    parser.set_defaults(run=run)


def codes_or_globs(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def summary(report: CheckReport) -> str:
    counts = ", ".join(
        f"{report.count(severity)} {severity.value}{'s' if report.count(severity) != 1 else ''}"
        for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO)
    )
    files = report.files_checked
    return f"Checked {files} file{'s' if files != 1 else ''}: {counts}."


def run(args: argparse.Namespace) -> int:
    try:
        rules = select_rules(args.select, args.ignore, args.extend_select)
    except UnknownRuleError as exc:
        print(f"ddpify: error: {exc}", file=sys.stderr)
        return 2
    report = check_paths(args.paths, rules, exclude=args.exclude)
    for error in report.path_errors:
        print(f"ddpify: error: {error}", file=sys.stderr)
    for directory in report.empty_dirs:
        print(f"ddpify: warning: no Python files found under {directory}", file=sys.stderr)
    fmt = args.output_format or ("full" if sys.stdout.isatty() else "concise")
    RENDERERS[fmt](report.diagnostics, sys.stdout)
    if fmt in HUMAN_FORMATS and not args.quiet:
        print(summary(report))
    if report.path_errors:
        return 2
    return 1 if report.failed else 0
