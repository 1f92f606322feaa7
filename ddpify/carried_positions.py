"""Positions carried from one lint of a document to the next (the language server).

After an edit, ddpify/reparse.py reuses the top-level statements the edit did not touch:
the very same node objects. A top-level statement renders to the same code wherever it
sits (it starts at column 0, and the re-parser keeps the module's indentation and newline
or parses the document whole, which makes every statement new), so a node inside it is
as many rows below the statement's first row as it was before, at the same column. Only
the statement's first row can move: it is looked up in the new text, and the positions
of the last round are shifted by it, instead of rendering the statement again.

A statement the edit touched is located as `Positions` does, except that the rows CPython
gives its statements come from parsing that top-level statement's code alone, not the
whole document again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import libcst as cst
from libcst.metadata import CodePosition, CodeRange

from ddpify.positions import Positions, ast_statement_rows, statement_order

# A top-level statement -> its nodes' positions, rows counted from the statement's first
# row (0 for the row where its leading comments and blank lines start).
Relative = dict[cst.CSTNode, dict[cst.CSTNode, CodeRange]]


class CarriedPositions(Positions):
    """`Positions` that answer from the last round for nodes of reused statements, and
    record what they compute for the next round."""

    def __init__(
        self,
        module: cst.Module,
        text: str,
        parents: Mapping[cst.CSTNode, cst.CSTNode],
        first_rows: Mapping[cst.CSTNode, int],
        carried: Relative,
        code_of: Callable[[cst.CSTNode], str],
    ) -> None:
        super().__init__(module, text, parents)
        self.first_rows = first_rows  # each top-level statement of `module` -> first row
        self.carried = carried  # the last round's, for statements still in the module
        self.code_of = code_of  # a top-level statement's code
        self.recorded: Relative = {}
        # Top-level statement -> (its statements in source order, CPython's row of each).
        self._rows_in: dict[cst.CSTNode, tuple[dict[cst.CSTNode, int], list[int] | None]] = {}

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        top = self._top_level(node)
        if top is None:
            return super().__getitem__(node)
        row = self.first_rows[top]
        relative = self.carried.get(top, {}).get(node)
        if relative is None:
            found = super().__getitem__(node)
            relative = _shifted(found, -row)
        else:
            found = _shifted(relative, row)
        self.recorded.setdefault(top, {})[node] = relative
        return found

    def _statement_row(self, statement: cst.BaseStatement) -> int | None:
        top = self._top_level(statement)
        if top is None:
            return super()._statement_row(statement)
        if top not in self._rows_in:
            order = statement_order(cst.Module(body=[top]))  # type: ignore[list-item]
            rows = ast_statement_rows(self.code_of(top))
            if rows is not None and len(rows) == len(order):
                rows = [row + self.first_rows[top] - 1 for row in rows]
            else:
                rows = None
            self._rows_in[top] = (order, rows)
        order, rows = self._rows_in[top]
        first = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else statement
        index = order.get(first)
        if rows is None or index is None:
            return super()._statement_row(statement)
        return rows[index]

    def _top_level(self, node: cst.CSTNode) -> cst.CSTNode | None:
        """The top-level statement holding `node` (or `node` itself), if the walk saw it."""
        while True:
            parent = self.parents.get(node)
            if parent is None:
                return None
            if parent is self.module:
                return node if node in self.first_rows else None
            node = parent


def _shifted(span: CodeRange, rows: int) -> CodeRange:
    return CodeRange(
        CodePosition(span.start.line + rows, span.start.column),
        CodePosition(span.end.line + rows, span.end.column),
    )
