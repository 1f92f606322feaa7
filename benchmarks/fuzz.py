"""Long fuzzing runs of check, --fix and migrate: mutated scripts and generated modules.

    python benchmarks/fuzz.py                      # 2,000 mutants + 500 generated modules
    python benchmarks/fuzz.py --mutants 200 --generated 0 --seed 7 --jobs 2

Each case runs in a forked child with a time limit, the way the CLI runs (risky files
isolated again inside it). Mutants come from tests/mutations.py (fixture scripts with
lines deleted, duplicated, swapped, wrapped, re-indented, decorated, async, walrus,
match, f-strings, unicode names, long lines, deep nesting, CRLF, BOM); generated
modules from hypothesmith (derandomized), with torch imports in front so nothing is
skipped. Counted: internal errors, interpreter deaths, hangs, gate failures that ask
for a bug report, lost comments, outputs that do not compile, and generated modules
without torch that migrate changed. Exits 1 when any is found.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddpify import guarded  # noqa: E402
from tests.mutations import examine, mutants  # noqa: E402

PRELUDE = "import torch\nimport torch.distributed as dist\n"


def generated_modules(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` modules from hypothesmith's grammar strategy, reproducibly."""
    if count == 0:
        return []
    import hypothesmith
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    found: list[str] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(hypothesmith.from_grammar() | hypothesmith.from_node())
    def collect(source: str) -> None:
        found.append(source)

    collect()
    cases = []
    for index, source in enumerate(found[:count]):
        cases.append((f"generated #{index} (torch)", PRELUDE + source))
        cases.append((f"generated #{index} (no torch)", source))
    return cases


def untouched_without_torch(text: str) -> list[str]:
    """migrate must leave a module that never mentions torch byte for byte alone."""
    from ddpify.gates import GateError
    from ddpify.migrate import migrate_source

    try:
        result = migrate_source(text, "fuzz.py")
    except GateError:
        return []
    return [] if result.output == text else ["migrate changed a module without torch"]


def run_case(label: str, text: str, timeout: float) -> tuple[str, list[str], float]:
    started = time.monotonic()
    work = untouched_without_torch if label.endswith("(no torch)") else examine
    try:
        problems = guarded.isolated(work, text, timeout=timeout)
    except guarded.GaveUp as exc:
        kind = "hang" if "gave up after" in str(exc) else "death"
        problems = [f"{kind}: {exc}"]
    return label, problems, time.monotonic() - started


def classify(problem: str) -> str:
    for key, name in (
        ("hang:", "hangs"),
        ("death:", "interpreter deaths"),
        ("please report", "please-report gate failures"),
        ("lost comments", "lost comments"),
        ("does not compile", "outputs that do not compile"),
        ("without torch", "modules without torch changed"),
    ):
        if key in problem:
            return name
    return "internal errors"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000)
    parser.add_argument("--generated", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    args = parser.parse_args()

    cases = [(label, text) for label, _, text in mutants(args.seed, args.mutants)]
    cases += generated_modules(args.generated, args.seed)
    print(f"{len(cases)} cases, {args.jobs} at a time", flush=True)
    counts: Counter[str] = Counter()
    slowest = (0.0, "")
    started = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda case: run_case(*case, args.timeout), cases)
        for done, (label, problems, seconds) in enumerate(runs, 1):
            slowest = max(slowest, (seconds, label))
            for problem in problems:
                counts[classify(problem)] += 1
                print(f"{label}: {problem[:400]}", flush=True)
            if done % 100 == 0:
                print(f"... {done}/{len(cases)} in {time.monotonic() - started:.0f} s", flush=True)
    print(f"\n{len(cases)} cases in {time.monotonic() - started:.0f} s; slowest {slowest[0]:.1f} s")
    for name in (
        "internal errors",
        "interpreter deaths",
        "hangs",
        "please-report gate failures",
        "lost comments",
        "outputs that do not compile",
        "modules without torch changed",
    ):
        print(f"  {name}: {counts[name]}")
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
