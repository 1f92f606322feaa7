"""The per-rank reference's verdict: the conversion against the original run as its own DDP.

When the comparison with the one-process original is inconclusive only because DDP computes,
by design, what no single process computes (Comparison.answered_per_rank: BatchNorm with each
process's statistics, a loss comparing the rows of a batch, an adaptive ODE solver, a draw
sized by the per-process batch), the runner runs the original again under torchrun on the
same N processes, with DDP's semantics applied by the probe (probe_reference.py), and
compares the conversion with that: its N records read as one (merged_reference), plus a
check that each rank got the same share as the conversion's rank (check_shares).

A match is a match against that reference, and the result says so (`reference: per-rank`);
a difference is a mismatch (the conversion does not compute DDP of the original); an
inconclusive comparison with the reference leaves the one-process result as it was.
"""

from __future__ import annotations

from ddpify.verify.compare import Comparison, Finding, same_data

PER_RANK = "per-rank"
ONE_PROCESS = "one-process"
WHAT = "the original run as DDP (each process its share of the batch, gradients averaged)"


def merged_reference(records: list[dict]) -> dict:
    """The reference's N records as the one record compare reads for the original: rank 0's
    (after the averaging, every process holds the same gradients and weights), each step's
    data summed over the processes (the global batch, summed in rank order as compare sums
    the conversion's), and the flags any process raised."""
    shares = [{(s["optimizer"], s["step"]): s for s in r["steps"]} for r in records]
    steps = []
    for step in records[0]["steps"]:
        key = (step["optimizer"], step["step"])
        data = [share[key].get("data") if key in share else None for share in shares]
        summed = None if None in data else [sum(column) for column in zip(*data)]
        steps.append({**step, "data": summed})
    flags: dict = {}
    for record in records:
        for name, value in record["flags"].items():
            flags.setdefault(name, value)
    return {**records[0], "role": "reference", "steps": steps, "flags": flags}


def check_shares(references: list[dict], converted: list[dict], result: Comparison) -> None:
    """Each converted rank trained on the samples the reference's same rank did (the sums of
    all ranks compare.check_data checks already), and the reference started as DDP does."""
    if any(r["flags"].get("reference_weights") is not None for r in references):
        result.inconclusive.append(
            "the per-rank reference's processes built different initial weights from one seed "
            "(randomness the probe does not seed alike?), so it did not start as DDP starts"
        )
    elif any(r["flags"].get("reference_weights_checked") for r in references):
        result.notes.append(
            "the per-rank reference's processes built the same initial weights (checked "
            "against rank 0's at the first gradient averaging)"
        )
    if any(r["flags"].get("scaled_setting") for r in references):
        result.notes.append(
            "the per-rank reference sized its step's tensors by the per-process batch (the "
            "batch-size setting // N), as the conversion does: the original sizes them by the "
            "setting, which the global batch policy deals out over the processes"
        )
    if any(r["flags"].get("sync_bn") for r in references):
        result.notes.append(
            "the per-rank reference summed BatchNorm statistics over its processes "
            "(SyncBatchNorm's math), as the converted run did"
        )
    for rank, (mine, theirs) in enumerate(zip(references, converted)):
        ours = {(s["optimizer"], s["step"]): s.get("data") for s in mine["steps"]}
        for step in theirs["steps"]:
            expected = ours.get((step["optimizer"], step["step"]))
            if expected is None or step.get("data") is None:
                continue
            if not same_data(expected, step["data"]):
                result.findings.append(
                    Finding(
                        step["step"],
                        "data",
                        None,
                        f"rank {rank} trained on other samples than the reference's rank "
                        f"{rank} (its share of the batch under a DistributedSampler)",
                    )
                )
                return


def reference_message(verdict: str, message: str, causes: list[str]) -> str:
    """The verdict's message, saying what it was compared with and why."""
    if verdict == "mismatch":
        return f"against {WHAT}: {message} (the conversion does not compute DDP of the original)"
    return (
        f"against {WHAT}: {message}; it differs from the one-process run by design: "
        + "; ".join(dict.fromkeys(causes))
    )
