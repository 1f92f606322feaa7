"""What each rule adds to a cold check's rules-and-walk time, measured in one process.

    python benchmarks/bench_rule_cost.py DDP005,DDP023 [PATHS...] [--repeat N]

Each file is parsed once; then the default rules without the named codes, and with each
code added, run over it in turn (best of --repeat), so machine load hits every variant
alike. Prints the added cost per code; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpify.engine import run_rules  # noqa: E402
from ddpify.rules import RULES_BY_CODE, select_rules  # noqa: E402


def modules(paths: list[str]) -> list[cst.Module]:
    found = []
    for raw in paths:
        path = Path(raw)
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            text = file.read_text(errors="replace")
            if "torch" in text:
                try:
                    found.append(cst.parse_module(text))
                except cst.ParserSyntaxError:
                    pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("codes")
    parser.add_argument("paths", nargs="*", default=[str(ROOT / "fixtures")])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    codes = args.codes.split(",")
    base = [rule for rule in select_rules() if rule.CODE not in codes]
    variants = {"base": base, **{code: [*base, RULES_BY_CODE[code]] for code in codes}}
    totals = dict.fromkeys(variants, 0.0)
    parsed = modules(args.paths)
    for module in parsed:
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(args.repeat):
            for name, rules in variants.items():
                start = time.perf_counter()
                run_rules(module, rules)
                best[name] = min(best[name], time.perf_counter() - start)
        for name in totals:
            totals[name] += best[name]
    print(f"{len(parsed)} files; default rules without {args.codes}: {totals['base']:.2f} s")
    for code in codes:
        print(f"{code}: {100 * (totals[code] / totals['base'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
