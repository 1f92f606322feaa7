"""Hostile shapes of input cost one file, named, never the run (ddpify/guarded.py)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpify import api, guarded
from ddpify.gates import GateError
from ddpify.migrate.pipeline import migrate_source
from ddpify.rules import ALL_RULES
from tests.helpers import codes, lint

HEADER = "import torch\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\n"
UNGUARDED_SAVE = "torch.save(model.state_dict(), 'model.pt')\n"
fork_only = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)


def nested_parentheses(depth: int) -> str:
    return HEADER + "x = " + "(" * depth + "1" + ")" * depth + "\n" + UNGUARDED_SAVE


def long_sum(terms: int) -> str:
    return HEADER + "x = " + " + ".join(["a"] * terms) + "\n" + UNGUARDED_SAVE


def run_ddpify(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpify", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_risky_flags_deep_brackets_and_long_chains_only():
    assert guarded.risky(nested_parentheses(200))
    assert guarded.risky(long_sum(1000))
    assert not guarded.risky(long_sum(50))
    assert not guarded.risky(
        (Path(__file__).parent.parent / "fixtures/clean/trainer_class.py").read_text()
    )


def test_parentheses_deeper_than_python_allows_are_a_syntax_error_not_a_crash():
    [finding] = lint(nested_parentheses(1500))
    assert finding.code == "DDP000"
    assert "too many nested parentheses" in finding.message
    assert finding.location.row == 5


def test_a_500_term_expression_keeps_its_findings():
    # Positions and fix rendering recurse once per term: this raised RecursionError.
    assert codes(long_sum(500)) == ["DDP002", "DDP050"]


def test_cli_names_the_file_and_carries_on(tmp_path):
    (tmp_path / "deep.py").write_text(nested_parentheses(1500))
    (tmp_path / "train.py").write_text(HEADER + UNGUARDED_SAVE)
    done = run_ddpify("check", "--no-cache", "--output-format", "concise", ".", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "deep.py:5:" in done.stdout and "DDP000" in done.stdout
    assert "train.py:5:1: DDP050" in done.stdout


def test_fix_and_migrate_refuse_deep_input_without_touching_it(tmp_path):
    script = tmp_path / "deep.py"
    script.write_text(nested_parentheses(1500))
    before = script.read_bytes()
    fixed = run_ddpify("check", "--fix", "--no-cache", "deep.py", cwd=tmp_path)
    migrated = run_ddpify("migrate", "deep.py", cwd=tmp_path)
    assert fixed.returncode != -signal.SIGSEGV and migrated.returncode == 2
    assert "too many nested parentheses" in migrated.stderr
    assert "please report" not in migrated.stderr + fixed.stderr
    assert script.read_bytes() == before


def test_migrate_of_a_long_expression_is_not_an_internal_error():
    source = long_sum(600) + "loss.backward()\n"
    try:
        migrate_source(source, "train.py")
    except GateError as exc:  # refusing is fine; crashing on depth is not
        assert "Recursion" not in exc.reason


def _segfault(_: str) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _raise_gate(_: str) -> None:
    raise GateError("wrap", "planted")


@fork_only
def test_isolated_reports_a_crash_by_its_signal():
    with pytest.raises(guarded.GaveUp, match="SIGSEGV"):
        guarded.isolated(_segfault, "x")


@fork_only
def test_isolated_gives_up_after_its_time_limit():
    started = time.monotonic()
    with pytest.raises(guarded.GaveUp, match="gave up after 0.5 s"):
        guarded.isolated(_sleep, 30, timeout=0.5)
    assert time.monotonic() - started < 20


@fork_only
def test_isolated_passes_results_and_exceptions_back():
    assert guarded.isolated(len, "four") == 4
    with pytest.raises(GateError) as caught:
        guarded.isolated(_raise_gate, "x")
    assert (caught.value.pass_name, caught.value.reason) == ("wrap", "planted")


def test_deep_allows_recursion_far_past_the_default_limit():
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    limit = sys.getrecursionlimit()
    assert guarded.deep(depth, 20 * limit) == 20 * limit
    assert sys.getrecursionlimit() == limit


@fork_only
def test_a_worker_that_dies_costs_one_file(tmp_path, monkeypatch):
    # Workers are forked, so they inherit the planted crash for one file.
    real = api.check_bytes

    def crashing(data, filename, rules):
        if filename.endswith("poison.py"):
            faulthandler.disable()  # pytest's dump of the planted crash is noise
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(data, filename, rules)

    monkeypatch.setattr(api, "check_bytes", crashing)
    for index in range(api.PARALLEL_THRESHOLD + 4):
        (tmp_path / f"train_{index:02}.py").write_text(HEADER + UNGUARDED_SAVE)
    (tmp_path / "poison.py").write_text(HEADER)
    report = api.check_paths([str(tmp_path)], ALL_RULES, jobs=2)
    by_file = {Path(r.filename).name: [d.code for d in r.diagnostics] for r in report.results}
    assert by_file.pop("poison.py") == ["DDP000"]
    assert all("DDP050" in found for found in by_file.values()), by_file
    assert len(by_file) == api.PARALLEL_THRESHOLD + 4
    [poison] = [r for r in report.results if r.filename.endswith("poison.py")]
    assert "SIGSEGV" in poison.diagnostics[0].message


def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value


def _die_in_a_child(parent: int) -> int:
    if os.getpid() != parent:
        os._exit(3)  # the child dies without a word
    return 7


@fork_only
def test_beside_runs_its_work_in_another_process_and_returns_it():
    running = guarded.Beside(_pid_and, 5)
    pid, value = running.result()
    assert value == 5 and pid != os.getpid()


@fork_only
def test_beside_raises_the_childs_exception_here():
    running = guarded.Beside(_raise_gate, "x")
    with pytest.raises(GateError) as caught:
        running.result()
    assert (caught.value.pass_name, caught.value.reason) == ("wrap", "planted")


@fork_only
def test_beside_does_the_work_here_when_the_child_dies():
    assert guarded.Beside(_die_in_a_child, os.getpid()).result() == 7


@fork_only
def test_beside_closed_early_leaves_no_child_running():
    running = guarded.Beside(_sleep, 30)
    child = running._child
    started = time.monotonic()
    running.close()
    assert not child.is_alive() and time.monotonic() - started < 10


def test_beside_without_fork_runs_the_work_here(monkeypatch):
    monkeypatch.setattr(guarded, "can_fork", lambda: False)
    assert guarded.Beside(_pid_and, 2).result() == (os.getpid(), 2)
