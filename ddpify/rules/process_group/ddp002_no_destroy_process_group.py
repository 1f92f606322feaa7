from __future__ import annotations

import libcst as cst

from ddpify.analysis.model import qualified_calls
from ddpify.analysis.project import LocalFunction
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.process_group._common import (
    DESTROY_CALLS,
    INIT_CALLS,
    callee_name,
    is_cleanup_name,
    is_entry_script,
    top_level_nodes,
)

_DESTROY_NAME = "destroy_process_group"


class NoDestroyProcessGroup(Rule):
    """An initialised process group should be destroyed when training ends."""

    CODE = "DDP002"
    NAME = "no-destroy-process-group"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`init_process_group` is called but `destroy_process_group` never is; call "
        "`dist.destroy_process_group()` in a `finally` when training ends"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.destroy_referenced = False
        # `utils.cleanup_distributed()` defined elsewhere may destroy the group.
        self.cleanup_helpers: list[str] = []
        # Calls of names imported from elsewhere: a helper of a local module may
        # initialise (or destroy) the group for the script (`init_distributed_mode()`).
        self.imported_calls: list[cst.Call] = []

    def visit_Arg(self, node: cst.Arg) -> None:
        # `atexit.register(dist.destroy_process_group)`
        if callee_name(node.value) == _DESTROY_NAME:
            self.destroy_referenced |= self.context.qualify(node.value) in DESTROY_CALLS

    def visit_Call(self, node: cst.Call) -> None:
        name = callee_name(node.func)
        if name and name != _DESTROY_NAME and is_cleanup_name(name):
            self.cleanup_helpers.append(name)
        qualified = self.context.imports.qualify_local(node.func)
        if qualified is not None and not qualified.startswith("torch."):
            self.imported_calls.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        # `init_device_mesh` creates the default group too when none exists yet.
        inits = model.calls_to(*INIT_CALLS)
        if not inits:
            self._check_helper_init(node)
            return
        if self.destroy_referenced or model.calls_any(*DESTROY_CALLS):
            return
        if model.framework:
            return
        if any(helper not in model.functions for helper in self.cleanup_helpers):
            return
        top_level = top_level_nodes(node)
        if any(id(call) in top_level for call in inits) or is_entry_script(node, model.functions):
            self.report(inits[0].func, self._message(inits[0]))
            return
        self.report(
            inits[0].func,
            f"`{self._init_name(inits[0])}` is called in this module but "
            "`destroy_process_group` is not; make sure the caller calls "
            "`dist.destroy_process_group()` when training ends",
            severity=Severity.INFO,
        )

    def _check_helper_init(self, node: cst.Module) -> None:
        """An entry script whose group is initialised by a helper of a local module
        (`local_rank = init_distributed_mode()`) and destroyed by no helper it calls."""
        model = self.context.model
        if self.destroy_referenced or model.calls_any(*DESTROY_CALLS) or model.framework:
            return
        if self.cleanup_helpers or not is_entry_script(node, model.functions):
            return
        init_call, init_helper = None, None
        for call in self.imported_calls:
            helper = self.context.local_callee(call.func)
            if type(helper) is not LocalFunction:
                continue
            called = qualified_calls(helper.node, helper.imports)
            if any(name in called for name in DESTROY_CALLS):
                return
            if init_call is None and any(name in called for name in INIT_CALLS):
                init_call, init_helper = call, helper
        if init_call is None:
            return
        shown = self.context.code(init_call.func)
        self.report(
            init_call.func,
            f"`{shown}()` (defined in {init_helper.path.name}) calls `init_process_group` but "
            "`destroy_process_group` is never called; call `dist.destroy_process_group()` in "
            "a `finally` when training ends",
            # Cross-file evidence drops to info (../shared/pitfalls.md): on working
            # repositories (dino, mae, deit...) this is the usual `utils.init_distributed_mode`.
            severity=Severity.INFO,
        )

    def _init_name(self, call: cst.Call) -> str:
        return callee_name(call.func) or "init_process_group"

    def _message(self, call: cst.Call) -> str | None:
        """The default message names `init_process_group`; name the mesh when that is the init."""
        name = self._init_name(call)
        if name == "init_process_group":
            return None
        return (
            f"`{name}` creates the default process group but `destroy_process_group` is "
            "never called; call `dist.destroy_process_group()` in a `finally` when training ends"
        )
