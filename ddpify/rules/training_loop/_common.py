"""Facts the training-loop rules share: is the script distributed, statement insertion."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import libcst as cst

from ddpify.analysis.training import loop_facts_for
from ddpify.rules.base import Rule
from ddpify.walk import children

if TYPE_CHECKING:
    pass


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
    if type(block) not in (cst.IndentedBlock, cst.Module):
        return None
    body = list(block.body)
    position = body.index(statement)
    moved = new.with_changes(leading_lines=statement.leading_lines)
    body[position : position + 1] = [moved, statement.with_changes(leading_lines=())]
    return block, block.with_changes(body=body)


class LoopRule(Rule):
    """A rule reading the file's shared LoopFacts. Every such rule feeds loops and
    functions; each rule feeds the other nodes it needs itself (exits, backward calls,
    `no_sync` mentions), so the engine calls as few handlers as possible. Feeding a node
    twice is a no-op."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.loops = loop_facts_for(context)

    def _feed(self, node: cst.CSTNode) -> None:
        self.loops.visit(node, self.context.ancestors)

    def visit_For(self, node: cst.For) -> None:
        self._feed(node)

    def visit_While(self, node: cst.While) -> None:
        self._feed(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._feed(node)

    def applies(self) -> bool:
        """A distributed script that runs its own loop (not Accelerate, DeepSpeed...)."""
        model = self.context.model
        return model.framework is None and model.is_distributed
