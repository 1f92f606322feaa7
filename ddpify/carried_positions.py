"""Positions carried from one lint of a document to the next (the language server).

After an edit, ddpify/reparse.py reuses the top-level statements the edit did not touch:
the very same node objects. A top-level statement renders to the same code wherever it
sits (it starts at column 0, and the re-parser keeps the module's indentation and newline
or parses the document whole, which makes every statement new), so a node inside it is
as many rows below the statement's first row as it was before, at the same column. Only
the statement's first row can move: it is looked up in the new text, and the positions
of the last round are shifted by it, instead of rendering the statement again.
"""

from __future__ import annotations

from collections.abc import Mapping

import libcst as cst
from libcst.metadata import CodePosition, CodeRange

from ddpify.positions import Positions

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
    ) -> None:
        super().__init__(module, text, parents)
        self.first_rows = first_rows  # each top-level statement of `module` -> first row
        self.carried = carried  # the last round's, for statements still in the module
        self.recorded: Relative = {}

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

    def _top_level(self, node: cst.CSTNode) -> cst.CSTNode | None:
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
