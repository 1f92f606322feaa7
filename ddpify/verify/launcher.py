"""Start a script under the probe, as one process or under torchrun, and never leave children.

Each run gets its own session (process group); on a timeout or Ctrl-C the whole group gets
SIGTERM, then SIGKILL. torchrun starts its workers in sessions of their own, so the probe makes
every worker die with its parent (PR_SET_PDEATHSIG) and records its pid; whatever pid is still
alive after the run, and still runs the probe, is killed by that pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROBE = Path(__file__).resolve().with_name("probe.py")
GRACE_SECONDS = 3.0
# Set by a surrounding torchrun or launcher; the original must run as a plain single process.
DISTRIBUTED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass
class RunOutcome:
    returncode: int | None
    timed_out: bool
    output: str
    seconds: float
    pids: list[int]


def probe_command(script: Path, script_args: list[str], nproc: int | None) -> list[str]:
    """`nproc=None` runs one plain process; a number runs torchrun with that many."""
    if nproc is None:
        return [sys.executable, str(PROBE), str(script), *script_args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max_restarts=0",
        str(PROBE),
        str(script),
        *script_args,
    ]


def probe_environment(config_path: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["DDPIFY_VERIFY_CONFIG"] = str(config_path)
    env.update(extra)
    return env


def launch(
    command: list[str],
    env: dict[str, str],
    cwd: Path,
    log_path: Path,
    pid_dir: Path,
    timeout: float,
) -> RunOutcome:
    start = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(process)
        except BaseException:
            stop_group(process)
            raise
        finally:
            pids = recorded_pids(pid_dir)
            kill_leftovers(pids)
    output = log_path.read_text(encoding="utf-8", errors="replace")
    return RunOutcome(process.returncode, timed_out, output, time.monotonic() - start, pids)


def stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, GRACE_SECONDS)):
        try:
            if hasattr(os, "killpg"):
                os.killpg(process.pid, sig)
            else:
                process.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def recorded_pids(pid_dir: Path) -> list[int]:
    if not pid_dir.is_dir():
        return []
    return sorted(int(entry.name) for entry in pid_dir.iterdir() if entry.name.isdigit())


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if runs_probe(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def runs_probe(pid: int) -> bool:
    """Whether `pid` is alive and still one of our probe processes (not a reused pid)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        return str(PROBE).encode() in cmdline.read_bytes()
    except OSError:  # gone, or no /proc (not Linux): then the process group kill is all we do
        return False
