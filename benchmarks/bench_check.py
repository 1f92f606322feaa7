"""How long `ddpify check` takes per 1,000 lines, against libcst's parse-only time.

    python benchmarks/bench_check.py [PATHS...] [--repeat N]

Default corpus: every training script under fixtures/ (written for this project).
Times are wall-clock, best of --repeat runs, one process (the CLI adds worker
processes on large trees; see --jobs). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpify.api import check_paths  # noqa: E402
from ddpify.engine import check_source  # noqa: E402
from ddpify.files import iter_python_files, read_source  # noqa: E402
from ddpify.rules import select_rules  # noqa: E402


def corpus(paths: list[str]) -> list[tuple[str, str]]:
    files = []
    for raw in paths:
        path = Path(raw)
        found = iter_python_files(path, respect_gitignore=False) if path.is_dir() else [path]
        for file in found:
            if file.suffix == ".ipynb":
                continue  # scripts only: the parse-only baseline cannot read a notebook
            source = read_source(file)
            if "torch" in source.text:
                files.append((str(file), source.text))
    return files


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[str(ROOT / "fixtures")])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2, help="workers for the end-to-end run")
    args = parser.parse_args()

    files = corpus(args.paths)
    lines = sum(text.count("\n") + 1 for _, text in files)
    rules = select_rules()

    def parse_only():
        for _, text in files:
            cst.parse_module(text)

    def check_all():
        for name, text in files:
            check_source(text, name, rules)

    parse = best_of(args.repeat, parse_only)
    check = best_of(args.repeat, check_all)
    cli = best_of(args.repeat, lambda: check_paths(args.paths, rules, jobs=args.jobs))
    with tempfile.TemporaryDirectory() as cache:
        check_paths(args.paths, rules, cache_dir=Path(cache))
        warm = best_of(args.repeat, lambda: check_paths(args.paths, rules, cache_dir=Path(cache)))
    per_k = 1000 / lines
    print(f"corpus: {len(files)} files, {lines} lines, {len(rules)} rules")
    print(f"{'what':<40}{'total s':>10}{'ms / 1k lines':>16}{'x parse':>10}")
    for label, seconds in [
        ("libcst parse_module only", parse),
        ("ddpify check (in process)", check),
        (f"ddpify check_paths (jobs={args.jobs}, with I/O)", cli),
        ("ddpify check_paths, warm cache", warm),
    ]:
        print(f"{label:<40}{seconds:>10.3f}{seconds * per_k * 1000:>16.1f}{seconds / parse:>10.2f}")


if __name__ == "__main__":
    main()
