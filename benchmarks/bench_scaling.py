"""How check and migrate grow with file size: 1k to 100k lines of one training script.

    python benchmarks/bench_scaling.py                    # 1k, 10k, 100k lines
    python benchmarks/bench_scaling.py --lines 1000 20000 --profile

The script is a real-shaped single-GPU training script (fixtures/migrate/
single_main_argparse/before.py) followed by N lines of helper functions and a model
class with loops, guards, prints and saves in them, repeated with fresh names, so every
rule and pass has work in proportion to the size. Linear cost shows as a flat
"ms per 1k lines" column. A time in "s" is CPU seconds of this process (all its threads)
and of the children it forked and waited for (migrate runs a gate in a second process
while it runs the next one); "wall s" is what a user waits. "parse s" is libcst's
parse alone of the same text, and the x-parse
columns divide by it: on a shared machine even CPU seconds drift with the load, the
ratios much less (measure before and after a change in the same minute, each size in
a fresh process: `--lines 30000`).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import libcst
from libcst._nodes.base import CSTNode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpify import guarded, libcst_speed  # noqa: E402
from ddpify.engine import check_source  # noqa: E402
from ddpify.gc_tuning import fewer_collections  # noqa: E402
from ddpify.migrate import migrate_source  # noqa: E402
from ddpify.rules import ALL_RULES  # noqa: E402

BASE = ROOT / "fixtures" / "migrate" / "single_main_argparse" / "before.py"

HELPER = '''

class Block{i}(nn.Module):
    """A residual block, number {i}."""

    def __init__(self, width=32):
        super().__init__()
        self.fc = nn.Linear(width, width)  # the only layer
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def evaluate_{i}(model, batches, device="cuda"):
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            total += nn.functional.mse_loss(model(x), y).item()
    if total > 1e9:
        print("diverged at helper {i}", total)
    return total / max(len(batches), 1)


def checkpoint_{i}(model, path="block_{i}.pt"):
    state = {{"model": model.state_dict(), "step": {i}}}
    torch.save(state, path)
    return torch.load(path)
'''


def script(lines: int) -> str:
    text = BASE.read_text()
    index = 0
    while text.count("\n") < lines:
        text += HELPER.format(i=index)
        index += 1
    return text


def parse_only(text: str) -> None:
    """libcst's own parse (deep thread, fewer collections, as check and migrate run it),
    with the node checks ddpify's parse skips (ddpify/libcst_speed.py) left on: the ratios
    are to libcst as shipped."""

    def parse() -> None:
        with fewer_collections():
            libcst.parse_module(text)

    installed = CSTNode.__post_init__
    CSTNode.__post_init__ = libcst_speed._check_node
    try:
        guarded.deep(parse)
    finally:
        CSTNode.__post_init__ = installed


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (forked gates)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


def timed(fn, *args) -> tuple[float, float]:
    """CPU and wall seconds of `fn(*args)`."""
    started, wall = cpu_seconds(), time.perf_counter()
    fn(*args)
    return cpu_seconds() - started, time.perf_counter() - wall


def stages(text: str) -> None:
    """Migrate once with the pipeline's stages timed. A stage inside another counts for
    the outer one only: a tree built by a pass counts for the passes, the passes and
    trees of the idempotency run for that run."""
    from ddpify import splice
    from ddpify.analysis import tree
    from ddpify.migrate import pipeline

    spent: dict[str, list[float]] = {}
    busy = []

    def timing(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed_stage(*args, **kwargs):
            if busy and label != "idempotency run":
                return real(*args, **kwargs)
            busy.append(label)
            started, wall = cpu_seconds(), time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                busy.pop()
                seconds = spent.setdefault(label, [0.0, 0.0])
                seconds[0] += cpu_seconds() - started
                seconds[1] += time.perf_counter() - wall

        setattr(owner, name, timed_stage)

    timing(pipeline, "parse_input", "input: parse (in two parts), compile")
    timing(pipeline, "_run_pass", "passes (analysis, edits, render, compile)")
    timing(pipeline, "check_compiles", "output: spliced parse, render, compile")
    timing(pipeline, "_all_called", "waiting for the input's compile and render beside")
    timing(pipeline, "_gate_comments", "comment gate")
    timing(pipeline, "_gate_check", "check gate")
    timing(pipeline, "analyze_project", "project analysis")
    timing(tree.Tree, "__init__", "tree builds")
    timing(pipeline, "_gate_idempotent", "idempotency run")
    timing(splice, "same_tree", "output parse vs final module")
    # The idempotency and check gates of a large output run in forked children (their
    # CPU counts in the total, not in their stages): what this process waits for them.
    timing(pipeline._FinalGatesAhead, "results", "waiting for the gates run ahead")
    total, wall = timed(guarded.deep, migrate_source, text, "big.py")
    print(f"\nmigrate, {text.count(chr(10))} lines: {total:.2f} CPU s, {wall:.2f} wall s")
    print(f"  {'stage':<44} {'CPU s':>6} {'wall s':>6}")
    for label, (cpu, wall) in sorted(spent.items(), key=lambda item: -item[1][0]):
        print(f"  {label:<44} {cpu:6.2f} {wall:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--profile", action="store_true", help="profile the largest size")
    parser.add_argument(
        "--stages",
        action="store_true",
        help="CPU seconds of migrate's stages at the largest size (no profiler overhead)",
    )
    args = parser.parse_args()

    print(
        f"{'lines':>8} {'parse s':>8} {'check s':>9} {'ms/1k':>7} {'x parse':>7} "
        f"{'migrate s':>10} {'ms/1k':>7} {'x parse':>7} {'wall s':>7} {'x parse':>7}"
    )
    for size in args.lines:
        text = script(size)
        n = text.count("\n")
        parse, _ = timed(parse_only, text)
        check, _ = timed(check_source, text, "big.py", ALL_RULES)
        migrate, wall = timed(migrate_source, text, "big.py")
        print(
            f"{n:>8} {parse:>8.2f} {check:>9.2f} {1000 * check / n * 1000:>7.0f} "
            f"{check / parse:>7.2f} {migrate:>10.2f} {1000 * migrate / n * 1000:>7.0f} "
            f"{migrate / parse:>7.2f} {wall:>7.2f} {wall / parse:>7.2f}",
            flush=True,
        )
    if args.stages:
        stages(script(max(args.lines)))
    if args.profile:
        text = script(max(args.lines))
        profile = cProfile.Profile()
        # In the deep thread, so that migrate runs (and is profiled) in that same thread.
        guarded.deep(profile.runcall, migrate_source, text, "big.py")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
