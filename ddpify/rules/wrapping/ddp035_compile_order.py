from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.wrappers import Place, Wrap, sibling_after
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.wrapping._common import WrapperRule

COMPILE = "torch.compile"


class CompileOrder(WrapperRule):
    """`torch.compile(DDP(model))` compiles the wrapper; the documentation says to compile
    the inner module and wrap the compiled one."""

    CODE = "DDP035"
    NAME = "compile-order"
    SEVERITY = Severity.INFO
    MESSAGE = "`torch.compile` is applied to the DDP wrapper; compile the inner model, then wrap it"
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        # (the compile call, what it compiles, where)
        self.compiles: list[tuple[cst.Call, cst.BaseExpression, Place]] = []

    def visit_Call(self, node: cst.Call) -> None:
        if self.wrappers.callee == COMPILE:
            arg = find_arg(node, "model", 0)
            if arg is not None:
                self.compiles.append((node, arg.value, self.place()))
        elif method_name(node) == "compile" and dotted(node.func.value) is not None:  # type: ignore[attr-defined]
            self.compiles.append((node, node.func.value, self.place()))  # type: ignore[attr-defined]

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks():
            return
        for call, compiled, place in self.compiles:
            wrap = self.wrappers.wrap_in(compiled) or self.wrappers.wrap_held(compiled, place)
            if wrap is None:
                continue
            shown = self.shown(compiled)
            inner = f" (`{wrap.inner}`)" if wrap.inner else ""
            message = (
                f"`{self.shown(call.func)}` compiles the DDP wrapper `{shown}`; the PyTorch "
                "documentation advises compiling the inner model"
                f"{inner} and wrapping the compiled model, as torch.compile does not handle "
                "the wrapper well"
            )
            self.report(call, message, fix=self._reorder(call, compiled, wrap, place))

    # -- fix -----------------------------------------------------------------------------

    def _reorder(
        self, call: cst.Call, compiled: cst.BaseExpression, wrap: Wrap, place: Place
    ) -> NodeFix | None:
        if self.context.qualify(call.func) != COMPILE:
            return None  # `ddp.compile()` compiles in place: no expression to move
        if compiled is wrap.call:
            return self._nest_inside(call, wrap)
        return self._swap_statements(call, compiled, wrap, place)

    def _nest_inside(self, call: cst.Call, wrap: Wrap) -> NodeFix | None:
        """`torch.compile(DDP(m, ...), **o)` -> `DDP(torch.compile(m, **o), ...)`."""
        module = find_arg(wrap.call, "module", 0)
        if module is None or len(call.args) < 1:
            return None
        compiled_module = call.with_changes(
            args=[call.args[0].with_changes(value=module.value), *call.args[1:]]
        )
        args = [
            arg.with_changes(value=compiled_module) if arg is module else arg
            for arg in wrap.call.args
        ]
        return NodeFix(
            "Compile the inner model, then wrap it",
            ((call, wrap.call.with_changes(args=args)),),
            Applicability.UNSAFE,
        )

    def _swap_statements(
        self, call: cst.Call, compiled: cst.BaseExpression, wrap: Wrap, place: Place
    ) -> NodeFix | None:
        """`model = DDP(model, ...)` directly followed by `model = torch.compile(model)`:
        the same name throughout, so swapping the two lines reorders nothing else."""
        name = dotted(compiled)
        if name is None or not (wrap.target == wrap.inner == name):
            return None
        first = _assignment_line(wrap.place, wrap.call, name)
        second = _assignment_line(place, call, name)
        if first is None or second is None:
            return None
        block = wrap.place.ancestors[wrap.place.ancestors.index(first) - 1]
        if sibling_after(first, block) is not second:
            return None
        return NodeFix(
            "Compile the inner model, then wrap it",
            ((first, second), (second, first)),
            Applicability.UNSAFE,
        )


def _assignment_line(place: Place, call: cst.Call, name: str) -> cst.CSTNode | None:
    """The line `name = call` holding `place`, if that is all the line does."""
    line = place.statement
    if type(line) is not cst.SimpleStatementLine or len(line.body) != 1:
        return None
    small = line.body[0]
    if type(small) is not cst.Assign or small.value is not call or len(small.targets) != 1:
        return None
    return line if dotted(small.targets[0].target) == name else None
