"""The rule base class: a small visitor that reports nodes.

A rule declares its CODE, NAME (the bad pattern, ruff-style), SEVERITY and MESSAGE,
and whether and how safely it can fix. It defines `visit_<Node>` / `leave_<Node>`
methods; the engine calls them all from one batched traversal, after the script model
has seen the node. `self.context` gives the import map, the script model and the
ancestors of the node being visited.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import libcst as cst

from ddpify.diagnostics import Applicability, FixAvailability, Severity

if TYPE_CHECKING:
    from ddpify.engine import Context


_HANDLERS: dict[tuple[type, str], dict[str, str]] = {}


@dataclass(frozen=True)
class NodeFix:
    """Replace nodes of the parsed tree; the engine turns this into text edits."""

    message: str
    replacements: tuple[tuple[cst.CSTNode, cst.CSTNode], ...]
    applicability: Applicability = Applicability.SAFE


@dataclass(frozen=True)
class Report:
    rule: Rule
    node: cst.CSTNode
    message: str
    severity: Severity
    fix: NodeFix | None


class Rule:
    CODE: ClassVar[str]
    NAME: ClassVar[str]
    SEVERITY: ClassVar[Severity]
    MESSAGE: ClassVar[str]
    FIX: ClassVar[FixAvailability] = FixAvailability.NEVER
    # Rules whose evidence is too weak to enable without opting in.
    DEFAULT_ENABLED: ClassVar[bool] = True

    def __init__(self, context: Context) -> None:
        self.context = context
        self.reports: list[Report] = []

    def report(
        self,
        node: cst.CSTNode,
        message: str | None = None,
        *,
        severity: Severity | None = None,
        fix: NodeFix | None = None,
    ) -> None:
        self.reports.append(
            Report(self, node, message or self.MESSAGE, severity or self.SEVERITY, fix)
        )

    @classmethod
    def handlers(cls, prefix: str) -> dict[str, str]:
        """Node type name -> method name, for every `visit_X` (or `leave_X`) defined.
        Computed once per class: `dir()` is slow and the engine asks for every file."""
        key = (cls, prefix)
        found = _HANDLERS.get(key)
        if found is None:
            found = _HANDLERS[key] = {
                attr[len(prefix) :]: attr
                for attr in dir(cls)
                if attr.startswith(prefix) and callable(getattr(cls, attr))
            }
        return found

    def bound_handlers(self, prefix: str) -> dict[str, Callable[[cst.CSTNode], None]]:
        return {node: getattr(self, attr) for node, attr in self.handlers(prefix).items()}
