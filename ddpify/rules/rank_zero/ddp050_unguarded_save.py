from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.call_sites import MethodCall, unguarded_method_calls
from ddpify.analysis.guards import Scope, rank_zero_scope
from ddpify.analysis.names import dotted
from ddpify.analysis.project import LocalFunction
from ddpify.analysis.side_effects import (
    FILE_WRITERS,
    SAVING_OBJECT_FACTORIES,
    SAVING_OBJECT_PATH,
)
from ddpify.diagnostics import Severity
from ddpify.rules.rank_zero._common import (
    Ancestors,
    RankZeroRule,
    keyword_arg,
    mentions_rank,
    positional_arg,
    under_flag,
)
from ddpify.walk import walk

# Writers of a file (checkpoints, sample images) and where their path argument is:
# (keyword, position).
SAVE_CALLS = FILE_WRITERS
SAVE_METHODS = {"save_pretrained": ("save_directory", 0)}
SCRIPT_MODULE_SAVE = "ScriptModule.save"  # `scripted = torch.jit.script(model)`; `scripted.save(f)`
IN_MEMORY = {"io.BytesIO", "io.StringIO"}


@dataclass(frozen=True)
class _Save:
    call: cst.Call
    callee: str
    ancestors: Ancestors
    defined_in: str | None = None  # a helper of another module that saves: its file
    helper: LocalFunction | None = None  # that helper


class UnguardedSave(RankZeroRule):
    """Every rank runs the training script, so an unguarded save has N writers."""

    CODE = "DDP050"
    NAME = "unguarded-save"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`torch.save` runs on every rank, so all processes write the same file; "
        "save under `if dist.get_rank() == 0:`"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.saves: list[_Save] = []

    def on_call(self, node: cst.Call, qualified: str | None) -> None:
        callee = self._save_callee(node, qualified)
        if callee is None:
            self._helper_save(node, qualified)
            return
        path = self._path(node, callee)
        if path is not None and (self._per_rank(path) or self._in_memory(path)):
            return  # one file per rank, or a buffer
        self.saves.append(_Save(node, callee, self.snapshot()))

    def _helper_save(self, node: cst.Call, qualified: str | None) -> None:
        """`utils.save_checkpoint(state, path)`, defined in a local module where it calls
        torch.save on whatever rank calls it: the call site decides (the helper's own
        file, checked alone, cannot tell who calls it)."""
        if qualified is None or not self.context.model.is_distributed:
            return
        helper = self.context.local_function(qualified)
        if helper is not None:  # judged at the end, when every guard flag is known
            save = _Save(node, qualified, self.snapshot(), helper.path.name, helper)
            self.saves.append(save)

    def _save_callee(self, node: cst.Call, qualified: str | None) -> str | None:
        if qualified in SAVE_CALLS:
            return qualified
        if qualified is not None or type(node.func) is not cst.Attribute:
            return None
        method = node.func.attr.value
        if method in SAVE_METHODS:
            return method
        if method == "save" and self._saving_object(node.func.value):
            return SCRIPT_MODULE_SAVE
        return None

    def _saving_object(self, receiver: cst.BaseExpression) -> bool:
        """Whether every value the file binds `receiver` to is a ScriptModule
        (`torch.jit.script(model)`): its `.save(f)` writes a file."""
        name = dotted(receiver)
        values = self.context.model.bindings.get(name, ()) if name else ()
        return bool(values) and all(
            type(value) is cst.Call and self.context.qualify(value.func) in SAVING_OBJECT_FACTORIES
            for value in values
        )

    @staticmethod
    def _path(node: cst.Call, callee: str) -> cst.BaseExpression | None:
        if callee == SCRIPT_MODULE_SAVE:
            keyword, position = SAVING_OBJECT_PATH
        else:
            keyword, position = SAVE_CALLS.get(callee) or SAVE_METHODS[callee]
        arg = keyword_arg(node, keyword) or positional_arg(node, position)
        return arg.value if arg else None

    def _values(self, path: cst.BaseExpression) -> list[cst.BaseExpression]:
        """The path itself, or what a path variable was assigned (anywhere in the file)."""
        name = dotted(path)
        return list(self.context.model.bindings.get(name, ())) if name else [path]

    def _per_rank(self, path: cst.BaseExpression) -> bool:
        values = self._values(path)
        return mentions_rank(path) or bool(values) and all(mentions_rank(v) for v in values)

    def _in_memory(self, path: cst.BaseExpression) -> bool:
        values = self._values(path)
        return bool(values) and all(
            type(value) is cst.Call and self.context.qualify(value.func) in IN_MEMORY
            for value in values
        )

    def leave_Module(self, node: cst.Module) -> None:
        if not self.saves or self.delegates_to_framework():
            return
        if not self.context.model.is_distributed:
            # A helper module: only its distributed importers say where its code runs.
            self._report_methods_called_elsewhere(self.saves)
            return
        unknown: list[_Save] = []
        saving_helpers: dict[int, bool] = {}  # a helper called in many places: judged once
        for save in self.saves:
            helper = save.helper
            if helper is not None and id(helper.node) not in saving_helpers:
                saving_helpers[id(helper.node)] = saves_on_any_rank(
                    helper.node, helper.imports.qualify, self.facts.is_guard_flag
                )
            if helper is not None and not saving_helpers[id(helper.node)]:
                continue
            resolution = self.facts.resolve(save.ancestors)
            if not resolution.known:
                unknown.append(save)
            if not resolution.known or resolution.scope is Scope.GLOBAL:
                continue
            shown = self.context.code(save.call.func)
            if save.defined_in is not None and resolution.scope is None:
                self.report(save.call, _helper_message(shown, save.defined_in))
            elif resolution.scope is Scope.LOCAL:
                self.report(save.call, _local_message(shown), severity=Severity.INFO)
            else:
                self.report(save.call, _message(shown, resolution.helper))
        self._report_methods_called_elsewhere(unknown)

    def _report_methods_called_elsewhere(self, saves: list[_Save]) -> None:
        """A save in a method no code of this file calls (`Model.save_training_state`):
        a distributed module of the project that builds the class and calls the method
        inside a function, under no rank guard there, runs it on every rank."""
        candidates = [
            (save, *found)
            for save in saves
            if save.helper is None and (found := _method_of_class(save.ancestors)) is not None
        ]
        helper = self.context.local.file
        if not candidates or helper is None:
            return
        distributed = set(self.context.distributed_importers())
        if not distributed:
            return
        importers = [found for found in self.context.importing_modules() if found[0] in distributed]
        calls: dict[tuple[str, str], list[MethodCall]] = {}
        for save, cls, method in candidates:
            if rank_zero_scope(save.ancestors) is not None:
                continue
            key = (cls, method)
            if key not in calls:
                calls[key] = unguarded_method_calls(cls, method, helper, importers)
            if calls[key]:
                caller = calls[key][0]
                self.report(
                    save.call,
                    _called_elsewhere_message(
                        self.context.code(save.call.func), cls, method, caller.path.name
                    ),
                )


def _message(shown: str, helper: str | None) -> str:
    where = f"`{shown}` in `{helper}()`" if helper else f"`{shown}`"
    return (
        f"{where} runs on every rank, so all processes write the same file; "
        "save under `if dist.get_rank() == 0:`"
    )


def _method_of_class(ancestors: Ancestors) -> tuple[str, str] | None:
    """(class, method) when the node is in a method of a module-level class."""
    if len(ancestors) > 3 and type(ancestors[1]) is cst.ClassDef:
        method = ancestors[3]
        if type(method) is cst.FunctionDef:
            return ancestors[1].name.value, method.name.value
    return None


def _called_elsewhere_message(shown: str, cls: str, method: str, caller: str) -> str:
    return (
        f"`{shown}` in `{cls}.{method}()` runs on every rank: {caller} (distributed) calls "
        f"`.{method}()` on its `{cls}` outside any rank-0 guard, so all processes write the "
        "same file; save under `if dist.get_rank() == 0:`"
    )


def _helper_message(shown: str, defined_in: str) -> str:
    return (
        f"`{shown}()` (defined in {defined_in}) calls `torch.save` without a rank guard, and "
        "runs on every rank here, so all processes write the same file; call it under "
        "`if dist.get_rank() == 0:`"
    )


def _local_message(shown: str) -> str:
    return (
        f"`{shown}` is guarded by a local rank, so one process per node writes the file; "
        "guard it with the global rank (`dist.get_rank() == 0`) when nodes share storage"
    )


def saves_on_any_rank(function: cst.FunctionDef, qualify, is_guard_flag=None) -> bool:
    """Whether `function` calls a checkpoint writer outside any rank-0 guard of its own,
    with a path that is the same on every rank: not a per-rank path (`f"ckpt.rank{rank}"`),
    not an in-memory buffer (`buffer = io.BytesIO()`), directly or through the name last
    assigned before the call. `is_guard_flag(name)`: whether the caller's file sets a
    flag such as `args.should_save` to a rank-0 test (the helper reads the same `args`)."""
    ancestors: list[cst.CSTNode] = []
    assigned: dict[str, cst.BaseExpression] = {}
    found = False

    def same_file_on_every_rank(path: cst.BaseExpression) -> bool:
        value = assigned.get(path.value, path) if type(path) is cst.Name else path
        if mentions_rank(path) or mentions_rank(value):
            return False
        return not (type(value) is cst.Call and qualify(value.func) in IN_MEMORY)

    def enter(node: cst.CSTNode) -> None:
        nonlocal found
        ancestors.append(node)
        if type(node) is cst.Assign and len(node.targets) == 1:
            target = node.targets[0].target
            if type(target) is cst.Name:
                assigned[target.value] = node.value
        if found or type(node) is not cst.Call or qualify(node.func) not in SAVE_CALLS:
            return
        keyword, position = SAVE_CALLS[qualify(node.func)]
        path = keyword_arg(node, keyword) or positional_arg(node, position)
        if path is not None and not same_file_on_every_rank(path.value):
            return
        if rank_zero_scope(ancestors) is None and not (
            is_guard_flag is not None and under_flag(ancestors, is_guard_flag)
        ):
            found = True

    walk(function, enter, lambda node: ancestors.pop())
    return found
