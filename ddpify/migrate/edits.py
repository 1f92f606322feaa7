"""Planned edits, keyed by the original nodes a pass found, applied in one transform.

Statement insertions, removals and groupings happen at the block level, so a block's
original and updated bodies always line up one to one while the transform runs.
Replacements may be callables that receive the updated node, so an edit to a child made
by the same plan survives an edit to its parent.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Union

import libcst as cst

Replacement = Union[cst.CSTNode, Callable[[cst.CSTNode], cst.CSTNode]]
Builder = Callable[[list[cst.BaseStatement]], list[cst.BaseStatement]]


class Edits:
    def __init__(self) -> None:
        self.replacements: dict[cst.CSTNode, Replacement] = {}
        self.before: dict[cst.CSTNode, list[cst.BaseStatement]] = defaultdict(list)
        self.after: dict[cst.CSTNode, list[cst.BaseStatement]] = defaultdict(list)
        self.prepend: dict[cst.CSTNode, list[cst.BaseStatement]] = defaultdict(list)
        self.removed: set[cst.CSTNode] = set()
        # first statement of a run -> (the run, a builder turning its updated form into statements)
        self.groups: dict[cst.CSTNode, tuple[list[cst.BaseStatement], Builder]] = {}

    def replace(self, node: cst.CSTNode, new: Replacement) -> None:
        previous = self.replacements.get(node)
        if previous is not None and callable(new):
            # Chain: the later edit sees the result of the earlier one.
            first = previous
            self.replacements[node] = lambda updated: new(
                first(updated) if callable(first) else first
            )
        else:
            self.replacements[node] = new

    def group(self, statements: list[cst.BaseStatement], builder: Builder) -> None:
        self.groups[statements[0]] = (statements, builder)

    def __bool__(self) -> bool:
        return bool(
            self.replacements
            or self.before
            or self.after
            or self.prepend
            or self.removed
            or self.groups
        )

    def apply(self, module: cst.Module) -> cst.Module:
        if not self:
            return module
        return module.visit(_Apply(self))


class _Apply(cst.CSTTransformer):
    def __init__(self, edits: Edits) -> None:
        super().__init__()
        self.edits = edits

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        edits = self.edits
        if isinstance(updated_node, (cst.IndentedBlock, cst.Module)):
            updated_node = updated_node.with_changes(body=self._body(original_node, updated_node))
        if original_node in edits.prepend and isinstance(
            getattr(updated_node, "body", None), cst.IndentedBlock
        ):
            block = updated_node.body
            body = [*edits.prepend[original_node], *block.body]
            updated_node = updated_node.with_changes(body=block.with_changes(body=body))
        replacement = edits.replacements.get(original_node)
        if replacement is not None:
            updated_node = replacement(updated_node) if callable(replacement) else replacement
        return updated_node

    def _body(self, original, updated) -> list[cst.BaseStatement]:
        edits = self.edits
        out: list[cst.BaseStatement] = []
        pairs = list(zip(original.body, updated.body))
        index = 0
        while index < len(pairs):
            old, new = pairs[index]
            out.extend(edits.before.get(old, ()))
            if old in edits.groups:
                run, builder = edits.groups[old]
                members = [pair[1] for pair in pairs[index : index + len(run)]]
                out.extend(builder(members))
                out.extend(edits.after.get(pairs[index + len(run) - 1][0], ()))
                index += len(run)
                continue
            if old not in edits.removed:
                out.append(new)
            out.extend(edits.after.get(old, ()))
            index += 1
        if not out and isinstance(original, cst.IndentedBlock):
            out.append(cst.SimpleStatementLine([cst.Pass()]))
        return out
