"""The converted fixture scripts run: as one plain process and under torchrun (2 CPU ranks).

Marked `torchrun`; `pytest -m "not torchrun"` skips them. Each case runs in its own
temporary directory so checkpoints do not collide.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES

CASES_DIR = FIXTURES / "migrate"
UNTOUCHED = {"accelerate_script", "lightning_script"}  # need packages CI does not install
CASES = sorted(
    p.name for p in CASES_DIR.iterdir() if (p / "after.py").is_file() and p.name not in UNTOUCHED
)
TIMEOUT = 120

pytest.importorskip("torch")


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    print(f"{time.perf_counter() - start:6.1f}s  {' '.join(command[1:])}")
    return done


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
def test_after_runs_as_one_process_and_under_torchrun(case, tmp_path):
    script = str(CASES_DIR / case / "after.py")
    single = _run([sys.executable, script], tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        script,
    ]
    both = _run(torchrun, tmp_path)
    assert both.returncode == 0, both.stderr[-3000:]
