"""How long `ddpify check` takes per 1,000 lines, against libcst's parse-only time.

    python benchmarks/bench_check.py [PATHS...] [--repeat N]
    python benchmarks/bench_check.py --corpus [DIR ...] [--repeat N] [--profile N]

Default paths: every training script under fixtures/ (written for this project).
Times are wall-clock, best of --repeat runs, one process (the CLI adds worker
processes on large trees; see --jobs). Prints a table; asserts nothing.

`--corpus` measures real code instead: every .py file under each DIR (default
/work/corpus, the built development corpus, when it exists) that mentions torch (the
others ddpify skips unparsed, which would flatter it). Each file is parsed by
`libcst.parse_module` and checked cold (no result cache, all default rules, in process
through the engine: decode, parse, analysis, rules, positions, noqa) one right after the
other, the order alternating, so both see the same load on a shared machine; the
ratio is taken per round and the median of --repeat rounds reported. `--profile N`
adds a cProfile of one checking round, the top N entries by cumulative and own time.

Real repositories to add (bare mirrors under /work/.mirror; extract outside the
project, never into it):

    for r in facebookresearch+mae facebookresearch+deit karpathy+nanoGPT; do
      mkdir -p /tmp/realrepos/$r
      git --git-dir=/work/.mirror/$r/repo archive HEAD -- '*.py' | tar -x -C /tmp/realrepos/$r
    done
    python benchmarks/bench_check.py --corpus /work/corpus /tmp/realrepos
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpify.api import check_paths  # noqa: E402
from ddpify.engine import check_bytes, check_source, mentions_torch  # noqa: E402
from ddpify.files import SourceError, decode_source, iter_python_files, read_source  # noqa: E402
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


DEFAULT_CORPUS = Path("/work/corpus")


@dataclass
class RealFile:
    name: str
    data: bytes
    text: str
    lines: int
    parse: list[float] = field(default_factory=list)  # seconds, one per round
    check: list[float] = field(default_factory=list)


def real_files(folders: list[str]) -> tuple[list[RealFile], list[str]]:
    """Every .py file under `folders` that ddpify would analyse; and what was left out."""
    files, left_out = [], []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            if not path.is_file():
                continue
            data = path.read_bytes()
            try:
                text = decode_source(data, str(path)).text
            except SourceError:
                left_out.append(f"{path}: cannot read")
                continue
            if not mentions_torch(text):
                continue
            try:
                cst.parse_module(text)
            except Exception as exc:  # noqa: BLE001 - Python 2 code and the like
                left_out.append(f"{path}: libcst cannot parse it ({type(exc).__name__})")
                continue
            files.append(RealFile(str(path), data, text, text.count("\n") + 1))
    return files, left_out


def timed(work, *args) -> float:
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def measure_round(files: list[RealFile], rules, round_index: int) -> None:
    for index, file in enumerate(files):
        check_first = (index + round_index) % 2 == 1
        if check_first:
            file.check.append(timed(check_bytes, file.data, file.name, rules))
        file.parse.append(timed(cst.parse_module, file.text))
        if not check_first:
            file.check.append(timed(check_bytes, file.data, file.name, rules))


def corpus_mode(folders: list[str], repeat: int, profile: int) -> None:
    files, left_out = real_files(folders)
    if not files:
        raise SystemExit(f"no .py file mentioning torch under {', '.join(folders)}")
    rules = select_rules()
    for file in files:  # warm-up: imports, caches of node types
        check_bytes(file.data, file.name, rules)
    for round_index in range(repeat):
        measure_round(files, rules, round_index)

    lines = sum(file.lines for file in files)
    parse_rounds = [sum(f.parse[r] for f in files) for r in range(repeat)]
    check_rounds = [sum(f.check[r] for f in files) for r in range(repeat)]
    ratios = [c / p for c, p in zip(check_rounds, parse_rounds)]
    per_k = 1000 / lines
    with_findings = sum(1 for f in files if check_bytes(f.data, f.name, rules).diagnostics)
    print(f"corpus: {', '.join(folders)}")
    print(
        f"{len(files)} files mentioning torch, {lines} lines, {len(rules)} rules, "
        f"{with_findings} files with findings, {repeat} rounds"
    )
    for line in left_out:
        print(f"  left out: {line}")
    print(f"{'what (median of rounds)':<40}{'total s':>10}{'ms / 1k lines':>16}")
    for label, rounds in [
        ("libcst parse_module only", parse_rounds),
        ("ddpify check, cold, in process", check_rounds),
    ]:
        seconds = statistics.median(rounds)
        print(f"{label:<40}{seconds:>10.3f}{seconds * per_k * 1000:>16.1f}")
    print(
        f"ddpify / parse-only: median {statistics.median(ratios):.2f}x "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    per_file = sorted(
        ((statistics.median(f.check) / statistics.median(f.parse), f) for f in files),
        key=lambda pair: pair[0],
    )
    print(
        f"per file: median {statistics.median(r for r, _ in per_file):.2f}x, "
        f"p90 {per_file[int(0.9 * (len(per_file) - 1))][0]:.2f}x; the slowest relative to parsing:"
    )
    for ratio, file in per_file[-5:][::-1]:
        print(f"  {ratio:5.2f}x  {file.lines:6} lines  {file.name}")
    if profile:
        print_profile(files, rules, profile)


def print_profile(files: list[RealFile], rules, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for file in files:
        check_bytes(file.data, file.name, rules)
    profiler.disable()
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
        print(f"\n--- profile of one round, by {order} (cProfile inflates Python-heavy code) ---")
        print(out.getvalue().split("\n\n", 1)[-1].rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[str(ROOT / "fixtures")])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2, help="workers for the end-to-end run")
    parser.add_argument(
        "--corpus",
        nargs="*",
        metavar="DIR",
        help=f"real files: every .py under DIR (default {DEFAULT_CORPUS})",
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="with --corpus")
    args = parser.parse_args()
    if args.corpus is not None:
        folders = args.corpus or ([str(DEFAULT_CORPUS)] if DEFAULT_CORPUS.is_dir() else [])
        if not folders:
            raise SystemExit(f"--corpus: no DIR given and {DEFAULT_CORPUS} does not exist")
        corpus_mode(folders, args.repeat, args.profile)
        return

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
