"""Compare what the probe recorded in the original run and in the N converted processes.

Checks, in order, at each optimizer step i (of every optimizer, in the order they stepped):
1. the learning rate the step used (the original's times the migration's LR scale);
2. the data: the N ranks' step-i batches together hold the original's step-i batch
   (sample count, sum and sum of squares of the first tensor of each batch add up);
3. at step 1, the batch size against the batch policy, the initial weights against the
   original's, and every rank's initial weights against rank 0's;
4. every rank's gradients against rank 0's, then rank 0's against the original's;
and after the last step the weights, against the original's and across ranks.

Learning rate, data, batch size, initial weights and rank disagreement are mismatches whatever
else happened. A gradient or final-weight difference is a mismatch unless something recorded
makes the comparison inconclusive (sum-reduced losses, random numbers in the data or the loop
that the probe could not align, data order the probe could not align). What the probe knows
about a difference (BatchNorm with per-rank statistics, clipping of still-scaled gradients)
is named in the finding, so a constant factor is blamed on the number of processes only when
it is that number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ddpify.verify.replay import replay_events, replay_weights

TOLERANCES = {  # (rtol, atol): torch.testing.assert_close's defaults per dtype
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
AMP_TOLERANCES = {"float16": (1e-2, 1e-3), "bfloat16": (5e-2, 1e-2)}
# Under autocast a tensor must also agree as a whole: the norm of the difference within
# this share of the expected tensor's norm. The loose elementwise atol alone passed, on an
# H100, gradients of about 1e-3 that were off by half (a loss divided by the process count).
AMP_NORM_SHARE = 0.1
# ... measured against at least this share of the largest norm among the tensors compared
# together: a gradient that is rounding noise in fp32 (a bias before BatchNorm, a
# zero-initialised bias) is bf16 noise of its own size under autocast.
AMP_NORM_FLOOR = 0.1


class AmpAtol(float):
    """The atol of an autocast comparison, which adds the whole-tensor norm check."""


DATA_RTOL = 1e-6
MAX_DRAWS_COMPARED = 5000  # the probe records at most this many draws
# Draws the probe makes whole in every run (probe.NUMPY_WHOLE_DRAWS): never sliced by rank.
WHOLE_DRAW_KINDS = ("permutation", "shuffle")
# A gradient this small against the step's largest is rounding (a bias before BatchNorm).
ROUNDING_SHARE = 1e-5
# Weights entering a step that differ by more than this share of atol make its gradient
# comparison unlike (Adam amplified rounding earlier); below it, they are rounding themselves.
DRIFT_SHARE = 0.1


@dataclass
class StepRow:
    step: int
    compared: str
    max_abs: float | None
    max_rel: float | None
    worst: str | None
    ok: bool
    optimizer: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Finding:
    step: int | None
    what: str
    parameter: str | None
    message: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Comparison:
    rows: list[StepRow] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    gradient_findings: list[Finding] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)  # known reasons the gradients may differ
    tolerance: tuple[float, float] = (1.3e-6, 1e-5)
    nproc: int = 1
    # (optimizer, step) from which gradients are no longer like with like: the runs' weights
    # drifted apart there, all of it the optimizer's doing on matching gradients (replayed)
    drifted_at: tuple[int, int] | None = None
    # The reasons above (of inconclusive and caveats) that the per-rank reference answers,
    # and what each says differs from the one-process run by design (per_rank.py).
    per_rank: list[str] = field(default_factory=list)
    per_rank_causes: list[str] = field(default_factory=list)
    # A draw the converted run sliced by rank that the original made at one rank's shape (a
    # size that only looked like the per-process batch): running the converted script again,
    # following the original's draws, can align it (runner.Session.follows_original_draws).
    unsliced_in_original: bool = False
    # Every rank loads the whole batch from its loader and keeps its block of it by hand
    # (check_whole_batch_per_rank): the data check compares each rank's batch, not their sum.
    whole_batch_per_rank: bool = False

    def by_design(
        self, reason: str, cause: str, against_reference: bool, doubts: list[str] | None = None
    ) -> None:
        """A difference DDP makes by design, which no single process computes: against the
        one-process run `reason` makes the comparison uncertain (added to `doubts`, the
        inconclusive reasons or the caveats, when given; the per-rank reference answers it);
        against the per-rank reference, which computes it too, `cause` is noted."""
        self.per_rank_causes.append(cause)
        if against_reference:
            self.notes.append(f"by design, as in the per-rank reference: {cause}")
            return
        if doubts is not None:
            doubts.append(reason)
        self.per_rank.append(reason)

    @property
    def answered_per_rank(self) -> bool:
        """Whether every doubt about this comparison is one the per-rank reference answers,
        and nothing is a mismatch whatever else happened (data, learning rate, ranks...)."""
        doubts = self.inconclusive + self.caveats
        return bool(doubts) and not self.findings and all(d in self.per_rank for d in doubts)

    @property
    def differs_in_gradients_only(self) -> bool:
        """A mismatch in gradients or weights alone, with data, learning rates and ranks in
        agreement and nothing else in doubt: DDP of the original may differ from one process
        over the whole batch by more than rounding (statistics summed over processes, means
        over per-process counts verify cannot see), which the per-rank reference tells."""
        doubts = self.inconclusive + self.caveats
        return bool(self.gradient_findings) and not self.findings and not doubts

    @property
    def first_mismatch(self) -> Finding | None:
        ordered = [f for f in self.findings + self.gradient_findings if f.parameter]
        return min(ordered, key=lambda f: f.step or 0, default=None)


@dataclass
class TensorDiff:
    max_abs: float
    max_rel: float
    excess: float  # max |a - b| / (atol + rtol |b|): above 1 fails

    @property
    def ok(self) -> bool:
        return self.excess <= 1.0


def tensor_diff(actual, expected, rtol: float, atol: float, norm_floor: float = 0.0) -> TensorDiff:
    if actual is None or expected is None:
        same = actual is None and expected is None
        return TensorDiff(
            0.0 if same else math.inf, 0.0 if same else math.inf, 0.0 if same else math.inf
        )
    if actual.shape != expected.shape:
        return TensorDiff(math.inf, math.inf, math.inf)
    a, b = actual.double(), expected.double()
    if a.numel() == 0:
        return TensorDiff(0.0, 0.0, 0.0)
    diff = (a - b).abs()
    max_abs = float(diff.max())
    scale = float(b.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    excess = float((diff / (atol + rtol * b.abs())).max())
    if isinstance(atol, AmpAtol):
        norm = max(float(b.norm()), norm_floor)
        share = float(diff.norm()) / norm if norm > 0 else (0.0 if max_abs == 0 else math.inf)
        excess = max(excess, share / AMP_NORM_SHARE)
    return TensorDiff(max_abs, max_rel, excess if not math.isnan(excess) else math.inf)


@dataclass
class ListDiff:
    max_abs: float
    max_rel: float
    worst: str | None
    first_failing: str | None
    failing: int

    @property
    def ok(self) -> bool:
        return self.first_failing is None


def list_diff(names: list[str], actual: list, expected: list, rtol: float, atol: float) -> ListDiff:
    if len(actual) != len(expected):
        return ListDiff(math.inf, math.inf, None, names[0] if names else "?", len(expected))
    floor = 0.0
    if isinstance(atol, AmpAtol):
        norms = [float(e.double().norm()) for e in expected if e is not None and e.numel()]
        floor = AMP_NORM_FLOOR * max(norms, default=0.0)
    diffs = [tensor_diff(a, e, rtol, atol, floor) for a, e in zip(actual, expected)]
    if not diffs:
        return ListDiff(0.0, 0.0, None, None, 0)
    worst = max(range(len(diffs)), key=lambda i: diffs[i].excess)
    failing = [i for i, d in enumerate(diffs) if not d.ok]
    return ListDiff(
        max(d.max_abs for d in diffs),
        max(d.max_rel for d in diffs),
        names[worst],
        names[failing[0]] if failing else None,
        len(failing),
    )


def tolerance_for(original: dict, converted: list[dict], rtol, atol) -> tuple[float, float, str]:
    initial = original["initial"].get(0) or []
    dtype = str(initial[0].dtype).replace("torch.", "") if initial else "float32"
    amp = original["flags"].get("amp") or converted[0]["flags"].get("amp")
    default = AMP_TOLERANCES.get(amp) if amp else None
    default = default or TOLERANCES.get(dtype, TOLERANCES["float32"])
    chosen = (default[0] if rtol is None else rtol, default[1] if atol is None else atol)
    label = f"{'autocast ' + amp if amp else dtype}: rtol {chosen[0]:g}, atol {chosen[1]:g}"
    if amp is not None and atol is None:
        label += f", and each tensor's difference within {AMP_NORM_SHARE:g} of its norm"
        return chosen[0], AmpAtol(chosen[1]), label
    return chosen[0], chosen[1], label


def compare_runs(
    original: dict,
    converted: list[dict],
    nproc: int,
    batch_policy: str,
    rtol: float | None = None,
    atol: float | None = None,
) -> Comparison:
    result = Comparison(nproc=nproc)
    rtol, atol, label = tolerance_for(original, converted, rtol, atol)
    result.tolerance = (rtol, atol)
    result.notes.append(f"tolerance ({label})")
    padded = first_padded_step(converted)
    if padded is not None:
        note_padding(converted, padded, result)
        original, converted = (
            before_step(original, padded),
            [before_step(r, padded) for r in converted],
        )
    read_flags(original, converted, nproc, result)
    ranks = {(s["optimizer"], s["step"]): s for s in original["steps"]}
    converted_steps = [{(s["optimizer"], s["step"]): s for s in r["steps"]} for r in converted]
    keys = [k for k in ranks if all(k in steps for steps in converted_steps)]
    if len(keys) < len(ranks) or any(len(steps) > len(keys) for steps in converted_steps):
        result.notes.append(
            f"compared the {len(keys)} optimizer steps both runs reached "
            f"(original {len(ranks)}, converted {len(converted_steps[0])})"
        )
    check_batch_policy(original, converted, nproc, batch_policy, result)
    for key in keys:
        if result.drifted_at is not None:
            theirs = [steps[key] for steps in converted_steps]
            later_checks(key, ranks[key], theirs, original, converted, rtol, atol, result)
            continue
        step_checks(
            key,
            ranks[key],
            [steps[key] for steps in converted_steps],
            original,
            converted,
            rtol,
            atol,
            result,
        )
    if result.drifted_at is None:
        final_checks(original, converted, keys, rtol, atol, result)
    return result


def later_checks(key, ours, theirs, original, converted, rtol, atol, result) -> None:
    """After the weights drifted apart: what does not depend on them, the learning rate, the
    data and the ranks' agreement with each other."""
    optimizer, step = key
    check_lr(step, ours, theirs[0], result)
    check_data(step, ours, theirs, original, converted, result)
    names = original["names"].get(optimizer) or []
    check_ranks(step, "gradients", names, [s["grads"] for s in theirs], rtol, atol, result)


def first_padded_step(converted: list[dict]) -> int | None:
    """The first step at which a rank trained on samples the DistributedSampler repeated to
    pad the epoch (a dataset not divisible by the number of processes)."""
    steps = [s["step"] for r in converted for s in r["steps"] if s.get("padded")]
    return min(steps, default=None)


def before_step(record: dict, step: int) -> dict:
    """The record as if the run had stopped before `step`: its steps before it, and as final
    weights those the step's gradients were computed at (recorded from step 2 on)."""
    final = {
        s["optimizer"]: s["weights"]
        for s in record["steps"]
        if s["step"] == step and s.get("weights") is not None
    }
    steps = [s for s in record["steps"] if s["step"] < step]
    # A draw records how many steps the first optimizer had taken (the draws of step i's
    # batch come after step i - 1).
    draws = [d for d in record.get("draws", []) if len(d) < 5 or d[4] < step - 1]
    return {**record, "steps": steps, "final": final, "draws": draws}


def note_padding(converted: list[dict], step: int, result: Comparison) -> None:
    size, replicas = next(r["flags"]["padded"] for r in converted if r["flags"].get("padded"))
    repeated = sum(s.get("padded", 0) for r in converted for s in r["steps"] if s["step"] == step)
    reason = (
        f"the DistributedSampler pads the epoch: {size} samples do not divide by {replicas} "
        f"processes, so at step {step} the ranks trained on {repeated} repeated sample(s) the "
        "single process does not see (DDP's design; drop_last=True in the sampler avoids it)"
    )
    if step <= 1:
        result.inconclusive.append(f"nothing to compare: {reason}")
    else:
        result.notes.append(f"compared the steps before step {step} only: {reason}")


def read_flags(original: dict, converted: list[dict], nproc: int, result: Comparison) -> None:
    def any_flag(name: str, records: list[dict]):
        return next((r["flags"][name] for r in records if r["flags"].get(name)), None)

    both = [original, *converted]
    against_reference = original.get("role") == "reference"
    read_batch_norm_flags(any_flag, converted, nproc, result, against_reference)
    read_draws(original, converted, result)
    scaled = original["flags"].get("scaled_setting")
    if scaled and not against_reference:
        result.notes.append(
            f"the one-process original sized its step's tensors by the batch-size setting "
            f"{scaled}, as it would with that batch size set: it takes the N processes' rows"
        )
    clipped = any_flag("clip_scaled", [original])
    if clipped and not any_flag("clip_scaled", converted):
        result.causes.append(
            f"the original calls {clipped} on gradients its GradScaler still scales (no "
            "scaler.unscale_ first, DDP044) and the converted script on unscaled ones"
        )
    shared = any_flag("shared_gpus", converted)
    if shared:
        result.notes.append(
            f"fewer GPUs than processes: the {nproc} ranks share the GPU(s), LOCAL_RANK mapped "
            f"onto them, collectives on gloo over CUDA tensors ({shared}; NCCL refuses two "
            "ranks on one device)"
        )
    loss = any_flag("sum_loss", both)
    if loss:
        result.inconclusive.append(
            f"sum-reduced loss ({loss}, reduction='sum'): DDP averages gradients over processes, "
            "so each step gives 1/N of the original's gradient by design"
        )
    if any_flag("seeded_augmentation", both) and not any_flag("augmentation", both):
        result.notes.append(
            "random augmentation drawn per sample from a seed of its index: aligned (each "
            "`dataset[i]` ran with the generators seeded from the sample's index and the pass "
            "over its loader, whichever process fetched it, and restored afterwards)"
        )
    if any_flag("seeded_stream", both) and not any_flag("augmentation", both):
        result.notes.append(
            "random numbers drawn by a stream the conversion shards round-robin: aligned "
            "(each pass over the stream drew from generators of its own, seeded alike in "
            "both runs; every rank reads the whole stream, so item k drew the same numbers)"
        )
    if any_flag("augmentation", both):
        result.inconclusive.append(
            "the data pipeline draws random numbers (random augmentation?): the N processes "
            "cannot draw the numbers the single process drew"
        )
    if any_flag("loop_rng", both):
        result.inconclusive.append(
            "the training loop draws random numbers between optimizer steps (random batches, "
            "noise, torch.dropout outside nn.functional): they differ between 1 and N processes"
        )
    compared = any_flag("batch_comparison", converted)
    if compared:
        reason = (
            "samples of a batch compared with each other (a contrastive loss?): "
            f"`{compared}` in the conversion; each process compares only its own samples, the "
            "single process all of them, so their gradients differ by design unless the "
            "features are gathered across processes first"
        )
        cause = f"each process compares only its own samples of the batch (`{compared}`)"
        result.by_design(reason, cause, against_reference, result.caveats)
    grouped = any_flag("setting_grouping", converted)
    if grouped:
        reason = (
            "rows of the batch regrouped by a batch-size setting, then compared within each "
            f"group: `{grouped}` in the conversion; the one-process run takes N times the "
            "per-process batch from its loader but keeps that setting, so it groups other "
            "rows than the script does at any batch size"
        )
        cause = (
            f"the loss groups the batch's rows by the configured batch size (`{grouped}`), "
            "and one process given the whole batch keeps that setting at the per-process size"
        )
        result.by_design(reason, cause, against_reference, result.caveats)
    masked = any_flag("masked_mean", both)
    if masked and nproc > 1:
        reason = (
            f"a loss averaged over the targets it does not ignore ({masked}): each process "
            "divides by its own count and DDP averages those means, the single process "
            "divides by the whole batch's count, so the gradients differ by design unless the "
            "loss is summed and divided by the count all-reduced across processes"
        )
        cause = f"each process averages its loss over its own count of targets ({masked})"
        result.by_design(reason, cause, against_reference, result.inconclusive)
    solver = any_flag("adaptive_solver", both)
    if solver and nproc > 1:
        reason = (
            f"an adaptive-step ODE solver ({solver}) chooses its step sizes from an error norm "
            "over the whole batch: each process integrates its shard with steps of its own, so "
            "the runs agree to the solver's tolerance, not to float rounding"
        )
        cause = f"the adaptive ODE solver ({solver}) chooses each process's step sizes itself"
        result.by_design(reason, cause, against_reference, result.inconclusive)
    sampler = any_flag("unaligned_sampler", both)
    if sampler:
        result.inconclusive.append(f"data order could not be aligned: {sampler}")
    fresh = any_flag("fresh_entropy", both)
    if fresh:
        result.notes.append(
            f"{fresh} without a seed takes fresh entropy from the OS, which no two processes "
            "share: the probe seeded each such generator, in the order the script makes them, "
            "the same in both runs"
        )
    dropout = any_flag("dropout_off", both)
    if dropout:
        result.notes.append(
            "alpha dropout (or dropout on an input layout the probe does not know) switched off "
            "in both runs"
        )
    amp = any_flag("amp", both)
    if amp:
        result.notes.append(f"autocast ({amp}) is on: compared at the looser AMP tolerance")
    for index, info in enumerate(original["optimizers"]):
        scale = info.get("lr_scale")
        if scale not in (None, 1.0):
            result.notes.append(
                f"optimizer {index} ({info['class']}): the original's learning rate was "
                f"multiplied by {scale:g} to match the migration's LR scaling"
            )


def read_batch_norm_flags(
    any_flag, converted: list[dict], nproc: int, result, against_reference: bool = False
) -> None:
    if nproc < 2:
        return
    synced = any_flag("sync_bn", converted)
    if synced == "emulated":
        result.notes.append(
            "BatchNorm statistics all-reduced across the processes by the probe (SyncBatchNorm's "
            "math, gradients included): the converted script converts to SyncBatchNorm on CUDA "
            "only, and this run is on CPU"
        )
    elif synced:
        result.notes.append(
            "SyncBatchNorm computed by the probe (the same math, batch statistics all-reduced "
            "with autograd), in both runs the same Python implementation"
        )
    if any_flag("local_bn", converted):
        # Per-process statistics are a legitimate DDP set-up (DDP030 is info level; SyncBatchNorm
        # cannot run on CPU at all), but no single-process run computes them: inconclusive, not
        # a pass and not a mismatch (anchors: verify's reliability gate). The per-rank
        # reference, which keeps each process's statistics too, answers it.
        reason = (
            "BatchNorm without SyncBatchNorm: each process normalises with the statistics of "
            "its own part of the batch, the single process with those of the whole batch, so "
            "their gradients cannot be compared (convert with "
            "nn.SyncBatchNorm.convert_sync_batchnorm before the DDP wrap, on CUDA, DDP030)"
        )
        cause = "BatchNorm statistics are per process"
        result.by_design(reason, cause, against_reference, result.inconclusive)


def read_draws(original: dict, converted: list[dict], result: Comparison) -> None:
    """The original must have drawn, in order, the whole draws the ranks sliced theirs from."""
    ours, theirs = original.get("draws", []), converted[0].get("draws", [])
    followed = converted[0]["flags"].get("followed_draws")
    if followed:
        result.notes.append(
            f"{followed} random draw(s) whose size does not follow the per-process batch (a "
            "dimension that only equalled it) made whole on every process, as the original "
            "drew them: the converted script ran again following the original's draws"
        )
    sliced = sum(1 for draw in theirs if draw[2] is not None)
    resized = any(list(mine[1]) != list(their[1]) for mine, their in zip(ours, theirs))
    permuted = sum(1 for draw in theirs if draw[0] in WHOLE_DRAW_KINDS)
    if not sliced and not resized and not permuted:
        return
    states = [r.get("draws", []) for r in converted]
    for index, (mine, their) in enumerate(zip(ours, theirs)):
        if list(mine[1]) == list(their[1]) and any(
            index < len(rank) and rank[index][3] != mine[3] for rank in states
        ):
            result.inconclusive.append(
                f"random draws could not be aligned: at draw {index + 1} ({their[0]}) the "
                "converted run's random generator is not in the original's state (seeded "
                "differently, per rank?), so its noise and dropout masks are other numbers"
            )
            return
        if list(mine[1]) != list(their[1]):
            reason = (
                f"random draws could not be aligned: draw {index + 1} ({their[0]}) was "
                f"{tuple(their[1])} in the converted run (sliced along dim {their[2]}), "
                f"{tuple(mine[1])} in the original"
            )
            result.inconclusive.append(reason)
            if their[2] is not None and len(their) > 5 and list(mine[1]) == list(their[5]):
                result.unsliced_in_original = True
            if their[2] is None and original.get("role") != "reference":
                # Not a batch-shaped draw the probe could make whole: its size follows the
                # per-process batch some other way (antithetic timesteps, n // 2 + 1).
                cause = (
                    f"random draw {index + 1} ({their[0]}) is sized by the per-process batch: "
                    f"{tuple(their[1])} on each process, {tuple(mine[1])} in one"
                )
                result.by_design(reason, cause, False)
            return
    if len(ours) != len(theirs) and min(len(ours), len(theirs)) < MAX_DRAWS_COMPARED:
        result.inconclusive.append(
            f"random draws could not be aligned: the original made {len(ours)}, the converted "
            f"run {len(theirs)}"
        )
        return
    if sliced:
        result.notes.append(
            f"{sliced} random draw(s) in the training loop (noise, dropout masks) given to each "
            "process as its slice of the single process's draw"
        )
    if permuted:
        result.notes.append(
            f"{permuted} numpy permutation(s) or shuffle(s) made whole on every process from "
            "the generator state the original made them from (checked at each draw)"
        )


def training_loader(record: dict) -> dict | None:
    for step in record["steps"]:
        if step.get("loader") is not None:
            return record["loaders"][step["loader"]]
    return None


def check_batch_policy(original, converted: list[dict], nproc, batch_policy, result) -> None:
    ours, theirs = training_loader(original), training_loader(converted[0])
    if ours is not None and theirs is not None and check_hand_split(converted, result):
        check_whole_batch_per_rank(ours, theirs, nproc, result)
        return
    if ours is None or theirs is None:
        if not check_hand_split(converted, result):
            result.caveats.append(
                "no DataLoader feeds the training loop: the batches are compared as the scripts "
                "make them, and the batch size is not adjusted"
            )
        return
    native, per_process = ours["batch_size"], theirs["batch_size"]
    if native is None or per_process is None:
        result.caveats.append("a custom batch_sampler sets the batch size: not adjusted")
        return
    policy = ours.get("policy") or batch_policy
    result.notes.append(
        f"batch policy {policy}: original batch {native} run at {ours['used_batch_size']}, "
        f"{per_process} per process x {nproc} processes"
    )
    expected = native if policy == "per-rank" else native // nproc
    if (
        ours.get("policy") is None
        or per_process != expected
        or per_process * nproc != ours["used_batch_size"]
    ):
        result.findings.append(
            Finding(
                1,
                "batch size",
                None,
                f"the converted script uses batch {per_process} per process; the {policy} "
                f"policy expects {expected} (original batch {native}, {nproc} processes)",
            )
        )


def check_whole_batch_per_rank(ours: dict, theirs: dict, nproc: int, result) -> None:
    """A loader's batch split by hand (every rank loads the whole batch, then keeps its
    block): each rank's loader batch must be the one the original trains on, so the data
    check compares every rank's batch with the original's, not their sum."""
    result.whole_batch_per_rank = True
    native, per_process = ours["used_batch_size"], theirs["batch_size"]
    result.notes.append(
        f"batch policy global (split by hand): original batch {native}, every one of the "
        f"{nproc} processes loads {per_process} and keeps its block"
    )
    if per_process != native:
        result.findings.append(
            Finding(
                1,
                "batch size",
                None,
                f"the converted script loads batch {per_process} on each process and splits "
                f"it by rank, but the original trains on batch {native}",
            )
        )


def check_hand_split(converted: list[dict], result: Comparison) -> bool:
    """Whether every rank split its hand-made batch where the migration split it (the probe
    saw `x[RANK * len(x) // WORLD_SIZE : ...]` before every step of the first optimizer), and
    all ranks split the same batch at each step. Then the global batch is the one the script
    makes, the original runs it unchanged and the batches need no caveat; ranks that split
    different batches (a stream seeded per rank) are a data mismatch."""
    splits = [[s for s in r["steps"] if s.get("split")] for r in converted]
    wanted = max(sum(1 for s in r["steps"] if s["optimizer"] == 0) for r in converted)
    if not wanted or any(len(rank) < wanted for rank in splits):
        return False
    for index, step in enumerate(splits[0]):
        data = step["split"]["data"]
        if any(not same_data(rank[index]["split"]["data"], data) for rank in splits[1:]):
            result.findings.append(
                Finding(
                    step["step"],
                    "data",
                    None,
                    f"at step {step['step']} the ranks split different batches (each rank its "
                    "block of a batch of its own: the batches are made with a seed per rank?), "
                    "so together they did not train on one batch",
                )
            )
            return True
    result.notes.append(
        "hand-made batches split by rank where `ddpify migrate` split them: at every step "
        "each process took its block of the same batch, and the original trained on that "
        "whole batch as its script makes it"
    )
    return True


def same_data(mine: list[float], theirs: list[float]) -> bool:
    """Whether two (count, sum, sum of squares) summaries describe the same batch."""
    scale = DATA_RTOL * (abs(mine[2]) + 1.0)
    return mine[0] == theirs[0] and all(abs(a - b) <= scale for a, b in zip(mine[1:], theirs[1:]))


def step_checks(key, ours, theirs, original, converted, rtol, atol, result) -> None:
    optimizer, step = key
    names = original["names"].get(optimizer) or []
    check_lr(step, ours, theirs[0], result)
    check_data(step, ours, theirs, original, converted, result)
    if step == 1:
        initial = original["initial"][optimizer]
        ranks_initial = [r["initial"][optimizer] for r in converted]
        diff = list_diff(names, ranks_initial[0], initial, rtol, atol)
        result.rows.append(row(step, "initial weights", diff, optimizer))
        if not diff.ok:
            result.findings.append(
                Finding(
                    step,
                    "initial weights",
                    diff.first_failing,
                    f"the converted script starts from other weights than the original "
                    f"({diff.failing} parameter(s) differ, first {diff.first_failing})",
                )
            )
        check_ranks(step, "initial weights", names, ranks_initial, rtol, atol, result)
    grads = [s["grads"] for s in theirs]
    check_ranks(step, "gradients", names, grads, rtol, atol, result)
    diff = list_diff(names, grads[0], ours["grads"], rtol, atol)
    result.rows.append(row(step, "gradients", diff, optimizer))
    if not diff.ok:
        message = (
            f"gradients differ from the original's ({diff.failing} parameter(s), "
            f"first {diff.first_failing}, max abs {diff.max_abs:.3g})"
        )
        message += explain(constant_factor(grads[0], ours["grads"]), result)
        drift = entering_drift(optimizer, step, ours, theirs[0], original, converted[0])
        clean = not result.gradient_findings and not result.findings
        if drift > DRIFT_SHARE * atol and clean:
            if drift_explained(key, original, converted[0], rtol, atol):
                result.rows.pop()  # this step's gradients are not like with like
                note_drift(key, drift, original, result)
                return
            result.caveats.append(
                f"the gradients of step {step} were computed at weights that already differ by "
                f"up to {drift:.3g}: every earlier step's gradients matched, and an adaptive "
                "optimizer turns their rounding differences into weight differences, which the "
                "model then turns into gradient differences; not like with like"
            )
        result.gradient_findings.append(Finding(step, "gradients", diff.first_failing, message))


def drift_explained(key, original: dict, converted: dict, rtol, atol) -> bool:
    """Whether the weights each run computed step `key`'s gradients at are what its optimizers
    made of its own recorded gradients (which matched at every earlier step): replaying every
    step before `key`, in the order the run took them, reproduces them in both runs, and the
    optimizers' settings (learning rates aside, checked at every step) are the same."""
    if not same_optimizer_settings(original, converted):
        return False
    for run in (original, converted):
        order = [(s["optimizer"], s["step"]) for s in run["steps"]]
        if key not in order:
            return False
        events = order[: order.index(key)]
        replayed = replay_events(run, events)
        entering = entering_weights(run, key)
        ids = run.get("param_ids", {}).get(key[0]) or []
        if replayed is None or entering is None or len(ids) != len(entering):
            return False
        if any(tensor not in replayed for tensor in ids):
            return False
        ours = [replayed[tensor] for tensor in ids]
        if not list_diff([""] * len(ids), entering, ours, rtol, atol).ok:
            return False
    return True


def entering_weights(run: dict, key) -> list | None:
    optimizer, step = key
    if step == 1:
        return run["initial"].get(optimizer)
    found = next((s for s in run["steps"] if (s["optimizer"], s["step"]) == key), None)
    return found.get("weights") if found else None


def same_optimizer_settings(original: dict, converted: dict) -> bool:
    """The optimizers' classes and group settings agree, learning rates left out."""

    def settings(run):
        return [
            (
                info.get("class"),
                [
                    {k: v for k, v in g.items() if k not in ("lr", "initial_lr")}
                    for g in info.get("groups") or []
                ],
            )
            for info in run["optimizers"]
        ]

    return settings(original) == settings(converted)


def note_drift(key, drift: float, original: dict, result: Comparison) -> None:
    optimizer, step = key
    result.drifted_at = key
    classes = sorted({info["class"] for info in original["optimizers"]})
    which = f" of optimizer {optimizer}" if len(original["optimizers"]) > 1 else ""
    result.notes.append(
        f"compared the gradients up to step {step}{which} only: there the runs' weights "
        f"already differ by up to {drift:.3g}, all of it what the optimizer "
        f"({', '.join(classes)}) made of gradients that matched at every earlier step "
        "(replaying each run's optimizer steps on its own gradients reproduces its weights); "
        "later gradients are computed at other weights, so they are not compared, nor the "
        "final weights; the learning rate, the data and the agreement between the ranks "
        "were checked at every step"
    )


def entering_drift(optimizer, step, ours, theirs, original, converted) -> float:
    """How far apart the weights were when this step's gradients were computed."""
    if step == 1:
        mine, yours = original["initial"].get(optimizer), converted["initial"].get(optimizer)
    else:
        mine, yours = ours.get("weights"), theirs.get("weights")
    if not mine or not yours or len(mine) != len(yours):
        return 0.0
    return max(
        (
            float((a.double() - b.double()).abs().max())
            for a, b in zip(mine, yours)
            if a is not None and b is not None and a.shape == b.shape and a.numel()
        ),
        default=0.0,
    )


def row(step: int, compared: str, diff: ListDiff, optimizer: int) -> StepRow:
    return StepRow(step, compared, diff.max_abs, diff.max_rel, diff.worst, diff.ok, optimizer)


def check_lr(step: int, ours: dict, theirs: dict, result: Comparison) -> None:
    expected, actual = ours["lrs"], theirs["lrs"]
    if len(expected) == len(actual) and all(
        abs(a - e) <= 1e-9 * max(1.0, abs(e)) for a, e in zip(actual, expected)
    ):
        return
    native = ours["native_lrs"]
    ratio = actual[0] / native[0] if native and native[0] else float("nan")
    result.findings.append(
        Finding(
            step,
            "learning rate",
            None,
            f"the converted script steps with lr {fmt_list(actual)}, the original with "
            f"{fmt_list(native)} (x{ratio:.4g}); no LR scaling of the batch policy explains "
            "it: pass --lr-scale if it is deliberate",
        )
    )


def check_data(step, ours, theirs, original, converted, result) -> None:
    if ours.get("data") is None or any(s.get("data") is None for s in theirs):
        return
    if any(r["flags"].get("augmentation") for r in [original, *converted]):
        return
    mine = ours["data"]
    if result.whole_batch_per_rank:
        check_whole_batch_data(step, mine, theirs, result)
        return
    total = [sum(s["data"][i] for s in theirs) for i in range(3)]
    scale = DATA_RTOL * (abs(mine[2]) + 1.0)
    if (
        mine[0] == total[0]
        and abs(mine[1] - total[1]) <= scale
        and abs(mine[2] - total[2]) <= scale
    ):
        return
    message = f"the {len(theirs)} processes together did not see the original's batch ("
    if mine[0] == total[0]:
        message += f"{int(mine[0])} samples, but not the same ones)"
    else:
        message += f"{int(total[0])} samples against {int(mine[0])})"
    if len(theirs) > 1 and all(s["data"] == theirs[0]["data"] for s in theirs[1:]):
        message += "; every process saw the same batch (no DistributedSampler?)"
    elif step > 1 and not any(f.what == "data" for f in result.findings):
        message += "; the earlier steps agreed (DistributedSampler.set_epoch missing?)"
    result.findings.append(Finding(step, "data", None, message))


def check_whole_batch_data(step, mine: list[float], theirs: list[dict], result) -> None:
    """Every rank loaded the whole batch it splits by hand: each must be the original's."""
    if all(same_data(s["data"], mine) for s in theirs):
        return
    result.findings.append(
        Finding(
            step,
            "data",
            None,
            f"at step {step} the processes did not load the original's batch before keeping "
            "their blocks of it (the loader draws other samples than the original's)",
        )
    )


def check_ranks(step, what, names, per_rank: list[list], rtol, atol, result) -> None:
    for rank in range(1, len(per_rank)):
        diff = list_diff(names, per_rank[rank], per_rank[0], rtol, atol)
        if not diff.ok:
            result.findings.append(
                Finding(
                    step,
                    "ranks",
                    diff.first_failing,
                    f"{what} of rank {rank} differ from rank 0's ({diff.failing} "
                    f"parameter(s), first {diff.first_failing}): the processes are not "
                    "training one model (no DDP broadcast or gradient all-reduce?)",
                )
            )
            return


def final_checks(original, converted, keys, rtol, atol, result) -> None:
    if not keys or not all(r["final"] for r in (original, *converted)):
        return
    last = max(step for _, step in keys)
    for optimizer, params in original["final"].items():
        if any(optimizer not in r["final"] for r in converted):
            continue
        names = original["names"].get(optimizer) or []
        finals = [r["final"][optimizer] for r in converted]
        check_ranks(last, f"weights after step {last}", names, finals, rtol, atol, result)
        flat = zero_gradient_parameters(original, optimizer, atol)
        if flat:
            result.notes.append(
                f"weights of {', '.join(names[i] for i in flat[:4])}"
                f"{' ...' if len(flat) > 4 else ''} not compared after the last step: their "
                "gradients are zero up to rounding (a bias before BatchNorm?), and an adaptive "
                "optimizer such as Adam turns rounding into full-size steps"
            )
            finals = [[None if i in flat else t for i, t in enumerate(f)] for f in finals]
            params = [None if i in flat else t for i, t in enumerate(params)]
        diff = list_diff(names, finals[0], params, rtol, atol)
        gradients_ok = not any(f.what == "gradients" for f in result.gradient_findings)
        if (
            not diff.ok
            and gradients_ok
            and replay_explains(original, converted[0], optimizer, keys, rtol, atol)
        ):
            result.notes.append(
                f"weights after step {last} (optimizer {optimizer}) differ by up to "
                f"{diff.max_abs:.3g} ({diff.worst}), all of it explained by the gradient "
                "differences, which are within tolerance at every step: replaying the optimizer "
                f"({original['optimizers'][optimizer]['class']}) on each run's own gradients "
                "reproduces both runs' weights (an adaptive optimizer turns gradient rounding "
                "near its eps into steps of up to the learning rate)"
            )
            diff = replace(diff, first_failing=None, failing=0)
        result.rows.append(row(last, f"weights after step {last}", diff, optimizer))
        if not diff.ok:
            result.gradient_findings.append(
                Finding(
                    last,
                    "weights",
                    diff.first_failing,
                    f"weights after step {last} differ ({diff.failing} parameter(s), first "
                    f"{diff.first_failing})",
                )
            )


def replay_explains(original, converted, optimizer, keys, rtol, atol) -> bool:
    """Whether replaying the optimizer on each run's recorded gradients reproduces that run's
    weights: then the optimizer did the same in both, and the weights differ only by what the
    gradient differences (already compared step by step) make of them."""
    steps = [step for opt, step in keys if opt == optimizer]
    if any(
        any(s["optimizer"] == optimizer and s["step"] not in steps for s in r["steps"])
        for r in (original, converted)
    ):
        return False  # a run took a step the other did not: nothing to explain it with
    for run in (original, converted):
        replayed = replay_weights(run, optimizer, steps)
        if replayed is None:
            return False
        final = run["final"][optimizer]
        if not list_diff([""] * len(final), final, replayed, rtol, atol).ok:
            return False
    return True


def explain(factor: float | None, result: Comparison) -> str:
    """What is known about a gradient difference; the process count only when it fits."""
    parts = [f"; {cause}" for cause in result.causes]
    if factor is not None:
        text = f"; they are {factor:.4g}x the original's"
        n = result.nproc
        if n > 1 and any(abs(factor - c) < 1e-3 * c for c in (n, 1 / n, math.sqrt(n), n**-0.5)):
            text += " (a loss or gradient scaled by the number of processes?)"
        parts.append(text)
    return "".join(parts)


def zero_gradient_parameters(original: dict, optimizer: int, atol: float) -> list[int]:
    """Indices of the parameters whose gradients are zero up to rounding at every step: within
    atol, and below ROUNDING_SHARE of the step's largest gradient."""
    steps = [s["grads"] for s in original["steps"] if s["optimizer"] == optimizer]
    if not steps:
        return []
    flat = []
    for index in range(len(steps[0])):
        noise = [is_rounding_noise(step, index, atol) for step in steps if index < len(step)]
        if all(noise) and any(step[index] is not None for step in steps):
            flat.append(index)
    return flat


def is_rounding_noise(grads: list, index: int, atol: float) -> bool:
    def largest(g) -> float:
        return float(g.abs().max()) if g is not None and g.numel() else 0.0

    mine = largest(grads[index])
    return mine <= atol and mine <= ROUNDING_SHARE * max(largest(g) for g in grads)


def constant_factor(actual: list, expected: list) -> float | None:
    """c when the converted gradients are c times the original's, c clearly not 1."""
    import torch

    pairs = [(a, e) for a, e in zip(actual, expected) if a is not None and e is not None]
    if not pairs or any(a.shape != e.shape for a, e in pairs):
        return None
    a = torch.cat([a.double().flatten() for a, _ in pairs])
    e = torch.cat([e.double().flatten() for _, e in pairs])
    norm = float(e.dot(e))
    if norm == 0:
        return None
    factor = float(a.dot(e)) / norm
    if abs(factor - 1) < 1e-3 or float((a - factor * e).norm()) > 1e-4 * float(a.norm()):
        return None
    return factor


def fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)
