"""Correct DDP scripts in the styles real projects use must produce no warning or error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpify.diagnostics import Severity
from tests.helpers import FIXTURES, fixture_line, lint

CLEAN = sorted((FIXTURES / "clean").glob("*.py"))
# The ones that run on a CPU machine: the rest call torch.cuda.set_device unconditionally.
RUNNABLE_ON_CPU = ["torchrun_toplevel.py", "helper_functions.py"]


def test_there_are_enough_styles():
    assert len(CLEAN) >= 8


@pytest.mark.parametrize("script", CLEAN, ids=lambda p: p.stem)
def test_correct_script_is_quiet(script):
    findings = lint(script.read_text(), filename=str(script))
    loud = [fixture_line(d) for d in findings if d.severity is not Severity.INFO]
    assert loud == []


@pytest.mark.torchrun
@pytest.mark.parametrize("name", RUNNABLE_ON_CPU)
def test_cpu_scripts_really_run_under_torchrun(name, tmp_path):
    """The quiet scripts are not just quiet: they train on 2 CPU processes with gloo."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(FIXTURES / "clean" / name),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
