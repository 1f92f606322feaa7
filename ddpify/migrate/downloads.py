"""Pass, downloads: a dataset that downloads (`download=True`) is fetched by rank 0 first.

`CIFAR10(root, download=True)` on every rank under torchrun makes N processes write the
same archive and extract it into the same folder at once: a corrupted dataset, or a
crash in whichever rank reads a half-written file (DDP027). Here the statement that
builds the dataset runs on rank 0 first while the other ranks wait at a barrier; then
they build it too, and find the files there (torchvision checks them and skips the
download). Consecutive such statements (the training and the test set) share one wait.

Only where every rank reaches the statement at the same point, so the two barriers
meet: after the process group exists (in a function every rank calls, or at module
level after `init_distributed()`), outside loops, `with` blocks and a `try` that handles
errors, under no `if` whose test reads more than the run's settings (a test of the
disk would differ once rank 0 has downloaded), and not in a script that starts its
ranks with mp.spawn.
A download left to every rank is reported.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.downloads import (
    download_argument,
    rank_zero_first,
    runs_rank_zero_first_by_callers,
)
from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan
from ddpify.migrate.edits import Edits
from ddpify.migrate.shared_dirs import after_group_exists, called_on_every_rank, every_rank_reaches

NAME = "downloads"
RESULT = "downloaded_dataset"  # holds a returned dataset until the others are released
# Calls a test may make and still read the same on every rank (the run's settings).
PURE_BUILTINS = frozenset({"len", "isinstance", "str", "int", "float", "bool", "hasattr"})
STRING_METHODS = frozenset({"startswith", "endswith", "lower", "upper", "strip", "isdigit"})


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
        if not _ordered_safely(tree, call, statement) or _leaves_inside(tree, statement):
            if not _called_on_rank_zero_only(tree, tree.function(call)):
                _report(plan, tree, statement)
            continue
        if runs and _follows(tree, runs[-1][-1], statement) and not _returns(runs[-1][-1]):
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
            _first_code_line(tree, statements[0]),
            "DDP027",
        )
    return edits


def _first_code_line(tree: Tree, statement: cst.BaseStatement) -> str:
    """The statement's first line of code (not the comments above it)."""
    lines = tree.code(statement).strip().splitlines()
    return next((line for line in lines if not line.lstrip().startswith("#")), lines[0])


def _returns(statement: cst.BaseStatement) -> cst.Return | None:
    """The `return <value>` that `statement` is, if it is one."""
    small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
    return small if isinstance(small, cst.Return) and small.value is not None else None


def _leaves_inside(tree: Tree, statement: cst.BaseStatement) -> bool:
    """`statement` may leave before its end (a return, raise or yield other than a plain
    `return <value>`, which the wait rewrites): the release after it would never run."""
    if _returns(statement):
        return False
    leaving = (cst.Return, cst.Raise, cst.Yield)
    return isinstance(statement, leaving) or any(True for _ in tree.within(statement, leaving))


def _ordered_safely(tree: Tree, call: cst.Call, statement: cst.BaseStatement) -> bool:
    """Every rank reaches `statement` once, at the same point, with the group set up."""
    func = tree.function(call)
    if not every_rank_reaches(tree, func, statement, _same_on_every_rank):
        return False
    if func is None:
        return after_group_exists(tree, call)
    return called_on_every_rank(tree, func)


def _same_on_every_rank(tree: Tree, test: cst.BaseExpression) -> bool:
    """A test that reads only the run's settings (`args.dataset.startswith("cifar")`,
    `len(classes) > 10`): no call that reads the disk, the clock or a random draw."""
    calls = [test] if isinstance(test, cst.Call) else []  # `within` gives what is inside
    return all(map(_reads_settings_only, [*calls, *tree.within(test, cst.Call)]))


def _reads_settings_only(call: cst.Call) -> bool:
    if isinstance(call.func, cst.Name):
        return call.func.value in PURE_BUILTINS
    return isinstance(call.func, cst.Attribute) and call.func.attr.value in STRING_METHODS


def _called_on_rank_zero_only(tree: Tree, func: cst.FunctionDef | None) -> bool:
    """Every call of `func` in the project sits under a rank-0 guard (`if rank == 0:
    fetch(root)`): its download does not race."""
    if func is None:
        return False
    if runs_rank_zero_first_by_callers(tree, func):
        return True  # a dataset's own download: its construction runs on rank 0 first
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
        returned = _returns(members[-1])
        if returned is None:
            return [moved, snippets.bare(first), *members[1:], release]
        # `return CIFAR10(root, download=True)`: built, released, then returned.
        built = cst.SimpleStatementLine(
            [cst.Assign([cst.AssignTarget(cst.Name(RESULT))], returned.value)]
        )
        kept = [*members[:-1], built]
        back = snippets.statement(f"return {RESULT}")
        return [moved, snippets.bare(kept[0]), *kept[1:], release, back]

    return build
