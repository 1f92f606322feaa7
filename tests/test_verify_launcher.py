"""verify leaves no process behind: children in new sessions, SIGTERM-ignoring children,
after a normal exit, a timeout, or a SIGTERM to ddpify itself. Plain Python, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddpify.verify.launcher import launch, probe_environment

# The script starts a grandchild in a session of its own that ignores SIGTERM, writes its
# pid, and then (per argv[2]) exits at once or hangs.
SCRIPT = textwrap.dedent(
    """\
    import subprocess, sys, time
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"],
        start_new_session=True,
    )
    open(sys.argv[1], "w").write(str(child.pid))
    if sys.argv[2] == "hang":
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run(tmp_path: Path, mode: str, timeout: float):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / "child.pid"
    outcome = launch(
        [sys.executable, str(script), str(pid_file), mode],
        dict(os.environ),
        tmp_path,
        tmp_path / "run.log",
        tmp_path / "pids",
        timeout,
    )
    return outcome, int(pid_file.read_text())


def test_a_child_in_its_own_session_is_killed_after_a_normal_exit(tmp_path):
    outcome, child = _run(tmp_path, "exit", timeout=60)
    assert outcome.returncode == 0 and not outcome.timed_out
    assert not _alive(child)


def test_after_a_timeout_children_that_ignore_sigterm_are_killed(tmp_path, monkeypatch):
    monkeypatch.setattr("ddpify.verify.launcher.GRACE_SECONDS", 0.5)
    outcome, child = _run(tmp_path, "hang", timeout=2)
    assert outcome.timed_out
    assert not _alive(child)


def test_sigterm_to_ddpify_takes_the_whole_run_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    driver = textwrap.dedent(
        f"""\
        import os, sys
        from pathlib import Path
        import ddpify.verify.launcher
        from ddpify.verify.launcher import launch
        ddpify.verify.launcher.GRACE_SECONDS = 0.5
        tmp = Path({str(tmp_path)!r})
        (tmp / "script.py").write_text({SCRIPT!r})
        launch([sys.executable, str(tmp / "script.py"), {str(pid_file)!r}, "hang"],
               dict(os.environ), tmp, tmp / "run.log", tmp / "pids", 120)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _set_order(env: dict[str, str]) -> str:
    code = "print(list({'cat', 'dog', 'bird', 'fish', 'ant', 'bee'}))"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout


def test_every_run_iterates_a_set_of_strings_in_one_order(tmp_path, monkeypatch):
    # Scripts that number labels by iterating `set(labels)` (graph and text datasets) must
    # build the same labels in the original and in every rank.
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    orders = {_set_order(probe_environment(tmp_path / "c.json", {})) for _ in range(4)}
    assert len(orders) == 1
    unpinned = {_set_order(dict(os.environ)) for _ in range(8)}
    assert len(unpinned) > 1  # the salt really is random without the pin


def test_a_user_chosen_hash_seed_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert probe_environment(tmp_path / "c.json", {})["PYTHONHASHSEED"] == "123"
