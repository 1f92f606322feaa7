"""benchmarks/gpu_fixtures.py, the script that runs the converted fixtures on a GPU machine.

Its full run takes minutes (and a GPU to mean much), so these tests cover the parts that
decide what the table says: which commands run, what counts as the error, that a hung
command and its children are killed, how the table is written.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from tests.helpers import FIXTURES

SCRIPT = FIXTURES.parent / "benchmarks" / "gpu_fixtures.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_fixtures"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_fixtures"]


TORCHRUN_FAILURE = """\
/usr/lib/python3.12/site-packages/torch/cuda/__init__.py:61: UserWarning: something
  warnings.warn(
[rank0]: Traceback (most recent call last):
[rank0]:   File "after.py", line 60, in <module>
[rank0]: RuntimeError: No backend type associated with device type cpu
E1123 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_the_first_error_is_the_scripts_not_the_launchers(gpu):
    assert gpu._first_error(TORCHRUN_FAILURE) == (
        "RuntimeError: No backend type associated with device type cpu"
    )
    assert gpu._first_error("all fine\nexit soon\n") == "exit soon"


def test_verify_runs_only_where_the_original_runs_as_one_process(gpu):
    cases = [gpu.Case("single_toplevel", "single-GPU"), gpu.Case("spawn_helper", "mp.spawn DDP")]
    tasks = gpu._tasks(cases, [1, 2])
    labels = [(case.name, label) for case, label, _ in tasks]
    assert ("single_toplevel", "verify 2") in labels
    assert ("spawn_helper", "verify 1") not in labels
    assert cases[1].outcomes["verify 1"].status == "n/a"
    for name in ("single_toplevel", "spawn_helper"):
        assert (name, "python") in labels and (name, "torchrun") in labels
    assert labels[0][1].startswith("verify")  # the slow ones start first


def test_the_cases_are_the_converted_fixtures(gpu):
    names = {case.name for case in gpu._cases(None)}
    assert {"spawn_tutorial", "launch_toplevel", "single_amp_legacy"} <= names
    assert not names & {"accelerate_script", "lightning_script", "torchrun_clean"}


def test_a_hung_command_is_killed_with_its_children(gpu, tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    status, output = gpu._execute([sys.executable, "-c", code], tmp_path, timeout=3)
    assert status is None and time.monotonic() - start < 30
    grandchild = int(output.split()[0])
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the command's child outlived the timeout")


def _alive(pid: int) -> bool:
    """Running, not merely a zombie: a killed orphan waits to be reaped by PID 1, which
    in some containers never reaps, so `kill(pid, 0)` alone would call it alive."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_the_table_has_a_row_per_case_with_its_first_error(gpu):
    case = gpu.Case("spawn_tutorial", "mp.spawn DDP")
    case.outcomes = {
        "python": gpu.Outcome("ok", 12.0),
        "torchrun": gpu.Outcome("FAIL", 20.0, "RuntimeError: a | b"),
        "verify 1": gpu.Outcome("n/a", detail="(original launches itself)"),
    }
    device = {"gpu": "no GPU", "torch": "2.13", "python": "3.12"}
    args = gpu._parse(["--verify-nproc", "1"])
    report = gpu._report([case], [1], device, args, 40.0)
    assert "- device: no GPU" in report
    row = report.splitlines()[-1]
    assert row == (
        "| spawn_tutorial | ok (12s) | FAIL (20s) | 1: n/a (original launches itself) | 32s "
        "| torchrun: RuntimeError: a \\| b |"
    )
