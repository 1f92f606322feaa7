from __future__ import annotations

import libcst as cst

from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.process_group._common import (
    DESTROY_PROCESS_GROUP,
    INIT_PROCESS_GROUP,
    in_function,
    is_cleanup_name,
    is_entry_script,
    last_name,
)


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
        self.init_call: cst.Call | None = None
        self.init_at_top_level = False
        self.destroys = False
        # `utils.cleanup_distributed()` defined elsewhere may destroy the group.
        self.cleanup_helpers: list[str] = []

    def visit_Arg(self, node: cst.Arg) -> None:
        # `atexit.register(dist.destroy_process_group)`
        if self.context.qualify(node.value) == DESTROY_PROCESS_GROUP:
            self.destroys = True

    def visit_Call(self, node: cst.Call) -> None:
        name = self.context.qualify(node.func)
        if name == DESTROY_PROCESS_GROUP:
            self.destroys = True
        elif name == INIT_PROCESS_GROUP:
            if self.init_call is None:
                self.init_call = node
            self.init_at_top_level |= not in_function(self.context.ancestors)
        elif name is None or not name.startswith("torch"):
            helper = last_name(node.func)
            if helper and is_cleanup_name(helper):
                self.cleanup_helpers.append(helper)

    def leave_Module(self, node: cst.Module) -> None:
        if self.init_call is None or self.destroys or self.context.model.framework:
            return
        functions = self.context.model.functions
        if any(helper not in functions for helper in self.cleanup_helpers):
            return
        if self.init_at_top_level or is_entry_script(node, functions):
            self.report(self.init_call.func)
            return
        self.report(
            self.init_call.func,
            "`init_process_group` is called in this module but `destroy_process_group` is "
            "not; make sure the caller calls `dist.destroy_process_group()` when training ends",
            severity=Severity.INFO,
        )
