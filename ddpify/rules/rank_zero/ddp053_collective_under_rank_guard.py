from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.module_globals import module_functions, parameter_for, runs_parameter
from ddpify.analysis.training import COLLECTIVES
from ddpify.analysis.wrappers import Place
from ddpify.diagnostics import Severity
from ddpify.rules.rank_zero._common import (
    Ancestors,
    RankZeroRule,
    innermost,
    keyword_arg,
    non_zero_guarded,
)


@dataclass(frozen=True)
class _Collective:
    call: cst.Call
    name: str | None  # the collective, or None for a forward of the DDP wrapper
    ancestors: Ancestors
    seq: int


class CollectiveUnderRankGuard(RankZeroRule):
    """A collective that only rank 0 enters waits for the other ranks forever."""

    CODE = "DDP053"
    NAME = "collective-under-rank-guard"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "`dist.barrier` runs on rank 0 only, so the other ranks never join it and the job "
        "hangs; call it on every rank, outside the guard"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.collectives: list[_Collective] = []

    def on_call(self, node: cst.Call, qualified: str | None) -> None:
        if qualified in COLLECTIVES:
            self.collectives.append(_Collective(node, qualified, self.snapshot(), self.facts.seq))
        elif qualified is None and type(node.func) in (cst.Name, cst.Attribute):
            self.collectives.append(_Collective(node, None, self.snapshot(), self.facts.seq))

    def leave_Module(self, node: cst.Module) -> None:
        # `if rank != 0: dist.barrier()` ... `if rank == 0: dist.barrier()`: rank 0 goes
        # first, on purpose; each side's barrier meets the other's.
        # Matched within one function: another function's barrier is no evidence.
        matched = {
            (_function_of(c), c.name)
            for c in self.collectives
            if c.name and non_zero_guarded(c.ancestors)
        }
        for collective in self.collectives:
            if (_function_of(collective), collective.name) in matched:
                continue
            handed_to = None
            if collective.name is None and not self._wrapper(collective):
                handed_to = self._hands_wrapper_to_forward(collective)
                if handed_to is None:
                    continue
            resolution = self.facts.resolve(collective.ancestors, launcher_counts=False)
            if resolution.known and resolution.scope is not None:
                if handed_to is not None:
                    self._report_handed(collective, handed_to, resolution.helper)
                else:
                    self._report(collective, resolution.helper)

    def _wrapper(self, collective: _Collective) -> bool:
        """A forward of the DDP wrapper (`ddp_model(x)`, `ddp_model.forward(x)`) that
        broadcasts buffers."""
        func = collective.call.func
        if type(func) is cst.Attribute and func.attr.value == "forward":
            func = func.value
        place = Place(collective.ancestors, collective.seq)
        binding = self.context.wrappers.wrapper_binding(func, place)
        if binding is None:
            return False
        return not _buffers_not_broadcast(unwrap_call_chain(binding.value))

    def _hands_wrapper_to_forward(self, collective: _Collective) -> cst.BaseExpression | None:
        """`evaluate(ddp_model)`, where `evaluate` is a function of this file that runs
        the forward of what it gets (itself or through the helpers it hands it to): the
        argument that holds the wrapper, else None."""
        func = collective.call.func
        function = (
            module_functions(self.context.tree).get(func.value) if type(func) is cst.Name else None
        )
        if function is None:
            return None
        place = Place(collective.ancestors, collective.seq)
        for arg in collective.call.args:
            binding = self.context.wrappers.wrapper_binding(arg.value, place)
            if binding is None or _buffers_not_broadcast(unwrap_call_chain(binding.value)):
                continue
            param = parameter_for(function, collective.call, arg)
            if param is not None and runs_parameter(self.context.tree, function, param):
                return arg.value
        return None

    def _report_handed(
        self, collective: _Collective, wrapper: cst.BaseExpression, helper: str | None
    ) -> None:
        shown, held = self.context.code(collective.call.func), self.context.code(wrapper)
        where = f" in `{helper}()`" if helper else ""
        why = " (every call of it is under a rank-0 guard)" if helper else ""
        message = (
            f"`{shown}(...)`{where} hands the DDP wrapper `{held}` to `{shown}()`, which runs "
            f"its forward, on rank 0 only{why}; that hangs once the model has buffers to "
            f"broadcast (BatchNorm); pass `{held}.module` instead"
        )
        self.report(collective.call, message, severity=Severity.WARNING)

    def _report(self, collective: _Collective, helper: str | None) -> None:
        shown = self.context.code(collective.call.func)
        where = f" in `{helper}()`" if helper else ""
        why = " (every call of it is under a rank-0 guard)" if helper else ""
        if collective.name is None:
            wrapper = shown.removesuffix(".forward")
            message = (
                f"`{shown}(...)`{where} runs the DDP wrapper's forward on rank 0 only{why}, "
                "which hangs once the model has buffers to broadcast (BatchNorm); "
                f"evaluate `{wrapper}.module(...)` instead"
            )
            # Without buffers (nanoGPT with flash attention) the forward runs no collective.
            self.report(collective.call, message, severity=Severity.WARNING)
            return
        message = (
            f"`{shown}`{where} runs on rank 0 only{why}, so the other ranks never join it "
            "and the job hangs; call it on every rank, outside the guard"
        )
        self.report(collective.call, message)


def _function_of(collective: _Collective) -> cst.FunctionDef | None:
    found = innermost(collective.ancestors, cst.FunctionDef)
    return found if type(found) is cst.FunctionDef else None


def _buffers_not_broadcast(wrap: cst.Call | None) -> bool:
    """`DDP(model, broadcast_buffers=False)`: its forward runs no collective."""
    arg = keyword_arg(wrap, "broadcast_buffers") if wrap is not None else None
    return arg is not None and type(arg.value) is cst.Name and arg.value.value == "False"
