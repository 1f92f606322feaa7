"""Start a script under the probe, as one process or under torchrun, and never leave children.

Each run gets its own session (process group); on a timeout, Ctrl-C, SIGTERM or SIGHUP the
whole group gets SIGTERM, then SIGKILL. But a script may start children that leave the group
(`Popen(start_new_session=True)`, a double fork, torchrun's workers), and such children may
ignore SIGTERM. So, on every exit path, the whole tree goes:
- ddpify makes itself a child subreaper (Linux), so orphans of the run are re-parented to it
  instead of to init and stay findable as its descendants;
- every process of the run inherits a per-run token in its environment;
- after the run, every process that descends from the run or carries the token is killed with
  SIGKILL (repeatedly, until none is left: a process may fork while it is being killed), and
  the ones re-parented to ddpify are reaped.
The probe also makes each worker die with its parent (PR_SET_PDEATHSIG) and records its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROBE = Path(__file__).resolve().with_name("probe.py")
GRACE_SECONDS = 3.0
# Every process of one run inherits this variable, with a value unique to the run.
RUN_TOKEN_ENV = "DDPIFY_VERIFY_RUN"
PR_SET_CHILD_SUBREAPER = 36
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
    # str hashes are salted per process: a script that numbers labels by iterating a set of
    # strings would get other labels in every rank and in the original. One salt for all.
    if not env.get("PYTHONHASHSEED", "").isdigit():
        env["PYTHONHASHSEED"] = "0"
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
    token = f"{os.getpid()}-{os.urandom(8).hex()}"
    become_subreaper()
    with open(log_path, "wb") as log, _signals_raise_exit():
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, RUN_TOKEN_ENV: token},
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
            kill_tree(process.pid, token)
    output = log_path.read_text(encoding="utf-8", errors="replace")
    return RunOutcome(process.returncode, timed_out, output, time.monotonic() - start, pids)


@contextlib.contextmanager
def _signals_raise_exit() -> Iterator[None]:
    """While a run is under way, SIGTERM and SIGHUP end ddpify through SystemExit, so the
    cleanup above runs (the default action would die at once and leave the run behind)."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    installed = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                installed[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process, not to init (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every visible process (from /proc; empty elsewhere)."""
    parents = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and fields[0] != b"Z":  # zombies are dead already
            parents[int(entry)] = int(fields[1])
    return parents


def _carries(pid: int, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{RUN_TOKEN_ENV}={token}".encode() in handle.read().split(b"\0")
    except OSError:
        return False


def run_members(root: int, token: str) -> set[int]:
    """The processes of a run: descendants of `root`, and every process carrying `token`
    (with its descendants); never this process."""
    parents = _parents()
    members = {root} if root in parents else set()
    members |= {pid for pid in parents if _carries(pid, token)}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    pending = list(members)
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in members:
                members.add(child)
                pending.append(child)
    members.discard(os.getpid())
    return members


def kill_tree(root: int, token: str, rounds: int = 20) -> None:
    """SIGKILL every process of the run until none is left, then reap the orphans that were
    re-parented to this process."""
    killed: set[int] = set()
    for _ in range(rounds):
        members = run_members(root, token)
        if not members:
            break
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= members
        time.sleep(0.02)
    for pid in killed:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


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
