"""Replicated steps: a training step that keeps its batch whole runs whole on every rank.

A full-batch step, a step on one example, and a bptt step that carries its state cannot
be split by rank so that the ranks together compute the original's step
(analysis/unsplittable.py says which, and proves the step draws from no loader). Every
rank then computes the whole step: DDP averages N equal gradients, the optimizer takes
the original's step, and the learning rate stays. There is no speed-up, and the report
says so at the top, with the line to change to share the work.

The result is the original's when every rank draws the same random numbers (dropout):
the script seeds torch alike on every rank; where it does not, the report says so.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.batches import batch_assignments
from ddpify.analysis.names import dotted
from ddpify.analysis.roles import model_names, replicated_steps
from ddpify.analysis.seeding import ALIKE, CONDITIONAL, torch_seeding
from ddpify.analysis.unsplittable import (
    CARRIED_STATE,
    FULL_BATCH,
    ONE_EXAMPLE,
    UnsplittableStep,
    set_orders,
)
from ddpify.migrate import snippets
from ddpify.migrate.edits import Edits

NAME = "data"
NOTE = (
    "# ddpify: replicated step ({kind}): every rank computes this whole step, "
    "as one process would; no speed-up (see the report)"
)
POLICY = (
    "replicated: every rank computes the whole training step ({kinds}); DDP averages N "
    "equal gradients, so each step is the original's, the global batch and the learning "
    "rate are the original's, and there is no speed-up, provided every rank builds the "
    "same data (Python orders a set of strings by a hash seed of its own in each process: "
    "`PYTHONHASHSEED=0 torchrun ...` pins it) and draws the same random numbers; {seeded}"
)


def project_replicates(tree) -> bool:
    """Whether any module of the project replicates a step (then, as for split hand-made
    batches, the learning rate stays the original's in every module)."""
    return any(replicated_steps(t) for t in tree.trees)


def replicate(tree, plan, edits: Edits) -> bool:
    """Mark each replicated loop with a comment, record it, and name in the report the
    line to change to share the work."""
    steps = replicated_steps(tree)
    for step in steps:
        note = NOTE.format(kind=step.kind)
        edits.replace(step.loop, lambda updated, note=note: snippets.with_comment(updated, note))
        header = tree.code(step.loop)
        plan.change(NAME, f"training step replicated on every rank ({step.kind})", header)
        line, advice = _speed_up(tree, step)
        plan.needs_human(advice, line)
    if steps:
        kinds = ", ".join(dict.fromkeys(step.kind for step in steps))
        plan.replicated = POLICY.format(kinds=kinds, seeded=_seeding(tree))
    if steps or project_replicates(tree):
        _note_set_orders(tree, plan)
    return bool(steps)


def _note_set_orders(tree, plan) -> None:
    """Replicated ranks must build the same data: a set of strings numbered in its
    iteration order (class names to indices) is numbered apart by processes whose hash
    seeds differ, as torchrun's do unless PYTHONHASHSEED is set."""
    for call in set_orders(tree):
        plan.needs_human(
            f"`{tree.code(call)}` is used in its iteration order, which for strings differs "
            "from process to process (hash randomisation): the replicated ranks may number "
            "the items (class labels) differently and train on different data; sort it "
            f"(`sorted({tree.code(call)})`) or run torchrun with PYTHONHASHSEED=0 set",
            tree.code(tree.statement(call)),
        )


def _seeding(tree) -> str:
    seeding = torch_seeding(tree.view)
    if seeding.kind == ALIKE:
        call = tree.view.code(seeding.call)
        return f"exact because `{call}` seeds torch alike on every rank (same dropout draws)"
    if seeding.kind == CONDITIONAL:
        return (
            f"the script seeds torch only when `{seeding.condition}` holds: otherwise, should "
            "the step draw random numbers (dropout), each rank would draw its own and the "
            "average would not be the original's step; seed torch alike on every rank to keep "
            "it exact"
        )
    return (
        "the script does not seed torch: should the step draw random numbers (dropout), each "
        "rank would draw its own and the average would not be the original's step; seed "
        "torch alike on every rank (`torch.manual_seed(0)`) to keep it exact"
    )


def _speed_up(tree, step: UnsplittableStep) -> tuple[str, str]:
    """The line to change to share the work, and how."""
    if step.kind == FULL_BATCH:
        line = tree.view.code(step.statement)
        return line, (
            f"replicated full-batch step: the model reads only `{step.detail}`, built before "
            "the loop, so every rank computes the whole step (no speed-up); splitting only "
            "the samples the loss selects would not share the work, the forward still runs "
            "over everything; to share it, give each rank its share of the samples this "
            "forward reads (`X[RANK::WORLD_SIZE]`, when the samples are independent: not a "
            "graph whose nodes mix) and weight each rank's mean loss by len(share) * "
            "WORLD_SIZE / len(X), which keeps the original's global mean even when len(X) "
            "does not divide by WORLD_SIZE and the shares differ by one (a plain mean would "
            "then weight the smaller shares' samples more)"
        )
    if step.kind == ONE_EXAMPLE:
        line = tree.view.code(step.statement)
        return line, (
            f"replicated step on one example (`{step.detail}`): a batch of one cannot be "
            "split, so every rank computes the whole step (no speed-up); to share the work, "
            "batch the examples (a DataLoader with a batch size and a DistributedSampler), "
            "which changes the optimisation (several examples per step)"
        )
    assert step.kind == CARRIED_STATE
    built = _data_built(tree, step) or step.statement
    line = tree.view.code(built)
    return line, (
        f"replicated bptt step: `{step.detail}` is carried from step to step and sized by "
        "the rows of the batch, so every rank computes the whole step (no speed-up); to "
        "share the work, give each rank its own rows where the data is built here "
        "(rows RANK * n // WORLD_SIZE to (RANK + 1) * n // WORLD_SIZE) and size the state "
        "by the rank's rows; the mean loss stays the original's only when the rows divide "
        "by WORLD_SIZE"
    )


def _data_built(tree, step: UnsplittableStep) -> cst.CSTNode | None:
    """Where the tensor the batch is sliced from is made, outside the loop in the loop's
    module (`ids = corpus.get_data(path, batch_size)`), when it is bound once there."""
    for batch in batch_assignments(step.loop, model_names(tree)):
        name = _sliced(batch.value)
        assigns = [
            assign
            for assign in tree.find(cst.Assign)
            if any(dotted(t.target) == name for t in assign.targets)
            and not tree.inside(assign, step.loop)
        ]
        if name is not None and len(assigns) == 1:
            return tree.statement(assigns[0])
    return None


def _sliced(value: cst.BaseExpression) -> str | None:
    """`ids` in `ids[:, i:i + n].to(device)`: the tensor a batch is sliced from."""
    while True:
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            value = value.func.value
        elif isinstance(value, (cst.Subscript, cst.Attribute)):
            value = value.value
        else:
            return value.value if isinstance(value, cst.Name) else None
