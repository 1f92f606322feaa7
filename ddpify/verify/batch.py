"""run_verify_many: verify several pairs with one torchrun launch and one plain process.

One `run_verify` starts torchrun's agent, N workers and the original's process, and each
imports torch for seconds before a probe run of a few optimizer steps. Whoever verifies many
pairs (the test suite, a benchmark over the migration fixtures) pays that once per pair. Here
every converted script of a batch runs in one torchrun launch and every original in one
process: probe_batch.py imports torch once and runs the probe's own `main` for each script in
a forked child, each with a rendezvous store of its own under torchrun. Each pair is then
judged exactly as run_verify judges it (same Session, same records, same comparison).

What differs from `ddpify verify`: a script runs in a fork of a process that imported torch,
not in a fresh interpreter, and its process group meets on a per-run store, not torchrun's.
What the launcher does on a hang, Ctrl-C or a crash (killing every process of the run) is
run_verify's alone; here a run past its timeout, or one whose other rank failed, is killed
and the batch goes on with the next.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ddpify.verify.launcher import RunOutcome, launch, probe_environment
from ddpify.verify.report import VerifyResult
from ddpify.verify.runner import (
    DEFAULT_TIMEOUT,
    CouldNotRun,
    Session,
    new_result,
    preflight,
    replace_result,
)

PROBE_BATCH = Path(__file__).resolve().with_name("probe_batch.py")
LAUNCH_SLACK_SECONDS = 120.0  # starting torchrun and importing torch, once per batch
DEFAULTS = {
    "nproc": 2,
    "steps": 3,
    "script_args": (),
    "batch_policy": "per-rank",
    "lr_scale": None,
    "rtol": None,
    "atol": None,
    "timeout": DEFAULT_TIMEOUT,
    "cwd": None,
    "converted_source": None,
    "fixed_codes": None,
}


@dataclass
class VerifyJob:
    """One pair to verify; `options` are run_verify's keyword arguments."""

    original: Path
    converted: Path
    options: dict = field(default_factory=dict)


@dataclass
class _Pending:
    index: int
    job: VerifyJob
    options: dict
    session: Session
    script: Path | None = None  # the script of the run being prepared
    config_path: Path | None = None
    first_rank: dict | None = None  # rank 0's record of the converted run
    failed: bool = False  # a run could not run; the result says why


def run_verify_many(jobs: Sequence[VerifyJob]) -> list[VerifyResult]:
    """The results of `run_verify(job.original, job.converted, **job.options)`, in order."""
    results: list[VerifyResult | None] = [None] * len(jobs)
    with ExitStack() as stack:
        pending = []
        for index, job in enumerate(jobs):
            ready = _prepare(index, job, stack)
            if isinstance(ready, VerifyResult):
                results[index] = ready
            else:
                pending.append(ready)
        batch_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpify-batch-")))
        for nproc in sorted({p.options["nproc"] for p in pending}):
            group = [p for p in pending if p.options["nproc"] == nproc]
            for item, result in zip(group, _verify_group(group, nproc, batch_dir)):
                results[item.index] = result
    return results  # type: ignore[return-value]


def _prepare(index: int, job: VerifyJob, stack: ExitStack) -> _Pending | VerifyResult:
    unknown = set(job.options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"run_verify has no option {sorted(unknown)}")
    options = {**DEFAULTS, **job.options}
    original, converted = Path(job.original), Path(job.converted)
    result = new_result(
        original,
        converted,
        options["nproc"],
        options["steps"],
        options["script_args"],
        options["batch_policy"],
        options["lr_scale"],
        options["timeout"],
    )
    problem = preflight(
        original, converted, options["converted_source"], options["nproc"], options["steps"]
    )
    if problem:
        result.message = problem
        return result
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpify-verify-")))
    cwd = Path(options["cwd"] or Path.cwd())
    session = Session(work, cwd, list(options["script_args"]), options["timeout"], result)
    return _Pending(index, VerifyJob(original, converted, job.options), options, session)


def _verify_group(group: list[_Pending], nproc: int, batch_dir: Path) -> list[VerifyResult]:
    """Both sides of every pair in `group` (all with `nproc` processes), then the verdicts."""
    alive = []
    for item in group:
        o = item.options
        item.script, config = item.session.converted_run(
            item.job.converted, o["converted_source"], nproc, o["steps"]
        )
        item.config_path = item.session.write_config("converted", config)
    for item, outcome in zip(group, _launch(group, "converted", nproc, batch_dir)):
        if _settled(item, "converted", outcome, nproc):
            alive.append(item)
    ready = []
    for item in alive:
        if _prepare_original(item, nproc):
            ready.append(item)
    for item, outcome in zip(ready, _launch(ready, "original", None, batch_dir)):
        _settled(item, "original", outcome, nproc)
    for item in group:
        o, session = item.options, item.session
        if not item.failed:
            session.judge(nproc, o["steps"], o["batch_policy"], o["rtol"], o["atol"])
    _follow_original_draws(group, nproc, batch_dir)
    _judge_per_rank(group, nproc, batch_dir)
    _check_precision(group, nproc, batch_dir)
    return [item.session.result for item in group]


def _follow_original_draws(group: list[_Pending], nproc: int, batch_dir: Path) -> None:
    """The converted runs that sliced a draw the original made whole, again following the
    original's draws (Session.follows_original_draws), in one more launch; then judged."""
    again = [i for i in group if not i.failed and i.session.follows_original_draws(nproc)]
    firsts = {}
    for item in again:
        item.script, config = item.session.converted_again(
            item.job.converted, item.options["converted_source"]
        )
        item.config_path = item.session.write_config("converted", config)
        firsts[item.index] = item.session.result
    for item, outcome in zip(again, _launch(again, "converted", nproc, batch_dir, "again")):
        o, session = item.options, item.session
        try:
            session.settle("converted", outcome)
            session.result = replace_result(session.result, session.run_notes)
            item.first_rank = session.converted_records(outcome, nproc)[0]
        except CouldNotRun as exc:
            session.again_failed(firsts[item.index], exc)
            continue
        session.judge(nproc, o["steps"], o["batch_policy"], o["rtol"], o["atol"])


def _judge_per_rank(group: list[_Pending], nproc: int, batch_dir: Path) -> None:
    """The per-rank references of the pairs whose one-process comparison asks for one
    (Session.wants_reference), in one more torchrun launch; then their verdicts."""
    wanting = [i for i in group if not i.failed and i.session.wants_reference(nproc)]
    for item in wanting:  # item.script is the original as run, fixes applied
        o, session = item.options, item.session
        config = session.reference_config(
            item.job.original, item.first_rank, nproc, o["steps"], o["batch_policy"], o["lr_scale"]
        )
        item.config_path = session.write_config("reference", config)
    for item, outcome in zip(wanting, _launch(wanting, "reference", nproc, batch_dir)):
        o, session = item.options, item.session
        try:
            session.settle("reference", outcome)
            session.reference_records(outcome, nproc)
        except CouldNotRun as exc:
            session.reference_failed(exc)
            continue
        session.judge_reference(nproc, o["steps"], o["batch_policy"], o["rtol"], o["atol"])


def _check_precision(group: list[_Pending], nproc: int, batch_dir: Path) -> None:
    """The pairs whose conversion matched the per-rank reference while the one-process run
    differed in gradients alone, both sides again in float64 (Session.wants_precision_check),
    one more launch for each side; then their verdicts."""
    wanting = [i for i in group if not i.failed and i.session.wants_precision_check()]
    originals = {}
    for item in wanting:  # item.script is the original as run, fixes applied
        originals[item.index] = item.script
        item.script, config = item.session.float64_converted(
            item.job.converted, item.options["converted_source"]
        )
        item.config_path = item.session.write_config("converted", config)
    ready = []
    for item, outcome in zip(wanting, _launch(wanting, "converted", nproc, batch_dir, "64")):
        session = item.session
        try:
            session.settle("converted", outcome)
            steps = session.result.settings["steps"]
            converted0 = session.records("converted", outcome, nproc, steps)[0]
        except CouldNotRun as exc:
            session.precision_failed(exc)
            continue
        item.script = originals[item.index]
        config = session.float64_original(item.job.original, converted0, nproc)
        item.config_path = session.write_config("original", config)
        ready.append(item)
    for item, outcome in zip(ready, _launch(ready, "original", None, batch_dir, "64")):
        o, session = item.options, item.session
        try:
            session.settle("original", outcome)
            session.records("original", outcome, 1, o["steps"])
        except CouldNotRun as exc:
            session.precision_failed(exc)
            continue
        session.judge_precision(nproc, o["steps"], o["batch_policy"], o["rtol"], o["atol"])


def _prepare_original(item: _Pending, nproc: int) -> bool:
    o, session, job = item.options, item.session, item.job
    try:
        item.script = session.fixed_original(
            job.original, job.converted, o["converted_source"], o["fixed_codes"]
        )
    except CouldNotRun as exc:
        return _could_not_run(item, exc)
    config = session.original_config(
        job.original, item.first_rank, nproc, o["steps"], o["batch_policy"], o["lr_scale"]
    )
    item.config_path = session.write_config("original", config)
    return True


def _settled(item: _Pending, role: str, outcome: RunOutcome, nproc: int) -> bool:
    """Whether the run went well; if not, the pair's result says why (as run_verify's would)."""
    session = item.session
    try:
        session.settle(role, outcome)
        if role == "converted":
            item.first_rank = session.converted_records(outcome, nproc)[0]
        else:
            session.original_records(outcome)
    except CouldNotRun as exc:
        return _could_not_run(item, exc)
    return True


def _could_not_run(item: _Pending, exc: CouldNotRun) -> bool:
    item.session.result.message = str(exc)
    item.session.result.failed_run = exc.role
    item.failed = True
    return False


def _launch(items: list[_Pending], role: str, nproc: int | None, batch_dir: Path, label=""):
    """One launch of probe_batch.py for the `role` side of `items`; their outcomes. `label`
    names the files of a second launch of the same role."""
    if not items:
        return []
    ranks = nproc or 1
    runs = []
    for number, item in enumerate(items):
        session = item.session
        runs.append(
            {
                "script": str(item.script.resolve()),
                "argv": session.script_args,
                "config": str(item.config_path),
                "cwd": str(session.cwd),
                "env": session.extra_env,
                "timeout": session.timeout,
                "log": str(session.work / f"{role}{label}.log"),
                "status": str(batch_dir / f"{role}{label}-{nproc}-{number}.status"),
            }
        )
    manifest = batch_dir / f"{role}{label}-{nproc}.json"
    manifest.write_text(json.dumps(runs), encoding="utf-8")
    command = [sys.executable, str(PROBE_BATCH), str(manifest)]
    if nproc is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone"]
        command[4:4] = [f"--nproc_per_node={nproc}", "--max_restarts=0"]
    whole = launch(
        command,
        probe_environment(manifest, {}),
        batch_dir,
        batch_dir / f"{role}{label}-{nproc}.log",
        batch_dir / f"{role}{label}-{nproc}-pids",
        sum(run["timeout"] for run in runs) + LAUNCH_SLACK_SECONDS,
    )
    return [_outcome(run, ranks, whole) for run in runs]


def _outcome(run: dict, ranks: int, whole: RunOutcome) -> RunOutcome:
    """One run's outcome, read from what each rank's batch process wrote about it."""
    outputs, returncode, timed_out, seconds = [], 0, False, 0.0
    for rank in range(ranks):
        log, status = Path(f"{run['log']}.rank{rank}"), Path(f"{run['status']}.rank{rank}")
        if log.is_file():
            outputs.append(log.read_text(encoding="utf-8", errors="replace"))
        if not status.is_file():  # the batch itself died or hung before this run ended
            outputs.append(whole.output)
            return RunOutcome(whole.returncode or 1, whole.timed_out, "".join(outputs), 0.0, [])
        done = json.loads(status.read_text(encoding="utf-8"))
        returncode = returncode or done["returncode"]
        timed_out = timed_out or done["timed_out"]
        seconds = max(seconds, done["seconds"])
    return RunOutcome(returncode, timed_out, "".join(outputs), seconds, [])
