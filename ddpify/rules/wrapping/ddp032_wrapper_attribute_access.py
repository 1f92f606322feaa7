from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.wrappers import DDP_ATTRIBUTES, Place
from ddpify.diagnostics import FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.wrapping._common import WrapperRule

# Tests under which an attribute read is deliberate: `hasattr(model, "module")` ...
_INTROSPECTION = frozenset({"hasattr", "getattr", "isinstance", "type"})


@dataclass(frozen=True)
class _Access:
    node: cst.Attribute
    place: Place


class WrapperAttributeAccess(WrapperRule):
    """`ddp_model.custom_method()` raises AttributeError: the wrapper only has what
    `nn.Module` and DDP define; the model's own attributes live on `ddp_model.module`."""

    CODE = "DDP032"
    NAME = "wrapper-attribute-access"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "`model.generate` is not an attribute of the DDP wrapper and raises AttributeError; "
        "use `model.module.generate`"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.accesses: list[_Access] = []
        # `ddp_model.x = ...` sets x on the wrapper itself: reading it back is fine.
        self.set_on_wrapper: set[tuple[str, str]] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        attr = node.attr.value
        if attr.startswith("_") or attr in DDP_ATTRIBUTES:
            return
        if dotted(node.value) is None:
            return
        self.accesses.append(_Access(node, self.place()))

    def on_assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if isinstance(target.target, cst.Attribute):
                owner = dotted(target.target.value)
                if owner is not None:
                    self.set_on_wrapper.add((owner, target.target.attr.value))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks():
            return
        for access in self.accesses:
            self._check(access)

    def _check(self, access: _Access) -> None:
        owner = access.node.value
        name = dotted(owner)
        if name is None or (name, access.node.attr.value) in self.set_on_wrapper:
            return
        if self._assigned_to(access) or _introspected(access.place):
            return
        wrap = self.wrappers.wrap_held(owner, access.place)
        if wrap is None or not self.wrappers.held_on_every_path(owner, access.place):
            return
        attr = access.node.attr.value
        unwrapped = access.node.with_changes(
            value=cst.Attribute(value=owner, attr=cst.Name("module"))
        )
        fix = NodeFix(f"Use `{name}.module.{attr}`", ((access.node, unwrapped),))
        message = (
            f"`{name}.{attr}` is not an attribute of the DDP wrapper and raises "
            f"AttributeError; use `{name}.module.{attr}`"
        )
        self.report(access.node, message, fix=fix)

    @staticmethod
    def _assigned_to(access: _Access) -> bool:
        """`ddp.x = v` or `del ddp.x`: writing is legal on any object."""
        parent = access.place.ancestors[-2] if len(access.place.ancestors) > 1 else None
        return isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.Del)) or (
            isinstance(parent, cst.AnnAssign) and parent.target is access.node
        )


def _introspected(place: Place) -> bool:
    """Under a test that looks at what the object is (`if hasattr(model, "module")`), or
    in a `try` that may be catching the AttributeError."""
    for parent, child in zip(place.ancestors, place.ancestors[1:]):
        if isinstance(parent, cst.Try) and child is parent.body:
            return True
        if isinstance(parent, (cst.If, cst.IfExp, cst.While)) and _introspects(parent.test):
            return True
    return False


def _introspects(test: cst.BaseExpression) -> bool:
    stack: list[cst.CSTNode] = [test]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            if node.func.value in _INTROSPECTION:
                return True
        stack.extend(node.children)
    return False
