"""Wall time of one `ddpify verify` on a small fixture (2 processes, CPU, gloo).

    python benchmarks/bench_verify.py [--repeat 3] [--case mlp|gan|transformer|cnn_bn|amp_clip]

Prints the verify time next to what the same scripts cost without ddpify (one plain run of the
original, one plain torchrun of the converted script), so the probe's own cost is visible.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERIFY = ROOT / "fixtures" / "verify"


def timed(command: list[str], cwd: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--case", default="mlp", help="a folder of fixtures/verify (mlp)")
    args = parser.parse_args()
    case = VERIFY / args.case
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    verify = [
        sys.executable,
        "-m",
        "ddpify",
        "verify",
        str(case / "original.py"),
        str(case / "converted.py"),
    ]
    plain = [sys.executable, str(case / "original.py"), "--epochs", "1"]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(case / "converted.py"),
        "--epochs",
        "1",
    ]
    rows = {
        "ddpify verify (3 steps, 2 procs)": verify,
        "python original.py (1 epoch)": plain,
        "torchrun converted.py (1 epoch)": torchrun,
    }
    print(
        f"case={args.case} cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f} repeat={args.repeat}"
    )
    with tempfile.TemporaryDirectory() as cwd:
        for label, command in rows.items():
            times = [timed(command, cwd, env) for _ in range(args.repeat)]
            print(f"{label:<36} median {statistics.median(times):6.2f} s  min {min(times):6.2f} s")


if __name__ == "__main__":
    main()
