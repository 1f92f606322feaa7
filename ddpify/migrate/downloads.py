"""Pass, downloads: a dataset that downloads (`download=True`) is fetched by rank 0 first.

`CIFAR10(root, download=True)` on every rank under torchrun makes N processes write the
same archive and extract it into the same folder at once: a corrupted dataset, or a
crash in whichever rank reads a half-written file (DDP027). Here the statement that
builds the dataset runs on rank 0 first while the other ranks wait at a barrier; then
they build it too, and find the files there (torchvision checks them and skips the
download). Consecutive such statements (the training and the test set) share one wait.

Only where every rank reaches the statement at the same point, so the two barriers
meet: after the process group exists (in a function every rank calls, or at module
level after `init_distributed()`), outside loops, `try` and `with` blocks, under no `if`
whose test calls anything, and not in a script that starts its ranks with mp.spawn.
A download left to every rank is reported.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.downloads import download_argument, rank_zero_first
from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan
from ddpify.migrate.edits import Edits
from ddpify.migrate.shared_dirs import after_group_exists, called_on_every_rank, every_rank_reaches

NAME = "downloads"


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if not plan.shape.converts or plan.spawn_function is not None:
        return edits
    runs: list[list[cst.BaseStatement]] = []
    for call in tree.find(cst.Call, lambda c: download_argument(c) is not None):
        ancestors = tree.ancestors(call)
        if rank_zero_scope(ancestors) is not None or rank_zero_first(ancestors):
            continue
        statement = tree.statement(call)
        if runs and statement in runs[-1]:
            continue
        if not _ordered_safely(tree, call, statement):
            if not _called_on_rank_zero_only(tree, tree.function(call)):
                _report(plan, tree, statement)
            continue
        if runs and _follows(tree, runs[-1][-1], statement):
            runs[-1].append(statement)
        else:
            runs.append([statement])
    for statements in runs:
        edits.group(statements, _rank_zero_first(plan))
        plan.needs.add("dist")
        plan.change(
            NAME,
            "the dataset downloads on global rank 0 first, the other ranks wait, then read "
            "its files (every rank downloading into the same folder races)",
            tree.code(statements[0]).strip().splitlines()[0],
            "DDP027",
        )
    return edits


def _ordered_safely(tree: Tree, call: cst.Call, statement: cst.BaseStatement) -> bool:
    """Every rank reaches `statement` once, at the same point, with the group set up."""
    func = tree.function(call)
    if not every_rank_reaches(tree, func, statement):
        return False
    if func is None:
        return after_group_exists(tree, call)
    return called_on_every_rank(tree, func)


def _called_on_rank_zero_only(tree: Tree, func: cst.FunctionDef | None) -> bool:
    """Every call of `func` in the project sits under a rank-0 guard (`if rank == 0:
    fetch(root)`): its download does not race."""
    if func is None:
        return False
    name = func.name.value
    view = tree.view
    calls = view.find(cst.Call, lambda c: (dotted(c.func) or "").rsplit(".", 1)[-1] == name)
    return bool(calls) and all(
        rank_zero_scope(view.owner(call).ancestors(call)) is not None for call in calls
    )


def _follows(tree: Tree, previous: cst.BaseStatement, statement: cst.BaseStatement) -> bool:
    """`statement` comes right after `previous` in the same block."""
    block = tree.block(statement)
    if tree.block(previous) is not block:
        return False
    body = list(block.body)
    return body.index(statement) == body.index(previous) + 1


def _report(plan: Plan, tree: Tree, statement: cst.BaseStatement) -> None:
    plan.needs_human(
        "every rank downloads this dataset into the same folder at once (DDP027); ddpify "
        "did not order it because not every rank reaches it at the same point (a loop, a "
        "condition, or before the process group exists): download on rank 0, then call "
        "dist.barrier() where every rank passes",
        tree.code(statement),
    )


def _rank_zero_first(plan: Plan):
    wait = snippets.statement(
        f"if {plan.rank} != 0:\n"
        f"    {plan.dist}.barrier()  # ddpify: rank 0 downloads first; the others wait for it\n"
    )
    release = snippets.statement(f"if {plan.rank} == 0:\n    {plan.dist}.barrier()\n")

    def build(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        first = members[0]
        moved = wait.with_changes(leading_lines=first.leading_lines)
        return [moved, snippets.bare(first), *members[1:], release]

    return build
