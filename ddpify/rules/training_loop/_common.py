"""Facts the training-loop rules share: is the script distributed, statement insertion."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import libcst as cst

from ddpify.walk import children

if TYPE_CHECKING:
    from ddpify.engine import Context

# Calls that only a multi-process script makes.
DISTRIBUTED_CALLS = (
    "torch.distributed.init_process_group",
    "torch.distributed.device_mesh.init_device_mesh",
    "torch.distributed.get_world_size",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.utils.data.DistributedSampler",
    "torch.multiprocessing.spawn",
)
# What torchrun and torch.distributed.launch export to every worker.
LAUNCHER_ENV = {"LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}


def parents_and_children(root: cst.CSTNode) -> Iterator[tuple[cst.CSTNode, cst.CSTNode]]:
    """Every (parent, child) pair below `root`, parents before their children.

    Uses the engine's read-only walk order: no formatting nodes, no libcst rebuild.
    """
    stack = [root]
    while stack:
        parent = stack.pop()
        below = list(children(parent))
        for child in below:
            yield parent, child
        stack.extend(reversed(below))


def descendants(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    return (child for _, child in parents_and_children(root))


def is_distributed(context: Context) -> bool:
    """Whether the script runs as several processes (call only from `leave_Module`).

    The environment scan walks the tree again, so callers ask only once they have
    something to report.
    """
    if context.model.calls_any(*DISTRIBUTED_CALLS):
        return True
    return any(
        isinstance(node, cst.SimpleString) and node.evaluated_value in LAUNCHER_ENV
        for node in descendants(context.module)
    )


def insert_before(
    ancestors: Sequence[cst.CSTNode],
    statement: cst.BaseStatement,
    new: cst.SimpleStatementLine,
) -> tuple[cst.CSTNode, cst.CSTNode] | None:
    """A (old, new) replacement that puts `new` just above `statement`.

    `ancestors` runs from the module down to (at least) `statement`; the replacement is
    the enclosing block. Comments above `statement` move above `new`, so they still head
    the lines they described.
    """
    index = list(ancestors).index(statement)
    block = ancestors[index - 1]
    if not isinstance(block, (cst.IndentedBlock, cst.Module)):
        return None
    body = list(block.body)
    position = body.index(statement)
    moved = new.with_changes(leading_lines=statement.leading_lines)
    body[position : position + 1] = [moved, statement.with_changes(leading_lines=())]
    return block, block.with_changes(body=body)
