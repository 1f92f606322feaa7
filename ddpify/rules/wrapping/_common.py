"""What the wrapping rules share: the file's wrapper facts, fed from their handlers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from ddpify.analysis.wrappers import Place, WrapperFacts
from ddpify.rules.devices._common import DistributedRule

if TYPE_CHECKING:
    from ddpify.engine import Context


class WrapperRule(DistributedRule):
    """A rule that asks where the DDP wrapper is; it records candidates with their
    place while visiting and decides in `leave_Module`, when every wrap is known. The
    engine feeds the file's one `WrapperFacts` before any rule sees a node."""

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.wrappers: WrapperFacts = context.wrappers

    def place(self) -> Place:
        """The node being visited, as a place the facts can compare."""
        return Place(tuple(self.context.ancestors), self.wrappers.seq)

    def speaks(self) -> bool:
        """Plain DDP code that wraps a model in this file."""
        return bool(self.wrappers.wraps) and self.is_distributed()

    def shown(self, node: cst.CSTNode, limit: int = 60) -> str:
        code = self.context.code(node)
        return code if len(code) <= limit and "\n" not in code else "the model"
