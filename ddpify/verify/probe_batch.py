"""Run several probe runs one after another in one process, or in one torchrun launch.

    python probe_batch.py MANIFEST
    torchrun --standalone --nproc_per_node=N probe_batch.py MANIFEST

MANIFEST is a JSON list of runs: {"script", "argv", "config", "cwd", "env", "timeout", "log",
"status"}. Importing torch and starting torchrun's workers cost seconds per process, far
more than the few optimizer steps a probe run makes; batch.py verifies many pairs with one
launch per side. Torch is imported once, here; each run is the probe's own `main` in a
forked child of this process (so no run leaves state to the next), with the run's working
directory, environment, argv and settings file, its output in `<log>.rank<R>` and its exit
in `<status>.rank<R>` ({"returncode", "timed_out", "seconds"}).

Under torchrun, each run gets a rendezvous store of its own, served by a keeper process
that rank 0's batch process starts (StoreKeeper): a script re-initialising the default
group on the store of a previous run would find its keys and wait forever. As torchrun's
agent does, a run that fails on one rank is stopped on the others (they would wait for it
in a collective until the timeout).

Like probe.py, this file needs only the standard library and torch.
"""

import json
import os
import signal
import sys
import time
import traceback

POLL_SECONDS = 0.05
# What nearly every training script loads, imported once before the runs fork: constructing
# the first optimizer imports torch._dynamo (seconds of CPU), and so on.
WARM_IMPORTS = (
    "torch._dynamo",
    "torch.optim",
    "torch.utils.data",
    "torch.distributed",
    "torch.nn.parallel",
)


class Rendezvous:
    """Per run, a fresh store for the scripts and a shared flag for a failed rank."""

    def __init__(self):
        self.distributed = "RANK" in os.environ
        if not self.distributed:
            return
        from torch.distributed import TCPStore

        self.host = os.environ["MASTER_ADDR"]
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.launcher = TCPStore(self.host, int(os.environ["MASTER_PORT"]), is_master=False)
        self.current = None

    def open(self, index):
        if not self.distributed:
            return
        key = f"ddpify-batch/{index}/port"
        if self.rank == 0:  # port 0: the system picks a free one; the others read it
            self.current = StoreKeeper(self.host, self.world)
            self.launcher.set(key, str(self.current.port))
        os.environ["MASTER_PORT"] = self.launcher.get(key).decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the scripts connect as clients

    def fail(self, index):
        if self.distributed:
            self.launcher.set(f"ddpify-batch/{index}/failed", "1")

    def failed_elsewhere(self, index):
        return self.distributed and self.launcher.check([f"ddpify-batch/{index}/failed"])

    def close(self, index):
        """Wait until every rank is done with the run, then drop its store."""
        if not self.distributed:
            return
        key = f"ddpify-batch/{index}/done"
        if self.launcher.add(key, 1) == self.world:
            self.launcher.set(key + "/all", "1")
        self.launcher.wait([key + "/all"])
        if self.current is not None:
            self.current.stop()
        self.current = None


class StoreKeeper:
    """A fresh rendezvous store, served by a process of its own.

    The store's server runs a thread; were it served here, every later fork of a run would
    copy a process whose server thread may hold a lock, and that run could hang before its
    first line (seen about once in three suite runs on 2 busy cores). This process forks the
    keeper while it has no such thread; the keeper never forks."""

    def __init__(self, host, world):
        port_read, port_write = os.pipe()
        stop_read, self._stop = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(port_read)
            os.close(self._stop)
            os._exit(_keep_store(host, world, port_write, stop_read))
        os.close(port_write)
        os.close(stop_read)
        with os.fdopen(port_read, "rb") as answer:
            port = answer.read().decode()
        if not port:
            os.waitpid(self.pid, 0)
            raise RuntimeError("the rendezvous store could not be started")
        self.port = int(port)

    def stop(self):
        os.close(self._stop)  # the keeper's read returns: it exits
        os.waitpid(self.pid, 0)


def _keep_store(host, world, port_write, stop_read):
    try:
        from torch.distributed import TCPStore

        store = TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        os.write(port_write, str(store.port).encode())
        os.close(port_write)
        os.read(stop_read, 1)  # until the runner stops it, or dies (end of file)
        return 0
    except BaseException:  # noqa: BLE001 - the runner sees no port and says so
        traceback.print_exc()
        return 1


def run_one(index, run, rendezvous, probe_main):
    rank = os.environ.get("RANK", "0")
    start = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(_child(run, f"{run['log']}.rank{rank}", probe_main))
    returncode, timed_out = _wait(pid, start + float(run["timeout"]), index, rendezvous)
    if returncode != 0:
        rendezvous.fail(index)
    status = {
        "returncode": returncode,
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }
    with open(f"{run['status']}.rank{rank}", "w", encoding="utf-8") as handle:
        json.dump(status, handle)


def _wait(pid, deadline, index, rendezvous):
    """The child's exit code; it is killed at the deadline or when another rank failed."""
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), timed_out
        timed_out = time.monotonic() > deadline
        if timed_out or rendezvous.failed_elsewhere(index):
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), timed_out
        time.sleep(POLL_SECONDS)


def _child(run, log_path, probe_main):
    """The probe's main, as `python probe.py SCRIPT ARGV...` would run it."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(run["cwd"])
    os.environ.update(run["env"])
    os.environ["DDPIFY_VERIFY_CONFIG"] = run["config"]
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")]
    sys.argv += [run["script"], *run["argv"]]
    code = 0
    pin_distributed_objects()
    try:
        code = probe_main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the probe recorded it; show it as python would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def pin_distributed_objects():
    """Keep every DDP wrapper and process group a forked run makes alive until its
    os._exit. Their destructors, run when the script's last frame returns, sometimes
    deadlock in a forked child (a gloo or reducer thread left waiting; seen as a run that
    logged its last epoch, then hung at the line returning from `main()`). A process that
    ends with os._exit needs no teardown. Call in the child, before the script runs."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    pinned = []
    init, destroy = DistributedDataParallel.__init__, c10d.destroy_process_group

    def init_pinned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pinned.append(self)

    def destroy_pinned(group=None):
        pinned.append(group if group is not None else c10d.GroupMember.WORLD)
        return destroy(group)

    DistributedDataParallel.__init__ = init_pinned
    dist.destroy_process_group = c10d.destroy_process_group = destroy_pinned
    return pinned


def warm_up():
    """Import torch and what the scripts will need once, here, instead of once per run."""
    import importlib

    import torch  # noqa: F401 - imported once, shared by every forked run

    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # an older torch; the scripts import what they need
            pass


def main(manifest_path):
    warm_up()
    from probe import main as probe_main  # this file's directory is sys.path[0]

    with open(manifest_path, encoding="utf-8") as handle:
        runs = json.load(handle)
    rendezvous = Rendezvous()
    for index, run in enumerate(runs):
        rendezvous.open(index)
        run_one(index, run, rendezvous, probe_main)
        rendezvous.close(index)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
