"""Facts the process-group rules share: environment access, set-up helpers, dist guards."""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst

from ddpify.analysis.names import ImportMap, dotted
from ddpify.walk import children

DIST = "torch.distributed"
INIT_PROCESS_GROUP = f"{DIST}.init_process_group"
DESTROY_PROCESS_GROUP = f"{DIST}.destroy_process_group"
DESTROY_CALLS = (DESTROY_PROCESS_GROUP, f"{DIST}.distributed_c10d.destroy_process_group")
# `init_device_mesh` initialises the default group itself when none exists.
INIT_CALLS = (INIT_PROCESS_GROUP, f"{DIST}.device_mesh.init_device_mesh")
MP_SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")

# What torchrun exports to every worker.
TORCHRUN_ENV = {"LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
MASTER_ENV = {"MASTER_ADDR", "MASTER_PORT"}
# Launchers other than torchrun and mp.spawn: scripts reading these bring their own set-up.
OTHER_LAUNCHER_ENV = re.compile(r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|MPI_)")

# `dist.is_initialized()` and friends: code under them is written for both cases.
DIST_GUARDS = {f"{DIST}.is_initialized", f"{DIST}.is_available", f"{DIST}.is_torchelastic_launched"}
_GUARD_HELPER = re.compile(r"^(is|has|use|using)_.*(dist|ddp|initiali[sz]ed|parallel)")

_DIST_WORD = r"(dist|distributed|ddp|process_group|processes|pg|nccl|multigpu|multi_gpu)"
_SETUP_NAME = re.compile(
    rf"((init|initiali[sz]e|setup|set_up|start|launch|prepare)_?(.*_)?{_DIST_WORD}(_|$)"
    rf"|(^|_){_DIST_WORD}_(init|initiali[sz]e|setup|set_up|start|launch)"
    rf"|^(ddp_)?(setup|set_up)$|^(setup|init)_(env|environment|cluster|slurm|process|processes)$"
    rf"|^init_process$)"
)
_CLEANUP_WORD = r"(cleanup|clean_up|teardown|tear_down|destroy|shutdown|finali[sz]e|close)"
_CLEANUP_NAME = re.compile(
    rf"^(ddp_)?(cleanup|clean_up|teardown|tear_down)$"
    rf"|{_CLEANUP_WORD}_(.*_)?{_DIST_WORD}(_|$)|(^|_){_DIST_WORD}_{_CLEANUP_WORD}"
)


def callee_name(expr: cst.BaseExpression) -> str | None:
    """The last identifier of a callee, cheaply: a filter to run before `qualify`."""
    if type(expr) is cst.Attribute:  # exact types: see ddpify.walk.is_kind
        return expr.attr.value
    return expr.value if type(expr) is cst.Name else None


def last_name(expr: cst.BaseExpression) -> str | None:
    """`init_dist` for `utils.init_dist`, `self.init_dist`, or `init_dist`."""
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name else None


def is_setup_name(name: str) -> bool:
    """Whether a function name suggests it sets up distributed training."""
    lowered = name.lower()
    return not lowered.startswith(("is_", "get_")) and bool(_SETUP_NAME.search(lowered))


def is_cleanup_name(name: str) -> bool:
    return bool(_CLEANUP_NAME.search(name.lower()))


def string_value(expr: cst.BaseExpression) -> str | None:
    if type(expr) is cst.SimpleString:
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    if type(expr) is cst.ConcatenatedString:
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    return None


def string_prefix(expr: cst.BaseExpression) -> str | None:
    """The literal text a string or f-string starts with (`tcp://` of `f"tcp://{h}"`)."""
    value = string_value(expr)
    if value is not None:
        return value
    if type(expr) is cst.FormattedString and expr.parts:
        first = expr.parts[0]
        if type(first) is cst.FormattedStringText:
            return first.value
    return None


def _first_arg_string(call: cst.Call) -> str | None:
    if call.args and call.args[0].keyword is None:
        return string_value(call.args[0].value)
    return None


def environ_subscript_key(node: cst.Subscript, imports: ImportMap) -> str | None:
    """`KEY` of `os.environ["KEY"]`."""
    if len(node.slice) != 1 or type(node.slice[0].slice) is not cst.Index:
        return None
    key = string_value(node.slice[0].slice.value)
    if key is None or imports.qualify(node.value) != "os.environ":
        return None
    return key


_ENVIRON_METHODS = {"get", "getenv", "pop", "setdefault"}


def environ_call_key(call: cst.Call, imports: ImportMap) -> tuple[str, str] | None:
    """(`get`, `KEY`) for `os.environ.get("KEY")`, `os.getenv("KEY")`, `os.environ.setdefault`."""
    if callee_name(call.func) not in _ENVIRON_METHODS:
        return None
    name = imports.qualify(call.func)
    if name == "os.getenv":
        method = "get"
    elif name is not None and name.startswith("os.environ."):
        method = name[len("os.environ.") :]
    else:
        return None
    key = _first_arg_string(call)
    return (method, key) if key is not None else None


def environ_membership_key(node: cst.Comparison, imports: ImportMap) -> str | None:
    """`KEY` of `"KEY" in os.environ` / `"KEY" not in os.environ`."""
    if len(node.comparisons) != 1:
        return None
    target = node.comparisons[0]
    if type(target.operator) not in (cst.In, cst.NotIn):
        return None
    if imports.qualify(target.comparator) != "os.environ":
        return None
    return string_value(node.left)


def is_assign_target(node: cst.CSTNode, ancestors: Sequence[cst.CSTNode]) -> bool:
    """Whether `node` (the last of `ancestors`) is written to, not read."""
    parent = ancestors[-2] if len(ancestors) > 1 else None
    if type(parent) is cst.AssignTarget and parent.target is node:
        return True
    if type(parent) in (cst.AugAssign, cst.AnnAssign) and parent.target is node:
        return True
    return type(parent) is cst.Del


class EnvReads:
    """Environment variables a script reads, collected node by node."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        # Nodes that read the environment; assignments from them derive from the launcher.
        self.nodes: set[int] = set()

    def observe_subscript(self, node: cst.Subscript, ancestors, imports: ImportMap) -> None:
        key = environ_subscript_key(node, imports)
        if key is not None and not is_assign_target(node, ancestors):
            self._add(node, key)

    def observe_call(self, node: cst.Call, imports: ImportMap) -> None:
        found = environ_call_key(node, imports)
        if found is not None and found[0] in {"get", "pop"}:
            self._add(node, found[1])

    def observe_comparison(self, node: cst.Comparison, imports: ImportMap) -> None:
        key = environ_membership_key(node, imports)
        if key is not None:
            self._add(node, key)

    def _add(self, node: cst.CSTNode, key: str) -> None:
        self.keys.add(key)
        self.nodes.add(id(node))

    @property
    def torchrun(self) -> bool:
        return bool(self.keys & TORCHRUN_ENV)

    @property
    def other_launcher(self) -> bool:
        return any(OTHER_LAUNCHER_ENV.match(key) for key in self.keys)


def contains(node: cst.CSTNode, predicate) -> bool:
    """Whether `predicate` holds for `node` or any node below it."""
    stack = [node]
    while stack:
        current = stack.pop()
        if predicate(current):
            return True
        stack.extend(children(current))
    return False


def top_level_nodes(module: cst.Module) -> set[int]:
    """Ids of the nodes that run at import time: everything outside function bodies."""
    found: set[int] = set()
    stack: list[cst.CSTNode] = [module]
    while stack:
        current = stack.pop()
        found.add(id(current))
        if type(current) not in (cst.FunctionDef, cst.Lambda):
            stack.extend(children(current))
    return found


def is_dist_guard_call(node: cst.CSTNode, imports: ImportMap) -> bool:
    """`dist.is_initialized()`, `dist.is_available()`, or a helper named like one."""
    if type(node) is not cst.Call:
        return False
    if imports.qualify(node.func) in DIST_GUARDS:
        return True
    name = last_name(node.func)
    return bool(name and _GUARD_HELPER.match(name.lower()))


def is_main_guard(stmt: cst.CSTNode) -> bool:
    """`if __name__ == "__main__":`."""
    if type(stmt) is not cst.If or type(stmt.test) is not cst.Comparison:
        return False
    test = stmt.test
    sides = [test.left, *(c.comparator for c in test.comparisons)]
    return any(type(s) is cst.Name and s.value == "__name__" for s in sides) and any(
        string_value(s) == "__main__" for s in sides
    )


def is_entry_script(module: cst.Module, functions) -> bool:
    """A `__main__` guard, or a module-level call to a function defined in the file."""
    for stmt in module.body:
        if is_main_guard(stmt):
            return True
        if type(stmt) is cst.SimpleStatementLine:
            for small in stmt.body:
                call = small.value if type(small) is cst.Expr else None
                if type(call) is cst.Call and dotted(call.func) in functions:
                    return True
    return False


def in_function(ancestors: Sequence[cst.CSTNode]) -> bool:
    return any(type(a) in (cst.FunctionDef, cst.Lambda) for a in ancestors[:-1])
