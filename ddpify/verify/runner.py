"""run_verify: run the converted script under torchrun, then the original, and compare."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from ddpify.verify.compare import Comparison, compare_runs
from ddpify.verify.launcher import RunOutcome, launch, probe_command, probe_environment
from ddpify.verify.original_fixes import fix_original
from ddpify.verify.per_rank import (
    PER_RANK,
    WHAT,
    check_shares,
    merged_reference,
    reference_message,
)
from ddpify.verify.report import (
    EXIT_COULD_NOT_RUN,
    EXIT_MATCH,
    EXIT_MISMATCH,
    VerifyResult,
)

BATCH_POLICIES = ("per-rank", "global", "auto")
SHARE_GPUS_ENV = "DDPIFY_VERIFY_SHARE_GPUS"  # read by the probe
DEFAULT_TIMEOUT = 300.0


class CouldNotRun(Exception):
    def __init__(self, message: str, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


def run_verify(
    original: Path,
    converted: Path,
    *,
    nproc: int = 2,
    steps: int = 3,
    script_args: Sequence[str] = (),
    batch_policy: str = "per-rank",
    lr_scale: float | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    cwd: Path | None = None,
    converted_source: str | None = None,
    fixed_codes: Sequence[str] | None = None,
) -> VerifyResult:
    """Run ORIGINAL on one process and CONVERTED on `nproc`, compare `steps` optimizer steps.

    `timeout` applies to each of the two runs. `converted_source`, when given, is run in place
    of the file's contents (the file need not exist; its directory is the script's directory),
    which lets `migrate --verify` check a migration before writing it. `fixed_codes` is the
    migration's record of the codes it fixed (`MigrationResult.fixed_codes`); when None it is
    recomputed from the original. The original runs with the number-changing ones of those
    fixes applied (see original_fixes.py).
    """
    original, converted = Path(original), Path(converted)
    result = new_result(
        original, converted, nproc, steps, script_args, batch_policy, lr_scale, timeout
    )
    problem = preflight(original, converted, converted_source, nproc, steps)
    if problem:
        result.message = problem
        return result
    # The runs take seconds of torch imports each; importing torch here meanwhile is free.
    torch_import = threading.Thread(target=importlib.import_module, args=("torch",), daemon=True)
    torch_import.start()
    with tempfile.TemporaryDirectory(prefix="ddpify-verify-") as work:
        session = Session(Path(work), Path(cwd or Path.cwd()), list(script_args), timeout, result)
        try:
            conv = session.run_converted(converted, converted_source, nproc, steps)
            script = session.fixed_original(original, converted, converted_source, fixed_codes)
            session.run_original(original, conv[0], nproc, steps, batch_policy, lr_scale, script)
        except CouldNotRun as exc:
            result.message = str(exc)
            result.failed_run = exc.role
            return result
        torch_import.join()
        session.judge(nproc, steps, batch_policy, rtol, atol)
        if session.follows_original_draws(nproc):
            script_again, config_again = session.converted_again(converted, converted_source)
            first = session.result
            try:
                session.run_converted_again(script_again, config_again, nproc)
            except CouldNotRun as exc:
                return session.again_failed(first, exc)
            session.judge(nproc, steps, batch_policy, rtol, atol)
        if not session.wants_reference(nproc):
            return session.result
        config = session.reference_config(original, conv[0], nproc, steps, batch_policy, lr_scale)
        try:
            session.run_reference(script, config, nproc)
        except CouldNotRun as exc:
            return session.reference_failed(exc)
        session.judge_reference(nproc, steps, batch_policy, rtol, atol)
        if not session.wants_precision_check():
            return session.result
        try:
            session.run_in_float64(original, script, converted, converted_source, nproc)
        except CouldNotRun as exc:
            return session.precision_failed(exc)
        return session.judge_precision(nproc, steps, batch_policy, rtol, atol)


def new_result(
    original, converted, nproc, steps, script_args, batch_policy, lr_scale, timeout
) -> VerifyResult:
    """The result before anything ran: an error until the runs say otherwise."""
    if batch_policy not in BATCH_POLICIES:
        raise ValueError(f"batch_policy must be one of {BATCH_POLICIES}, not {batch_policy!r}")
    settings = {
        "original": str(original),
        "converted": str(converted),
        "nproc": nproc,
        "steps": steps,
        "batch_policy": batch_policy,
        "lr_scale": lr_scale,
        "script_args": list(script_args),
        "timeout": timeout,
    }
    return VerifyResult(EXIT_COULD_NOT_RUN, "error", "", settings=settings)


def preflight(original, converted, converted_source, nproc, steps) -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "ddpify verify needs PyTorch, which is not installed: pip install 'ddpify[verify]'"
    if nproc < 1 or steps < 1:
        return "--nproc and --steps must be at least 1"
    for path in (original, converted) if converted_source is None else (original,):
        if not path.is_file():
            return f"{path}: no such file"
    return None


class Session:
    """The two runs of one verify, sharing a work directory and the device decision."""

    def __init__(self, work: Path, cwd: Path, script_args, timeout, result) -> None:
        self.work, self.cwd, self.script_args, self.timeout = work, cwd, script_args, timeout
        self.result = result
        self.extra_env: dict[str, str] = {}
        self.comparison: Comparison | None = None  # with the one-process original
        self.converted: list[dict] = []  # the converted run's records, once judged
        self.run_notes: list[str] = []  # the notes about the runs, not the comparison
        self.original: dict | None = None  # the original's record, once judged
        # The original's draws ([kind, shape]) the converted run followed when run again.
        self.original_draws: list | None = None
        # The one-process result, when the conversion matched the per-rank reference and the
        # one-process run differed in gradients alone (unexplained_difference).
        self.unexplained: VerifyResult | None = None

    def choose_device(self, nproc: int) -> None:
        """A GPU per process: as the script decides (nccl). Fewer: the ranks share them over
        gloo, so the GPU and AMP paths are still compared. None: CPU, said in the notes."""
        gpus = visible_gpus()
        if gpus == 0:
            self.result.notes.append(
                "no GPU visible: both runs on CPU (gloo); the scripts' CUDA-only paths (AMP on "
                "CUDA, SyncBatchNorm, nccl) are not exercised"
            )
        elif gpus < nproc:
            self.extra_env[SHARE_GPUS_ENV] = str(gpus)
        self.result.settings["device"] = "cuda" if gpus else "cpu"
        self.result.settings["gpus"] = gpus

    def fixed_original(self, original, converted, converted_source, fixed_codes) -> Path:
        """The original to run: itself, or a copy with the conversion's numeric fixes."""
        text = original.read_text(encoding="utf-8", errors="surrogateescape")
        if converted_source is None:
            converted_source = converted.read_text(encoding="utf-8", errors="replace")
        fixes = fix_original(text, converted_source, str(original), fixed_codes)
        for missing in fixes.not_applied:
            self.result.notes.append(
                f"the migration fixed {missing}, which ddpify cannot apply to the original: "
                "a difference may come from it"
            )
        if not fixes.changed:
            return original
        self.result.notes.append(
            "the original was run with the fixes the migration made that change the numbers "
            "(ddpify's own fixes, on a temporary copy): " + "; ".join(fixes.applied)
        )
        self.result.settings["original_fixes"] = fixes.applied
        script = self.work / "original_fixed.py"
        script.write_text(fixes.text, encoding="utf-8", errors="surrogateescape")
        return script

    def run_converted(self, converted, source, nproc, steps) -> list[dict]:
        """Run the converted script; returns the ranks' summaries (see probe.Probe.summary)."""
        script, config = self.converted_run(converted, source, nproc, steps)
        return self.converted_records(self.launch("converted", script, config, nproc), nproc)

    def converted_run(self, converted, source, nproc, steps) -> tuple[Path, dict]:
        """The script and probe settings of the converted run (batch.py launches many)."""
        self.choose_device(nproc)
        script = converted
        if source is not None:
            script = self.work / "converted_source.py"
            script.write_text(source, encoding="utf-8")
        config = {
            "role": "converted",
            "steps": steps,
            "nproc": nproc,
            "display_path": str(converted.resolve()),
        }
        return script, config

    def follows_original_draws(self, nproc: int) -> bool:
        """Whether to run the converted script again, following the original's draws: its
        ranks sliced a draw the original made at one rank's shape (a dimension that only
        equalled the per-process batch, `randn(n, 1, z)` with a batch of 1), and nothing
        else is a mismatch. Once only."""
        comparison = self.comparison
        if nproc < 2 or comparison is None or self.original_draws is not None:
            return False
        return comparison.unsliced_in_original and not comparison.findings

    def converted_again(self, converted, source) -> tuple[Path, dict]:
        """The converted run's script and settings, following the original's draws; its
        first records are put aside."""
        assert self.original is not None
        self.original_draws = [list(draw[:2]) for draw in self.original.get("draws", [])]
        (self.work / "converted").rename(self.work / "converted-sliced")
        return self._converted_again(converted, source)

    def _converted_again(self, converted, source, **settings) -> tuple[Path, dict]:
        """The converted script and its settings for another run that follows the
        original's draws (`settings`: what else that run changes)."""
        script = self.work / "converted_source.py" if source is not None else converted
        config = {
            "role": "converted",
            "steps": self.result.settings["steps"],
            "nproc": self.result.settings["nproc"],
            "display_path": str(converted.resolve()),
            "original_draws": self.original_draws,
            **settings,
        }
        return script, config

    def run_converted_again(self, script: Path, config: dict, nproc: int) -> None:
        outcome = self.launch("converted", script, config, nproc)
        self.result = replace_result(self.result, self.run_notes)
        self.converted_records(outcome, nproc)

    def again_failed(self, first: VerifyResult, exc: CouldNotRun) -> VerifyResult:
        """The converted run following the original's draws could not run: the first
        comparison stands (inconclusive), saying so."""
        first.notes.append(
            f"running the converted script again, following the original's draws, failed: {exc}"
        )
        self.result = first
        return first

    def converted_records(self, outcome: RunOutcome, nproc: int) -> list[dict]:
        self.result.converted_output = outcome.output
        return self.records("converted", outcome, nproc, self.result.settings["steps"])

    def run_original(
        self, original, converted0, nproc, steps, batch_policy, lr_scale, script=None
    ) -> None:
        config = self.original_config(original, converted0, nproc, steps, batch_policy, lr_scale)
        self.original_records(self.launch("original", script or original, config, None))

    def original_config(self, original, converted0, nproc, steps, batch_policy, lr_scale) -> dict:
        """The original run's probe settings, which depend on the converted run's rank 0."""
        per_rank_scales = [1.0, float(nproc), math.sqrt(nproc)]
        config = {
            "role": "original",
            "steps": steps,
            "nproc": nproc,
            "batch_policy": batch_policy,
            "lr_scale": lr_scale,
            "lr_scale_candidates": [1.0] if batch_policy == "global" else per_rank_scales,
            "converted_batch_sizes": converted0["batch_sizes"],
            "converted_lrs": converted0["first_lrs"],
            # how the conversion's DataLoaders deal out their samples (a stream sharded
            # round-robin is aligned; per_rank.py, probe_reference.py)
            "converted_loaders": converted0.get("loaders"),
            "display_path": str(original.resolve()),
        }
        return config

    def reference_config(self, original, converted0, nproc, steps, batch_policy, lr_scale):
        """The per-rank reference's settings: the original's, and how the conversion's
        DataLoaders deal out their samples (per_rank.py, probe_reference.py)."""
        config = self.original_config(original, converted0, nproc, steps, batch_policy, lr_scale)
        synced = bool(converted0.get("sync_bn")) and not converted0.get("local_bn")
        return {
            **config,
            "role": "reference",
            "converted_sync_bn": synced,
            # draws the converted run made whole, as the original did (follows_original_draws)
            "original_draws": self.original_draws,
        }

    def run_reference(self, script: Path, config: dict, nproc: int) -> None:
        self.reference_records(self.launch("reference", script, config, nproc), nproc)

    def reference_records(self, outcome: RunOutcome, nproc: int) -> None:
        noted = len(self.result.notes)
        self.records("reference", outcome, nproc, self.result.settings["steps"])
        self.run_notes.extend(self.result.notes[noted:])  # about the run: they carry over

    def wants_reference(self, nproc: int) -> bool:
        """Whether the one-process comparison was inconclusive only for reasons the per-rank
        reference answers. Not for hand-made batches the conversion split by rank: the
        reference cannot split the original's batches where the migration did."""
        comparison = self.comparison
        if nproc < 2 or comparison is None:
            return False
        split = any(s.get("split") for r in self.converted for s in r["steps"])
        if self.result.verdict == "mismatch":
            return comparison.differs_in_gradients_only and not split
        return self.result.verdict == "inconclusive" and comparison.answered_per_rank and not split

    def reference_failed(self, exc: CouldNotRun) -> VerifyResult:
        self.result.notes.append(
            f"the per-rank reference (the original run as DDP on the same processes) could "
            f"not run, so the result stays inconclusive: {exc}"
        )
        return self.result

    def original_records(self, outcome: RunOutcome) -> None:
        self.result.original_output = outcome.output
        self.records("original", outcome, 1, self.result.settings["steps"])

    def launch(self, role: str, script: Path, config: dict, nproc: int | None) -> RunOutcome:
        config_path = self.write_config(role, config)
        outcome = launch(
            probe_command(script.resolve(), self.script_args, nproc),
            probe_environment(config_path, self.extra_env),
            self.cwd,
            self.work / f"{role}.log",
            self.work / role / "pids",
            self.timeout,
        )
        return self.settle(role, outcome)

    def write_config(self, role: str, config: dict) -> Path:
        """The probe's settings file for `role`, beside the directory its records go to."""
        out_dir = self.work / role
        out_dir.mkdir()
        config = {**config, "out_dir": str(out_dir)}
        config_path = self.work / f"{role}.json"
        config_path.write_text(json.dumps(config), encoding="utf-8")
        return config_path

    def settle(self, role: str, outcome: RunOutcome) -> RunOutcome:
        """Record how long the run took; a run that timed out could not run."""
        self.result.seconds[role] = round(outcome.seconds, 2)
        if outcome.timed_out:
            raise CouldNotRun(
                f"the {role} run timed out after {self.timeout:g} s (a hang, or too slow: raise "
                "--timeout); its processes were stopped",
                role,
            )
        return outcome

    def judge(self, nproc, steps, batch_policy, rtol, atol) -> VerifyResult:
        """Compare the two runs' records and conclude (both runs are done)."""
        self.original = orig = self.load("original", 1)[0]
        self.converted = conv = self.load("converted", nproc)
        comparison = compare_runs(orig, conv, nproc, batch_policy, rtol, atol)
        self.comparison = comparison
        tolerance = {"rtol": comparison.tolerance[0], "atol": comparison.tolerance[1]}
        self.result.settings["tolerance"] = tolerance
        self.run_notes = list(self.result.notes)
        return conclude(self.result, comparison, steps)

    def judge_reference(self, nproc, steps, batch_policy, rtol, atol) -> VerifyResult:
        """Compare the conversion with the per-rank reference (that run is done): a match or
        a mismatch replaces the one-process result; an inconclusive one leaves it."""
        references = self.load("reference", nproc)
        merged = merged_reference(references)
        comparison = compare_runs(merged, self.converted, nproc, batch_policy, rtol, atol)
        check_shares(references, self.converted, comparison)
        first = self.result
        judged = conclude(replace_result(first, self.run_notes), comparison, steps)
        if first.verdict == "mismatch":
            return self.unexplained_difference(first, judged)
        if judged.verdict not in ("match", "mismatch"):
            first.notes.append(
                "the per-rank reference (the original run as DDP on the same processes) "
                f"settles nothing either: {judged.message}"
            )
            return first
        causes = self.comparison.per_rank_causes if self.comparison else []
        judged.reference, judged.per_rank_causes = PER_RANK, list(dict.fromkeys(causes))
        judged.message = reference_message(judged.verdict, judged.message, causes)
        judged.notes.append(f"against the one-process run: {first.verdict}: {first.message}")
        self.result = judged
        return judged

    def unexplained_difference(self, first: VerifyResult, judged: VerifyResult) -> VerifyResult:
        """The one-process run differs in gradients alone. If the conversion computes the
        original run as DDP exactly, it is not shown wrong, nor right: DDP of this script
        differs from one process by more than the tolerance, for a reason verify cannot
        name. Anything else keeps the mismatch."""
        if judged.verdict != "match":
            first.notes.append(
                "the per-rank reference (the original run as DDP on the same processes) "
                f"differs from the conversion too: {judged.verdict}: {judged.message}"
            )
            # The reference settles nothing (it may deal its samples otherwise, as with a
            # weighted sampler); float64 still tells rounding from a real difference.
            self.unexplained = first
            return first
        judged.exit_code, judged.verdict, judged.reference = (
            EXIT_COULD_NOT_RUN,
            "inconclusive",
            PER_RANK,
        )
        judged.inconclusive = [
            f"the conversion computes the original run as DDP ({judged.message}), but that "
            f"differs from one process over the whole batch beyond the tolerance ({first.message}) "
            "for a reason verify cannot name: rounding through statistics summed over "
            "processes (SyncBatchNorm), or a mean over per-process counts"
        ]
        judged.message = (
            "the runs differ, but the comparison cannot be trusted: the conversion matches "
            f"{WHAT}; the one-process run differs ({first.message})"
        )
        judged.notes.append(f"against the one-process run: {first.verdict}: {first.message}")
        self.result = judged
        self.unexplained = first
        return judged

    # -- the precision check: rounding or not ----------------------------------------------

    def wants_precision_check(self) -> bool:
        """Whether the one-process run differs in gradients alone and the per-rank reference
        either matched the conversion or settled nothing: running both again in float64
        tells rounding (the difference vanishes) from a difference in what the code
        computes (it stays, and so does the verdict)."""
        return self.unexplained is not None

    def float64_converted(self, converted, source) -> tuple[Path, dict]:
        """The converted run's script and settings in float64; the float32 records of both
        runs are put aside."""
        for role in ("converted", "original"):
            (self.work / role).rename(self.work / f"{role}-float32")
        return self._converted_again(converted, source, float64=True)

    def float64_original(self, original, converted0: dict, nproc: int) -> dict:
        settings = self.result.settings
        config = self.original_config(
            original,
            converted0,
            nproc,
            settings["steps"],
            settings["batch_policy"],
            settings["lr_scale"],
        )
        return {**config, "float64": True}

    def run_in_float64(self, original, script, converted, source, nproc: int) -> None:
        """Both runs again, the model, the batches and the float32 tensors the scripts make
        themselves in float64 (probe.run_in_float64)."""
        converted_script, config = self.float64_converted(converted, source)
        outcome = self.launch("converted", converted_script, config, nproc)
        converted0 = self.records("converted", outcome, nproc, self.result.settings["steps"])[0]
        config = self.float64_original(original, converted0, nproc)
        outcome = self.launch("original", script, config, None)
        self.records("original", outcome, 1, self.result.settings["steps"])

    def precision_failed(self, exc: CouldNotRun) -> VerifyResult:
        self.result.notes.append(
            "the precision check (both scripts again in float64, to tell rounding from a "
            f"difference in what the code computes) could not run: {exc}"
        )
        return self.result

    def judge_precision(self, nproc, steps, batch_policy, rtol, atol) -> VerifyResult:
        """The float64 runs compared: a match says the float32 difference was rounding and
        the conversion computes what the original computes; anything else leaves the
        inconclusive result, saying that the difference is not rounding alone."""
        first = self.unexplained
        assert first is not None
        conv = self.load("converted", nproc)
        orig = self.load("original", 1)[0]
        if not all(r["flags"].get("float64") for r in [orig, *conv]):
            return self.precision_failed(CouldNotRun("the probe did not switch to float64"))
        comparison = compare_runs(orig, conv, nproc, batch_policy, rtol, atol)
        judged = conclude(replace_result(first, self.run_notes), comparison, steps)
        if judged.verdict != "match":
            self.result.notes.append(
                "the precision check (both scripts again in float64) does not settle it: "
                f"{judged.verdict}: {judged.message}; the difference is not rounding alone"
            )
            return self.result
        tolerance = {"rtol": comparison.tolerance[0], "atol": comparison.tolerance[1]}
        judged.settings = {**first.settings, "tolerance": tolerance, "precision": "float64"}
        judged.message = (
            f"in float64 (the model, the batches and the tensors the scripts make, both runs), "
            f"{judged.message}; in float32 "
            f"the runs differ by rounding alone ({first.message})"
        )
        reference = (
            f"while the conversion matched {WHAT} (the per-rank reference)"
            if self.result is not first
            else "and the per-rank reference settled nothing"
        )
        judged.notes.append(
            "precision check: in float32 the one-process run differed beyond the tolerance "
            f"{reference}; run again in float64 the two agree, so the float32 difference is "
            "rounding (sums over the processes in another order than one process's, e.g. "
            "SyncBatchNorm's statistics, amplified through the network), not a difference "
            "in what the code computes"
        )
        judged.notes.append(f"in float32: {first.verdict}: {first.message}")
        self.result = judged
        return judged

    def load(self, role: str, nproc: int) -> list[dict]:
        import torch

        paths = [self.work / role / f"{role}-rank{rank}.pt" for rank in range(nproc)]
        return [torch.load(path, weights_only=True) for path in paths]

    def records(self, role: str, outcome: RunOutcome, nproc: int, steps: int) -> list[dict]:
        paths = [self.work / role / f"{role}-rank{rank}.json" for rank in range(nproc)]
        records = [json.loads(p.read_text(encoding="utf-8")) for p in paths if p.is_file()]
        # The first rank to fail is the cause; the others fail in collectives after it.
        errors = sorted((r for r in records if r["status"] == "error"), key=lambda r: r["time"])
        if errors or outcome.returncode != 0 or len(records) < nproc:
            detail = f" (rank {errors[0]['rank']})" if errors else ""
            raise CouldNotRun(
                f"the {role} script crashed{detail}, exit status {outcome.returncode}: "
                f"{last_error_line(errors, outcome.output)}",
                role,
            )
        reached = min(r["steps"] for r in records)
        if reached == 0:
            raise CouldNotRun(
                f"the {role} script ended without an optimizer step (no optimizer.step() "
                "reached: check the script arguments, e.g. the number of epochs or the data)",
                role,
            )
        if reached < steps:
            self.result.notes.append(ended_early_note(role, records, reached, steps))
        return records


def ended_early_note(role: str, records: list[dict], reached: int, steps: int) -> str:
    """A run that ended by itself before optimizer 0's `steps`-th step (where the probe
    stops it): how far it got, and, with several optimizers, how often each stepped."""
    counts = [min(c) for c in zip(*(r.get("optimizer_steps", [r["steps"]]) for r in records))]
    if len(counts) < 2:
        return f"the {role} script ended by itself after {reached} of the {steps} steps asked for"
    others = ", ".join(f"optimizer {i}: {n}" for i, n in enumerate(counts) if i)
    return (
        f"the {role} script ended by itself after {reached} of the {steps} steps of "
        f"optimizer 0 asked for (the run stops at optimizer 0's step {steps}); meanwhile "
        f"the other optimizers stepped too ({others})"
    )


def replace_result(result: VerifyResult, notes: list[str]) -> VerifyResult:
    """A copy of `result` as it was before judging: its settings, outputs and run notes."""
    return dataclasses.replace(
        result, steps=[], findings=[], inconclusive=[], notes=list(notes), settings=result.settings
    )


def visible_gpus() -> int:
    """NVIDIA GPUs the runs would see, without importing torch (Linux; 0 elsewhere)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def last_error_line(errors: list[dict], output: str) -> str:
    text = errors[0]["error"] if errors and errors[0].get("error") else output
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()
    return lines[-1].strip() if lines else "no output"


def steps_compared(rows: list) -> str:
    """`3 steps`; with several optimizers, `8 optimizer steps (optimizer 0: 2,
    optimizer 1: 6)`: the table counts every optimizer's steps, one by one."""
    counts: dict[int, int] = {}
    for row in rows:
        if row.compared == "gradients":
            counts[row.optimizer] = counts.get(row.optimizer, 0) + 1
    total = sum(counts.values())
    if len(counts) < 2:
        return f"{total} steps"
    each = ", ".join(f"optimizer {i}: {n}" for i, n in sorted(counts.items()))
    return f"{total} optimizer steps ({each})"


def conclude(result: VerifyResult, comparison: Comparison, steps: int) -> VerifyResult:
    result.steps = comparison.rows
    result.findings = comparison.findings + comparison.gradient_findings
    result.inconclusive = comparison.inconclusive
    result.notes = comparison.notes + result.notes
    uncertain = comparison.inconclusive + comparison.caveats
    rtol, atol = comparison.tolerance
    if comparison.findings:
        first = min(comparison.findings, key=lambda f: f.step or 0)
        result.exit_code, result.verdict = EXIT_MISMATCH, "mismatch"
        result.message = f"step {first.step}: {first.what}: {first.message}"
    elif comparison.gradient_findings and not uncertain:
        first = comparison.gradient_findings[0]
        result.exit_code, result.verdict = EXIT_MISMATCH, "mismatch"
        result.message = f"step {first.step}: {first.message}"
    elif comparison.gradient_findings or comparison.inconclusive:
        result.exit_code, result.verdict = EXIT_COULD_NOT_RUN, "inconclusive"
        result.inconclusive = comparison.inconclusive + (
            comparison.caveats if comparison.gradient_findings else []
        )
        what = "the runs differ" if comparison.gradient_findings else "the runs agree"
        result.message = f"{what}, but the comparison cannot be trusted: " + "; ".join(
            reason.split(":")[0] for reason in result.inconclusive
        )
    else:
        result.exit_code, result.verdict = EXIT_MATCH, "match"
        result.message = (
            f"gradients match at all {steps_compared(comparison.rows)} and the weights after "
            f"them (rtol {rtol:g}, atol {atol:g})"
        )
        if comparison.drifted_at is not None:
            optimizer, step = comparison.drifted_at
            result.message = (
                f"gradients match at the {steps_compared(comparison.rows)} compared (rtol "
                f"{rtol:g}, atol "
                f"{atol:g}); from step {step} of optimizer {optimizer} on, the weights differ "
                "by what the optimizer made of rounding, so later gradients are not compared"
            )
        result.notes.extend(comparison.caveats)
    return result
