"""The `ddpify` command: parse arguments, hand over to a subcommand, map to an exit code.

Exit codes: 0 success (nothing at warning or error level), 1 findings or a script that
was not migrated, 2 usage or internal error.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from ddpify import __version__
from ddpify.commands import check, lsp, migrate, rule, verify

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2

COMMANDS = [check, rule, migrate, lsp, verify]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpify",
        description=(
            "Find DistributedDataParallel mistakes in PyTorch training scripts, "
            "and migrate single-GPU or DataParallel scripts to DDP."
        ),
        epilog="Run `ddpify COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"ddpify {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("ddpify: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `ddpify check | head`: the reader left; that is not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence: never a bare traceback
        print(f"ddpify: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("DDPIFY_DEBUG"):
            traceback.print_exc()
        else:
            print(
                "ddpify: set DDPIFY_DEBUG=1 for the traceback, and please report it",
                file=sys.stderr,
            )
        return EXIT_ERROR
