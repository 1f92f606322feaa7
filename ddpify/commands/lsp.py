"""`ddpify lsp`: the language server over stdio, for editors (needs the `lsp` extra)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lsp",
        help="run the language server (stdio)",
        description=(
            "Serve diagnostics, quick fixes and rule pages to editors over the Language "
            "Server Protocol on stdin/stdout. Needs pygls: pip install 'ddpify[lsp]'."
        ),
    )
    # Editors pass --stdio out of habit (vscode-languageclient does); it is the only mode.
    parser.add_argument("--stdio", action="store_true", help="talk over stdio (the default)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ddpify.lsp import serve
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in ("pygls", "lsprotocol"):
            print(
                "ddpify: error: the language server needs pygls, which is not installed; "
                "install it with: pip install 'ddpify[lsp]'",
                file=sys.stderr,
            )
            return 2
        raise
    serve()
    return 0
