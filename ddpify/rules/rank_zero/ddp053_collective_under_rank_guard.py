from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.accumulation import assigned_names
from ddpify.analysis.call_sites import wrapper_arguments
from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.module_globals import (
    module_functions,
    parameter_for,
    project_callee,
    runs_parameter,
)
from ddpify.analysis.names import find_arg
from ddpify.analysis.training import COLLECTIVES, parameter_index
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
        self._project_callee = None

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
        # Collectives some rank other than 0 waits at on purpose, anywhere in the file: the
        # chains through helpers below are judged only without them.
        waiting = {name for _, name in matched}
        for collective in self.collectives:
            if (_function_of(collective), collective.name) in matched:
                continue
            handed_to = parameter = None
            if collective.name is None and not self._wrapper(collective):
                handed_to = self._hands_wrapper_to_forward(collective)
                if handed_to is None:
                    parameter = self._forward_of_parameter(collective)
                    if parameter is None:
                        continue
            resolution = self.facts.resolve(collective.ancestors, launcher_counts=False)
            if resolution.known and resolution.scope is None and collective.name:
                self._check_rank_zero_chain(collective, waiting)
            if not resolution.known or resolution.scope is None:
                continue
            if handed_to is not None:
                self._report_handed(collective, handed_to, resolution.helper)
            elif parameter is not None:
                caller = self._caller_handing_wrapper(collective, parameter)
                if caller is not None:
                    self._report_given(collective, parameter, caller)
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

    def _callee(self):
        """How the helpers a function hands the wrapper on to are found: this file's
        functions, then those of the local modules it imports."""
        if self._project_callee is None:
            self._project_callee = project_callee(
                self.context.tree, self.context.imports, self.context.local
            )
        return self._project_callee

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
            if param is not None and runs_parameter(
                self.context.tree, function, param, callee=self._callee()
            ):
                return arg.value
        return None

    def _check_rank_zero_chain(self, collective: _Collective, waiting: set) -> None:
        """A collective in a helper that every rank calls, which rank 0 alone also reaches
        through a chain of calls under a rank-0 guard (`if rank == 0: write_index()`, and
        `write_index()` calls the helper): on that path the others never join it."""
        if collective.name in waiting:
            return
        chain = self.facts.rank_zero_path(collective.ancestors)
        if not chain:
            return
        # `if rank == 0: sync() else: sync()`: the other ranks call it on their side.
        sites = (site for name in chain for site in self.facts.sites.get(name, ()))
        if any(non_zero_guarded(site.ancestors) for site in sites):
            return
        shown = self.context.code(collective.call.func)
        via = " -> ".join(f"`{name}()`" for name in chain)
        message = (
            f"`{shown}` in `{chain[-1]}()` also runs on rank 0 alone: `{chain[0]}()` is "
            f"called under a rank-0 guard and reaches it ({via}), and there the other ranks "
            "never join it and the job hangs; keep collectives out of what rank 0 runs alone"
        )
        self.report(collective.call, message)

    def _forward_of_parameter(self, collective: _Collective) -> str | None:
        """`model(x)` (`model.forward(x)`) where `model` is a parameter of the module-level
        function holding the call, never rebound there (`model = model.module`): the
        parameter, else None. Cheap: asked of every call before any guard is resolved."""
        func = collective.call.func
        if type(func) is cst.Attribute and func.attr.value == "forward":
            func = func.value
        function = _function_of(collective)
        if type(func) is not cst.Name or function is None:
            return None
        if not parameter_index(function, func.value)[1]:
            return None
        if func.value in assigned_names(function.body):
            return None
        if _function_of_module(self.context.tree, function) is None:
            return None  # a method or nested function: its callers are not read
        return func.value

    def _caller_handing_wrapper(self, collective: _Collective, parameter: str) -> str | None:
        """A call of the function holding `collective` that passes `parameter` the DDP
        wrapper (its forward broadcasting buffers): in this file, else in a module of the
        project that imports this one (`evaluate(model, ...)` in `main.py` after `model =
        DDP(model)`). What to show for it, else None."""
        function = _function_of(collective)
        assert function is not None
        position = parameter_index(function, parameter)[0]
        for caller in self.collectives:
            call = caller.call
            if type(call.func) is not cst.Name or call.func.value != function.name.value:
                continue
            arg = find_arg(call, parameter, position)
            if arg is None or arg.star:
                continue
            binding = self.context.wrappers.forwarding_wrapper_binding(
                arg.value, Place(caller.ancestors, caller.seq)
            )
            if binding is not None and not _buffers_not_broadcast(unwrap_call_chain(binding.value)):
                shown, given = self.context.code(call.func), self.context.code(arg.value)
                return f"`{shown}(...)` (given `{given}`)"
        helper = self.context.local.file
        if helper is None:
            return None
        for found in wrapper_arguments(
            function, parameter, helper, self.context.importing_modules()
        ):
            if not _buffers_not_broadcast(unwrap_call_chain(found.wrap)):
                return f"`{function.name.value}(...)` in `{found.path.name}`"
        return None

    def _report_given(self, collective: _Collective, parameter: str, caller: str) -> None:
        shown = self.context.code(collective.call.func)
        function = _function_of(collective)
        assert function is not None
        message = (
            f"`{shown}(...)` in `{function.name.value}()` runs on rank 0 only, and {caller} "
            f"hands `{parameter}` the DDP wrapper: its forward on rank 0 alone hangs once the "
            f"model has buffers to broadcast (BatchNorm); unwrap it first "
            f"(`{parameter} = {parameter}.module`)"
        )
        self.report(collective.call, message, severity=Severity.WARNING)

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


def _function_of_module(tree, function: cst.FunctionDef) -> cst.FunctionDef | None:
    """`function` when it is defined at the top level of the checked module."""
    return function if any(s is function for s in tree.module.body) else None


def _buffers_not_broadcast(wrap: cst.Call | None) -> bool:
    """`DDP(model, broadcast_buffers=False)`: its forward runs no collective."""
    arg = keyword_arg(wrap, "broadcast_buffers") if wrap is not None else None
    return arg is not None and type(arg.value) is cst.Name and arg.value.value == "False"
