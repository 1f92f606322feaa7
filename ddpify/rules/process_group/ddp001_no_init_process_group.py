from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import libcst as cst

from ddpify.analysis.guards import exits
from ddpify.analysis.names import dotted, find_arg, identifiers
from ddpify.analysis.project import LocalFunction
from ddpify.analysis.reachability import enclosing_top_level_unit, units_run_by_module
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.process_group._common import (
    DIST,
    INIT_CALLS,
    callee_name,
    contains,
    in_function,
    is_dist_guard_call,
    is_entry_script,
    is_setup_name,
    last_name,
)

DDP = "torch.nn.parallel.DistributedDataParallel"
SAMPLER = "torch.utils.data.DistributedSampler"
# torch.distributed functions that raise without a default process group.
NEEDS_GROUP = tuple(
    f"{DIST}.{name}"
    for name in (
        "all_gather all_gather_into_tensor all_gather_object all_reduce all_to_all "
        "all_to_all_single barrier batch_isend_irecv broadcast broadcast_object_list gather "
        "gather_object get_backend get_rank get_world_size irecv isend monitored_barrier "
        "new_group recv reduce reduce_scatter reduce_scatter_tensor scatter "
        "scatter_object_list send"
    ).split()
)
_INIT_NAMES = {name.rsplit(".", 1)[-1] for name in INIT_CALLS}


@dataclass
class _Use:
    """A call that needs a process group, with the conditions it runs under."""

    node: cst.Call
    conditions: list[cst.CSTNode]
    top_level: bool
    function: cst.FunctionDef | cst.ClassDef | None  # the module-level def or class it sits in
    # In a `test_*` function or method: the test harness creates the group (a
    # distributed test case's setUp, a pytest fixture).
    in_test: bool


@dataclass
class _HelperCall:
    name: str
    setup_named: bool


def _conditions(ancestors: list[cst.CSTNode]) -> list[cst.CSTNode]:
    """Tests that decide whether the innermost node runs: enclosing ifs and early exits."""
    found: list[cst.CSTNode] = []
    for depth in range(len(ancestors) - 2, -1, -1):
        parent, child = ancestors[depth], ancestors[depth + 1]
        kind = type(parent)  # exact types: isinstance against libcst's ABCs is slow
        if kind in (cst.If, cst.While, cst.IfExp) and child is not parent.test:
            found.append(parent.test)
        elif kind is cst.BooleanOperation and child is parent.right:
            found.append(parent.left)
        elif kind is cst.Try and child is parent.body and parent.handlers:
            found.append(parent)  # the author expected it to fail
        elif kind is cst.IndentedBlock or kind is cst.Module:
            for stmt in parent.body:
                if stmt is child:
                    break
                if type(stmt) is cst.If and exits(stmt.body):
                    found.append(stmt.test)
    return found


class _Scan:
    """Only for files that use a group and never create it: where each use sits, and the
    other calls, in source order. Read from the engine's walk (`context.tree`'s calls and
    parents), not from a walk of its own."""

    def __init__(self) -> None:
        self.uses: list[_Use] = []
        self.calls: list[cst.Call] = []

    @classmethod
    def of(cls, context, use_nodes: list[cst.Call]) -> _Scan:
        scan = cls()
        use_ids = {id(call) for call in use_nodes}
        tree = context.tree
        for call in tree.find(cst.Call):
            if id(call) not in use_ids:
                scan.calls.append(call)
                continue
            ancestors = tree.ancestors(call)
            scan.uses.append(
                _Use(
                    call,
                    _conditions(ancestors),
                    not in_function(ancestors),
                    enclosing_top_level_unit(ancestors),
                    _in_test(ancestors),
                )
            )
        return scan


def _in_test(ancestors: list[cst.CSTNode]) -> bool:
    return any(
        type(node) is cst.FunctionDef and node.name.value.startswith("test") for node in ancestors
    )


def _samples_explicitly(call: cst.Call) -> bool:
    """`DistributedSampler(ds, num_replicas=n, rank=r)` needs no process group."""
    return find_arg(call, "num_replicas", 1) is not None and find_arg(call, "rank", 2) is not None


def _mentions_rank_or_world(call: cst.Call) -> bool:
    for arg in call.args:
        names = [n.lower() for n in identifiers(arg.value)]
        if any("rank" in n or "world" in n for n in names):
            return True
    return False


class NoInitProcessGroup(Rule):
    """DDP, DistributedSampler and `dist.*` collectives raise without a process group."""

    CODE = "DDP001"
    NAME = "no-init-process-group"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "a process group is used but `init_process_group` is never called in this file; "
        "call `dist.init_process_group()` first"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.init_referenced = False
        self.relative_imports: set[str] = set()

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative and type(node.names) is not cst.ImportStar:
            for alias in node.names:
                bound = alias.asname.name if alias.asname else alias.name
                if type(bound) is cst.Name:
                    self.relative_imports.add(bound.value)

    def visit_Arg(self, node: cst.Arg) -> None:
        # `partial(dist.init_process_group, ...)`, `executor.submit(init_process_group)`.
        if callee_name(node.value) in _INIT_NAMES:
            self.init_referenced |= self.context.qualify(node.value) in INIT_CALLS

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if self.init_referenced or model.calls_any(*INIT_CALLS) or model.framework:
            return
        use_nodes = model.calls_to(DDP, *NEEDS_GROUP) + [
            call for call in model.calls_to(SAMPLER) if not _samples_explicitly(call)
        ]
        if not use_nodes:
            return
        scan = _Scan.of(self.context, use_nodes)
        top_level = any(use.top_level for use in scan.uses)
        if not top_level and not is_entry_script(node, model.functions):
            return  # a library module: the caller initialises
        uses = [use for use in scan.uses if not self._guarded(use) and not use.in_test]
        uses = self._run_here(node, uses)
        if not uses:
            return
        severity, helper = self._severity(scan.calls)
        if severity is not None:
            self._report(uses[0].node, severity, helper)

    @staticmethod
    def _run_here(module: cst.Module, uses: list[_Use]) -> list[_Use]:
        """The uses this file's own code may run. One in a function or class the file never
        reaches (`get_dataloader(..., distributed)` in a datasets module whose `__main__`
        block only prints a table; a test class a test runner finds) runs when other code
        calls it, after that code set up the group."""
        if all(use.function is None for use in uses):
            return uses
        run = units_run_by_module(module)
        return [use for use in uses if use.function is None or use.function.name.value in run]

    def _report(self, use: cst.Call, severity: Severity, helper: str | None) -> None:
        callee = self.context.code(use.func)
        if helper is None:
            message = (
                f"`{callee}(...)` needs a process group, but `init_process_group` is never "
                "called in this file; call `dist.init_process_group()` before it"
            )
        else:
            message = (
                f"`{callee}(...)` needs a process group and this file never calls "
                f"`init_process_group`; make sure `{helper}(...)` initialises it"
            )
        self.report(use.func, message, severity=severity)

    def _severity(self, calls: list[cst.Call]) -> tuple[Severity | None, str | None]:
        """Error, or info naming a helper that may initialise; None when one surely does."""
        functions = self.context.model.functions
        if any(self._initialises_elsewhere(call) for call in calls):
            return None, None
        info_helper = None
        for helper in filter(None, map(self._helper, calls)):
            if helper.setup_named and helper.name not in functions:
                return None, helper.name  # `init_distributed_mode(args)` from a utils module
            if info_helper is None:
                info_helper = helper.name
        if info_helper is not None:
            return Severity.INFO, info_helper
        return Severity.ERROR, None

    def _initialises_elsewhere(self, call: cst.Call) -> bool:
        """A helper of a local module whose body creates the group, whatever its name
        (`dist.init()` with `from torch_utils import distributed as dist`)."""
        callee = self.context.local_callee(call.func)
        if not isinstance(callee, LocalFunction):
            return False
        qualify = callee.imports.qualify
        return contains(
            callee.node.body,
            lambda node: type(node) is cst.Call and qualify(node.func) in INIT_CALLS,
        )

    def _helper(self, call: cst.Call) -> _HelperCall | None:
        """A call that may create the group out of sight: a set-up helper, or one given ranks."""
        name = last_name(call.func)
        if name is None:
            return None
        qualified = self.context.qualify(call.func)
        if qualified is not None and qualified.startswith("torch"):
            return None
        if is_setup_name(name):
            return _HelperCall(name, setup_named=True)
        if self._imported(call.func) and _mentions_rank_or_world(call):
            return _HelperCall(name, setup_named=False)
        return None

    def _imported(self, callee: cst.BaseExpression) -> bool:
        path = dotted(callee)
        if path is None:
            return False
        head = path.split(".")[0]
        return head in self.relative_imports or head in self.context.imports.aliases

    def _guarded(self, use: _Use) -> bool:
        return any(contains(cond, self._is_guard) for cond in use.conditions)

    def _is_guard(self, node: cst.CSTNode) -> bool:
        if type(node) is cst.Try:
            return True
        imports = self.context.imports
        if is_dist_guard_call(node, imports):
            return True
        if type(node) in (cst.Name, cst.Attribute):
            return dotted(node) in self._guard_variables
        if type(node) is cst.Call:
            function = self.context.model.functions.get(last_name(node.func) or "")
            return function is not None and contains(
                function.body, lambda n: is_dist_guard_call(n, imports)
            )
        return False

    @cached_property
    def _guard_variables(self) -> set[str]:
        """`distributed = dist.is_available() and dist.is_initialized()`."""
        imports = self.context.imports
        return {
            name
            for name, values in self.context.model.bindings.items()
            if any(contains(v, lambda n: is_dist_guard_call(n, imports)) for v in values)
        }
