"""How long `ddpify migrate` takes per script, with and without its safety gates.

    python benchmarks/bench_migrate.py [--repeat 3]

Runs the migration of every fixtures/migrate/*/before.py in-process; reports the median
per script. The gates (a second migration for idempotency, `ddpify check` on the output)
roughly double the cost of the passes themselves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ddpify.migrate import migrate_source

CASES = sorted(
    (Path(__file__).resolve().parent.parent / "fixtures" / "migrate").glob("*/before.py")
)


def measure(text: str, name: str, gates: bool, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        migrate_source(text, name, gates=gates)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total_plain = total_gated = 0.0
    print(f"{'case':<24} {'lines':>5} {'passes':>8} {'+gates':>8}")
    for path in CASES:
        text = path.read_text()
        plain = measure(text, path.parent.name, False, args.repeat)
        gated = measure(text, path.parent.name, True, args.repeat)
        total_plain, total_gated = total_plain + plain, total_gated + gated
        lines = text.count("\n")
        print(f"{path.parent.name:<24} {lines:>5} {plain * 1000:>6.0f}ms {gated * 1000:>6.0f}ms")
    print(f"{'total':<24} {'':>5} {total_plain:>7.2f}s {total_gated:>7.2f}s")


if __name__ == "__main__":
    main()
