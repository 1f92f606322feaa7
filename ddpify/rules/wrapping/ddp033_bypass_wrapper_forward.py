from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.roles import wrapper_receivers
from ddpify.analysis.wrappers import (
    Place,
    Wrap,
    innermost,
    may_follow,
    runs_model_outside_forward,
)
from ddpify.diagnostics import FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.wrapping._common import WrapperRule

# Contexts in which no gradient is recorded: a forward there is evaluation.
NO_GRAD = frozenset(
    {
        "torch.no_grad",
        "torch.inference_mode",
        "torch.autograd.no_grad",
        "torch.autograd.grad_mode.no_grad",
        "torch.autograd.inference_mode",
        "torch.set_grad_enabled",
    }
)
# Functions whose name says they evaluate or sample rather than train.
_EVAL_FUNCTION = re.compile(r"(eval|valid|test|infer|predict|generate|sample|visuali|plot|log)")


def _is_module_forward(func: cst.BaseExpression) -> bool:
    """`x.module.forward`, with a name or attribute chain for `x`."""
    return (
        type(func) is cst.Attribute
        and func.attr.value == "forward"
        and type(func.value) is cst.Attribute
        and func.value.attr.value == "module"
        and dotted(func.value.value) is not None
    )


def _is_module_method(func: cst.BaseExpression) -> bool:
    """`x.module.encode`: a method or submodule of the wrapped model, not `forward`."""
    return (
        type(func) is cst.Attribute
        and func.attr.value != "forward"
        and type(func.value) is cst.Attribute
        and func.value.attr.value == "module"
        and dotted(func.value.value) is not None
    )


def _called_model(func: cst.BaseExpression) -> str | None:
    """The model a call runs: `model` for `model(x)` and `model.forward(x)`."""
    if type(func) is cst.Attribute and func.attr.value == "forward":
        func = func.value
    return dotted(func)


@dataclass(frozen=True)
class _Forward:
    call: cst.Call
    place: Place
    receiver: cst.BaseExpression | None  # `model` of `model.module(x)` / `model.forward(x)`


class BypassWrapperForward(WrapperRule):
    """`model.module(x)` or `model.module.forward(x)` in a training step skips DDP's
    forward, so the backward never all-reduces the gradients and the replicas drift apart.
    So does calling the raw model after it was wrapped (`model(x)` or `model.forward(x)`
    beside `ddp = DDP(model)`). `ddp.forward(x)` is fine: DDP's work is in `forward`."""

    CODE = "DDP033"
    NAME = "bypass-wrapper-forward"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "`model.module(x)` bypasses the DDP wrapper, so the backward that follows does not "
        "average the gradients across ranks; call `model(x)`"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.forwards: list[_Forward] = []
        self.methods: list[_Forward] = []
        self.receivers: dict[str, set[str]] | None = None  # asked once, if ever
        self.backwards: list[Place] = []

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if method_name(node) == "backward":
            self.backwards.append(self.place())
        elif type(func) is cst.Attribute and func.attr.value == "module":
            if dotted(func.value) is not None:
                self.forwards.append(_Forward(node, self.place(), func.value))
        elif _is_module_method(func):
            # `ddp.module.encode(x)`: reported only where the step never calls `ddp(...)`.
            self.methods.append(_Forward(node, self.place(), func.value.value))
        elif _is_module_forward(func):
            # `ddp.module.forward(x)`. Not `ddp.forward(x)`: DDP's own `forward` prepares
            # the all-reduce (only `__call__`'s hooks are skipped), so it trains correctly.
            self.forwards.append(_Forward(node, self.place(), func.value.value))
        elif any(wrap.inner == _called_model(func) for wrap in self.wrappers.wraps):
            # Only a name wrapped earlier can be the raw model called after its wrap.
            self.forwards.append(_Forward(node, self.place(), None))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks() or not self.backwards:
            return
        for forward in self.forwards:
            wrap = self._bypassed_wrap(forward)
            if wrap is None or not self._in_training_step(forward):
                continue
            self._report(forward, wrap)
        for method in self.methods:
            self._report_method(method)

    def _report_method(self, method: _Forward) -> None:
        """`model.module.encode(x)` in a step that trains without ever calling `model(...)`."""
        wrapper = dotted(method.receiver)  # type: ignore[arg-type]
        if wrapper is None or not self._holds_wrapper(method, wrapper):
            return
        if rank_zero_scope(method.place.ancestors) is not None:
            return
        if not runs_model_outside_forward(self.context.tree, method.call, wrapper):
            return
        self.report(
            method.call,
            f"`{self.shown(method.call.func)}(...)` runs part of the model outside DDP's "
            f"forward in a training step that never calls `{wrapper}(...)`, so the backward "
            "does not average the gradients across ranks and the replicas drift apart; "
            f"route it through `{wrapper}(...)` (a forward that takes a mode argument)",
        )

    def _holds_wrapper(self, method: _Forward, wrapper: str) -> bool:
        """`wrapper` holds a DDP wrapper where `method` runs: bound to one in its scope, or a
        parameter of a function some call of this file hands one."""
        if self.wrappers.wrap_held(method.receiver, method.place) is not None:
            return True
        tree = self.context.tree
        function = tree.function(method.call)
        if function is None:
            return False
        if self.receivers is None:
            self.receivers = wrapper_receivers(tree, self.wrappers.wrapped_names())
        return wrapper in self.receivers.get(function.name.value, ())

    def _bypassed_wrap(self, forward: _Forward) -> Wrap | None:
        if forward.receiver is not None:
            return self.wrappers.wrap_held(forward.receiver, forward.place)
        # `ddp = DDP(model)` ... `model(x)`: the raw model, called after it was wrapped.
        name = _called_model(forward.call.func)
        if name is None:
            return None
        for wrap in self.wrappers.wraps:
            if wrap.inner != name or wrap.target in {None, name}:
                continue
            if not may_follow(wrap.place, forward.place):
                continue
            binding = self.wrappers.binding_of(name, forward.place)
            if binding is not None and binding.place.seq > wrap.place.seq:
                continue  # rebound after the wrap
            return wrap
        return None

    def _in_training_step(self, forward: _Forward) -> bool:
        """Gradients are recorded there, rank 0 is not alone there (DDP053's case), and a
        backward follows in the same loop (or the same loop-free function)."""
        ancestors = forward.place.ancestors
        if rank_zero_scope(ancestors) is not None or self._no_grad(ancestors):
            return False
        function = innermost(ancestors, cst.FunctionDef)
        if function is not None and _EVAL_FUNCTION.search(function.name.value.lower()):
            return False
        loop = innermost(ancestors, cst.For, cst.While)
        # `model.module(x).sum().backward()`: one statement, the backward runs last.
        return any(
            innermost(backward.ancestors, cst.For, cst.While) is loop
            and (
                may_follow(forward.place, backward) or backward.statement is forward.place.statement
            )
            for backward in self.backwards
        )

    def _no_grad(self, ancestors) -> bool:
        for node in ancestors:
            if type(node) is cst.With:
                for item in node.items:
                    call = item.item
                    func = call.func if type(call) is cst.Call else call
                    if self.context.qualify(func) in NO_GRAD:  # type: ignore[arg-type]
                        return True
            elif type(node) is cst.FunctionDef:
                for decorator in node.decorators:
                    expr = decorator.decorator
                    func = expr.func if type(expr) is cst.Call else expr
                    if self.context.qualify(func) in NO_GRAD:
                        return True
        return False

    def _report(self, forward: _Forward, wrap: Wrap) -> None:
        call = forward.call
        shown = self.shown(call.func)
        if forward.receiver is not None:
            wrapper: cst.BaseExpression = forward.receiver
            how = f"bypasses the DDP wrapper `{self.shown(wrapper)}`"
        else:
            wrapper = cst.parse_expression(wrap.target)  # type: ignore[arg-type]
            how = f"calls the model that `{wrap.target}` wraps, bypassing DDP"
        target = dotted(wrapper) or ""
        message = (
            f"`{shown}(...)` {how}, so the backward that follows does not average the "
            f"gradients across ranks and the replicas drift apart; call `{target}(...)`"
        )
        fix = None
        if self.wrappers.held_on_every_path(wrapper, forward.place) and (
            self.wrappers.wrap_held(wrapper, forward.place) is wrap
        ):
            fix = NodeFix(f"Call `{target}(...)`", ((call.func, wrapper),))
        self.report(call, message, fix=fix)
