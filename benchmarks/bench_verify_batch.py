"""The verify fixtures' pairs verified one `run_verify` each, then all in one `run_verify_many`.

    python benchmarks/bench_verify_batch.py [--only batch|single]

Prints, per way, the wall time and the CPU seconds of ddpify and every process it started
(user + system, children included: on a shared machine the CPU is the steadier number), and
checks that both ways reach the same verdicts. CPU, gloo, 2 processes; asserts nothing else.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpify.verify import run_verify  # noqa: E402
from ddpify.verify.batch import VerifyJob, run_verify_many  # noqa: E402
from ddpify.verify.markers import read_markers  # noqa: E402

VERIFY = ROOT / "fixtures" / "verify"


def jobs(cwd: str) -> list[VerifyJob]:
    """Every converted script of fixtures/verify (planted bugs included) against its original."""
    found = []
    for case in sorted(p for p in VERIFY.iterdir() if (p / "original.py").is_file()):
        for converted in sorted(case.glob("*.py")):
            if converted.name == "original.py":
                continue
            markers = read_markers(converted.read_text())
            options = {
                "batch_policy": markers.batch_policy or "auto",
                "lr_scale": markers.lr_scale(2),
                "cwd": cwd,
            }
            found.append(VerifyJob(case / "original.py", converted, options))
    return found


def cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measured(work):
    wall, cpu = time.perf_counter(), cpu_seconds()
    results = work()
    return results, time.perf_counter() - wall, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["batch", "single"])
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch  # noqa: F401 - both ways load the records with torch: not part of either

    with tempfile.TemporaryDirectory() as cwd:
        pairs = jobs(cwd)
        print(f"{len(pairs)} pairs, cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}")
        ways = {
            "single": lambda: [run_verify(j.original, j.converted, **j.options) for j in pairs],
            "batch": lambda: run_verify_many(pairs),
        }
        verdicts = {}
        for name, work in ways.items():
            if args.only and name != args.only:
                continue
            results, wall, cpu = measured(work)
            verdicts[name] = [r.verdict for r in results]
            print(f"{name:<7} wall {wall:7.1f} s   cpu {cpu:7.1f} s   {len(pairs)} pairs")
        if len(verdicts) == 2:
            same = verdicts["single"] == verdicts["batch"]
            print("same verdicts" if same else f"DIFFERENT verdicts: {verdicts}")


if __name__ == "__main__":
    main()
