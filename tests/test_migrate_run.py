"""The converted fixture scripts run: as one plain process and under torchrun (2 CPU ranks,
with autocast on in bf16 as on a GPU: fixtures/migrate/run_cases.py --amp-bf16).

Marked `torchrun`; `pytest -m "not torchrun"` skips them. Starting Python, importing torch
and launching workers cost far more than these tiny scripts, so every case runs inside one
process (fixtures/migrate/run_cases.py runs each after.py as `__main__`) and inside one
torchrun launch; one case also runs through the literal commands a user types.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES

pytest.importorskip("torch")

CASES_DIR = FIXTURES / "migrate"
RUNNER = CASES_DIR / "run_cases.py"
UNTOUCHED = {"accelerate_script", "lightning_script"}  # need packages CI does not install
CASES = sorted(
    p.name for p in CASES_DIR.iterdir() if (p / "after.py").is_file() and p.name not in UNTOUCHED
)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TIMEOUT = 300


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    shown = " ".join(Path(part).name if "/" in part else part for part in command[1:8])
    print(f"\n{time.perf_counter() - start:6.1f}s  {shown} ...", end="")
    return done


PROJECTS_DIR = FIXTURES / "projects"
PROJECTS = sorted(p.name for p in PROJECTS_DIR.iterdir() if (p / "after" / "train.py").is_file())


def _cases() -> list[str]:
    """The migrate cases, then the multi-file projects (their after/train.py)."""
    return [str(CASES_DIR / case) for case in CASES] + [
        str(PROJECTS_DIR / project) for project in PROJECTS
    ]


def _after_text(case: str) -> str:
    if case in PROJECTS:
        return "".join(p.read_text() for p in (PROJECTS_DIR / case / "after").rglob("*.py"))
    return (CASES_DIR / case / "after.py").read_text()


@pytest.mark.torchrun
def test_every_case_runs_as_one_process(tmp_path):
    done = _run([sys.executable, str(RUNNER), str(tmp_path), *_cases()], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    for case in CASES + PROJECTS:
        assert f"ddpify-case {case} rank - ok" in done.stdout


@pytest.mark.torchrun
def test_every_case_runs_under_torchrun_with_two_ranks_in_bf16(tmp_path):
    """As on GPUs, where users run torchrun with AMP: autocast on, in bf16 (on the CPU)."""
    done = _run([*TORCHRUN, str(RUNNER), "--amp-bf16", str(tmp_path), *_cases()], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    for case in CASES + PROJECTS:
        uses_amp = "torch.autocast(" in _after_text(case)
        for rank in (0, 1):
            assert f"ddpify-case {case} rank {rank} ok" in done.stdout
            ops = re.search(rf"ddpify-amp {case} rank {rank} bf16 ops (\d+)", done.stdout)
            assert ops is not None and (int(ops.group(1)) > 0) == uses_amp, case


def _bf16_simulation():
    spec = importlib.util.spec_from_file_location("run_cases", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bf16_simulation()


def test_the_bf16_simulation_fails_a_loss_outside_autocast_as_cuda_does():
    import torch

    model, x, y = torch.nn.Linear(4, 2), torch.randn(8, 4), torch.randn(8, 2)
    real = torch.autocast
    with _bf16_simulation() as amp:
        with torch.autocast("cuda", dtype=torch.float16, enabled=False):  # USE_AMP on CPU
            out = model(x)
            inside = torch.nn.functional.mse_loss(out, y)
            with torch.autocast("cuda", enabled=False):  # a float32 island stays one
                island = model(x)
        assert out.dtype == torch.bfloat16 and island.dtype == torch.float32
        inside.backward()
        with pytest.raises(RuntimeError, match="mixed dtypes"):
            torch.nn.functional.mse_loss(out.detach(), y)  # the loss outside autocast
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            with torch.autocast("cuda"):
                torch.nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(3))
    assert amp.low_precision_ops > 0
    assert torch.autocast is real
    assert torch.nn.functional.mse_loss(out.detach(), y).dtype == torch.float32  # CPU: lax


@pytest.mark.torchrun
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_the_literal_commands_run(launcher, tmp_path):
    script = str(CASES_DIR / "single_main_argparse" / "after.py")
    command = [sys.executable, script] if launcher == "python" else [*TORCHRUN, script]
    done = _run([*command, "--epochs", "1"], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "val accuracy" in done.stdout
    assert (tmp_path / "mlp.pt").is_file()


@pytest.mark.torchrun
def test_verify_writes_only_after_the_gradients_match(tmp_path):
    from ddpify.cli import main

    script = tmp_path / "train.py"
    original = (CASES_DIR / "single_main_argparse" / "before.py").read_text()
    script.write_text(original)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["migrate", str(script), "--verify", "--", "--epochs", "1"])
    finally:
        os.chdir(cwd)
    assert code == 0
    assert script.read_text() == (CASES_DIR / "single_main_argparse" / "after.py").read_text()
