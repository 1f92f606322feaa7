from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markdown import Markdown

from ddpify.docs import rule_page
from ddpify.rules import ALL_RULES, RULES_BY_CODE


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rule",
        help="explain a rule",
        description="Show a rule's page: what it finds, why it matters, how to fix it.",
        epilog="examples:\n  ddpify rule DDP022\n  ddpify rule --all\n"
        "  ddpify rule --all --output-format json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("code", nargs="?", help="a rule code such as DDP022")
    parser.add_argument("--all", action="store_true", help="list every rule")
    parser.add_argument("--output-format", choices=["text", "json"], default="text")
    parser.set_defaults(run=run)


def _as_dict(rule: type) -> dict:
    return {
        "code": rule.CODE,
        "name": rule.NAME,
        "severity": rule.SEVERITY.value,
        "message": rule.MESSAGE,
        "fix": rule.FIX.value,
        "default_enabled": rule.DEFAULT_ENABLED,
        "explanation": rule_page(rule.CODE),
    }


def run(args: argparse.Namespace) -> int:
    if args.all:
        if args.output_format == "json":
            json.dump([_as_dict(r) for r in ALL_RULES], sys.stdout, indent=2)
            print()
        else:
            for r in ALL_RULES:
                default = "" if r.DEFAULT_ENABLED else "  (opt-in)"
                print(f"{r.CODE}  {r.NAME:<32} {r.SEVERITY.value:<8}{default}")
        return 0
    if not args.code:
        print("ddpify: error: give a rule code (e.g. DDP022) or --all", file=sys.stderr)
        return 2
    rule = RULES_BY_CODE.get(args.code.upper())
    if rule is None:
        print(
            f"ddpify: error: unknown rule {args.code!r}; `ddpify rule --all` lists them",
            file=sys.stderr,
        )
        return 2
    if args.output_format == "json":
        json.dump(_as_dict(rule), sys.stdout, indent=2)
        print()
        return 0
    page = rule_page(rule.CODE) or f"# {rule.CODE} {rule.NAME}\n\n{rule.MESSAGE}\n"
    Console(highlight=False).print(Markdown(page))
    return 0
