"""Planned edits, keyed by the original nodes a pass found, applied in one transform.

Statement insertions, removals and groupings happen at the block level, so a block's
original and updated bodies always line up one to one while the transform runs.
Replacements may be callables that receive the updated node, so an edit to a child made
by the same plan survives an edit to its parent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Callable, Union

import libcst as cst

from ddpify.libcst_speed import field_names

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

    def apply(self, module: cst.Module, parents: Mapping | None = None) -> cst.Module:
        """The edited module. With the tree's `parents` (syntax node -> parent), only the
        paths from the module down to the edited nodes are visited and rebuilt: the rest
        of the tree is reused as it is, so a pass costs what it edits, not the file."""
        if not self:
            return module
        if parents is None:
            return module.visit(_Apply(self, None))
        return _Apply(self, self._dirty(parents)).rebuilt(module)

    def _dirty(self, parents: Mapping) -> set[cst.CSTNode]:
        """Every edited node, the block around each statement edited at block level, and
        all their ancestors."""
        statements = [*self.before, *self.after, *self.removed, *self.groups]
        seeds = [*self.replacements, *self.prepend, *(parents.get(s) for s in statements)]
        dirty: set[cst.CSTNode] = set()
        for node in seeds:
            while node is not None and node not in dirty:
                dirty.add(node)
                node = parents.get(node)
        return dirty


class _Apply(cst.CSTTransformer):
    def __init__(self, edits: Edits, dirty: set | None) -> None:
        super().__init__()
        self.edits = edits
        self.dirty = dirty

    def rebuilt(self, node: cst.CSTNode) -> cst.CSTNode:
        """`node.visit(self)` for a node on a path to an edit, entering only the children
        on such a path (libcst's visit enters, rebuilds and leaves every child of a node
        it enters: the statements of a whole block for one edit in it)."""
        dirty = self.dirty
        assert dirty is not None
        changes = {}
        for name in field_names(type(node)):
            value = getattr(node, name)
            if type(value) in (list, tuple):
                if any(item in dirty for item in value):
                    changes[name] = [self.rebuilt(i) if i in dirty else i for i in value]
            elif value in dirty:
                changes[name] = self.rebuilt(value)
        return self.on_leave(node, node.with_changes(**changes) if changes else node)

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        edits = self.edits
        if isinstance(updated_node, (cst.IndentedBlock, cst.Module)):
            body, orphans = self._body(original_node, updated_node)
            updated_node = updated_node.with_changes(
                body=body, footer=[*orphans, *updated_node.footer]
            )
        if original_node in edits.prepend and isinstance(
            getattr(updated_node, "body", None), cst.IndentedBlock
        ):
            block = updated_node.body
            body = [*edits.prepend[original_node], *block.body]
            updated_node = updated_node.with_changes(body=block.with_changes(body=body))
        replacement = edits.replacements.get(original_node)
        if replacement is not None:
            new = replacement(updated_node) if callable(replacement) else replacement
            updated_node = _with_comments_of(updated_node, new)
        return updated_node

    def _body(self, original, updated) -> tuple[list[cst.BaseStatement], list[cst.EmptyLine]]:
        """The block's statements, and the comments of removed statements left at its end."""
        out, orphans = _keep_removed_comments(self._statements(original, updated))
        if not out and isinstance(original, cst.IndentedBlock):
            out.append(cst.SimpleStatementLine([cst.Pass()]))
        return out, orphans

    def _statements(self, original, updated) -> list[cst.BaseStatement]:
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
            out.append(_Removed(old) if old in edits.removed else new)
            out.extend(edits.after.get(old, ()))
            index += 1
        return out


class _Removed:
    """A placeholder for a removed statement, until its comments find a new home."""

    def __init__(self, statement: cst.BaseStatement) -> None:
        self.statement = statement


def _keep_removed_comments(out: list) -> tuple[list[cst.BaseStatement], list[cst.EmptyLine]]:
    """Drop the removed statements but keep their comments: the lines above them and a
    trailing `# note` move onto the next statement, or to the block's end."""
    kept: list[cst.BaseStatement] = []
    pending: list[cst.EmptyLine] = []
    for item in out:
        if isinstance(item, _Removed):
            pending.extend(_comment_lines(item.statement))
        elif pending:
            kept.append(item.with_changes(leading_lines=[*pending, *item.leading_lines]))
            pending = []
        else:
            kept.append(item)
    return kept, pending


def _with_comments_of(old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    """A statement rebuilt from scratch keeps the comments above and after the old one
    (those the new statement does not already carry, e.g. by wrapping the old one)."""
    if not (isinstance(old, cst.BaseStatement) and isinstance(new, cst.BaseStatement)):
        return new
    lost = _comment_lines(old)
    if not lost:
        return new
    rendered = _EMPTY_MODULE.code_for_node(new)
    lost = [line for line in lost if line.comment.value not in rendered]
    if not lost:
        return new
    trailing = getattr(old, "trailing_whitespace", None)
    if (
        isinstance(new, cst.SimpleStatementLine)
        and new.trailing_whitespace.comment is None
        and trailing is not None
        and trailing.comment is not None
        and trailing.comment.value not in rendered
    ):
        new = new.with_changes(trailing_whitespace=trailing)
        lost = [line for line in lost if line.comment.value != trailing.comment.value]
    return new.with_changes(leading_lines=[*lost, *new.leading_lines])


_EMPTY_MODULE = cst.Module([])


def _comment_lines(statement: cst.BaseStatement) -> list[cst.EmptyLine]:
    lines = [line for line in statement.leading_lines if line.comment is not None]
    trailing = getattr(statement, "trailing_whitespace", None)
    if trailing is not None and trailing.comment is not None:
        lines.append(cst.EmptyLine(comment=trailing.comment))
    return lines
