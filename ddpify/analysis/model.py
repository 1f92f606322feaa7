"""The script model: facts about a training script, collected during the one visit.

Rules and migration passes ask the model instead of re-deriving facts, so "which names
hold the DDP-wrapped model" or "is a process group ever initialised" is decided in one
place. Collection happens node by node, before the rules see the node; whole-file
questions are therefore answered in the rules' `leave_Module`.
"""

from __future__ import annotations

from collections import defaultdict

import libcst as cst

from ddpify.analysis.names import ImportMap, dotted, method_name

# Frameworks that own process-group set-up, sampling and rank-0 I/O themselves.
FRAMEWORKS = {
    "accelerate": "Accelerate",
    "lightning": "Lightning",
    "pytorch_lightning": "PyTorch Lightning",
    "lightning_fabric": "Lightning Fabric",
    "deepspeed": "DeepSpeed",
    "horovod": "Horovod",
    "ignite": "PyTorch Ignite",
    "composer": "Composer",
}


# Calls that only a multi-process script makes (besides any `torch.distributed.*` call).
MULTIPROCESS_CALLS = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.utils.data.DistributedSampler",
        "torch.multiprocessing.spawn",
        "torch.multiprocessing.start_processes",
    }
)
# String literals only a launched worker reads: torchrun's environment and the legacy flag.
LAUNCHER_STRINGS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "--local_rank",
        "--local-rank",
    }
)
# Strings the model records because rules ask about them.
_RECORDED_STRINGS = LAUNCHER_STRINGS | {"CUDA_VISIBLE_DEVICES"}
# The node types `ScriptModel.visit` records (none has a subclass in libcst): the others,
# most of a tree, are passed over with one set lookup instead of seven ABC isinstance
# checks (the language server visits every node on every keystroke).
_VISITED_TYPES = frozenset(
    {
        cst.Call,
        cst.Import,
        cst.ImportFrom,
        cst.Assign,
        cst.AnnAssign,
        cst.FunctionDef,
        cst.SimpleString,
    }
)


def _is_distributed_call(name: str) -> bool:
    return name in MULTIPROCESS_CALLS or name.startswith("torch.distributed.")


def unwrap_call_chain(expr: cst.BaseExpression) -> cst.Call | None:
    """The innermost constructor call of `Foo(...).to(dev).cuda()`, else `expr` if a call."""
    while (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and isinstance(expr.func.value, cst.Call)
    ):
        expr = expr.func.value
    return expr if isinstance(expr, cst.Call) else None


class ScriptModel:
    def __init__(self, imports: ImportMap) -> None:
        self.imports = imports
        self.calls: dict[str, list[cst.Call]] = defaultdict(list)
        self.method_calls: dict[str, list[cst.Call]] = defaultdict(list)
        # `target` as written (`model`, `self.model`) -> the values assigned to it.
        self.bindings: dict[str, list[cst.BaseExpression]] = defaultdict(list)
        self.functions: dict[str, cst.FunctionDef] = {}
        # Recorded string literals (launcher variables, CUDA_VISIBLE_DEVICES).
        self.strings: set[str] = set()
        self._returns: dict[str, frozenset[str]] = {}  # memo of `returned_calls`
        # Whether a call recorded so far starts or uses processes (see `is_distributed`):
        # kept as calls are recorded, since rules ask it for many calls of a walk.
        self._calls_distributed = False

    # -- collection, driven by the engine ------------------------------------------

    def visit(self, node: cst.CSTNode) -> None:
        if type(node) not in _VISITED_TYPES:
            return
        if isinstance(node, cst.Call):
            name = self.imports.qualify(node.func)
            if name is not None:
                self.calls[name].append(node)
                self._calls_distributed = self._calls_distributed or _is_distributed_call(name)
            method = method_name(node)
            if method is not None:
                self.method_calls[method].append(node)
        elif isinstance(node, (cst.Import, cst.ImportFrom)):
            self.imports.add(node)
        elif isinstance(node, cst.Assign):
            for target in node.targets:
                self._bind(target.target, node.value)
        elif isinstance(node, cst.AnnAssign) and node.value is not None:
            self._bind(node.target, node.value)
        elif isinstance(node, cst.FunctionDef):
            self.functions.setdefault(node.name.value, node)
        elif isinstance(node, cst.SimpleString):
            value = node.raw_value
            if value in _RECORDED_STRINGS:
                self.strings.add(value)

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        name = dotted(target)
        if name is not None:
            self.bindings[name].append(value)
        elif isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
            for t, v in zip(target.elements, value.elements):
                self._bind(t.value, v.value)

    # -- questions -------------------------------------------------------------------

    @property
    def framework(self) -> str | None:
        """The distributed framework the script delegates to, if any."""
        for module, label in FRAMEWORKS.items():
            if self.imports.imports_any(module):
                return label
        return None

    @property
    def is_distributed(self) -> bool:
        """The script runs as several processes: a `torch.distributed` call, DDP, a
        DistributedSampler, mp.spawn, or torchrun's environment variables. Single-process
        scripts are not wrong for lacking what DDP needs."""
        return self._calls_distributed or bool(self.strings & LAUNCHER_STRINGS)

    def calls_to(self, *names: str) -> list[cst.Call]:
        return [call for name in names for call in self.calls.get(name, ())]

    def calls_any(self, *names: str) -> bool:
        return any(self.calls.get(name) for name in names)

    def names_bound_to(self, *callees: str) -> set[str]:
        """Targets assigned from a call to one of `callees` (through `.to()` chains too)."""
        found = set()
        for target, values in self.bindings.items():
            for value in values:
                call = unwrap_call_chain(value)
                if call is not None and self.imports.qualify(call.func) in callees:
                    found.add(target)
        return found

    def returned_calls(self, function: str) -> frozenset[str]:
        """Qualified callees whose result the module-level helper `function` returns:
        `def wrap(m): return DDP(m, ...)`, or a local bound to such a call and returned.
        Lets `model = wrap(model)` count as a DDP wrapper, as a local rank read through
        a helper counts as a read. Empty for unknown names and for methods."""
        if function not in self._returns:
            node = self.functions.get(function)
            self._returns[function] = (
                frozenset(_returned_callees(node, self.imports)) if node else frozenset()
            )
        return self._returns[function]

    def call_returns(self, call: cst.Call, callee: str) -> bool:
        """`call` is `callee(...)` itself or a call of a local helper that returns one."""
        if self.imports.qualify(call.func) == callee:
            return True
        return isinstance(call.func, cst.Name) and callee in self.returned_calls(call.func.value)


def qualified_calls(function: cst.FunctionDef, imports: ImportMap) -> frozenset[str]:
    """The qualified names `function` calls anywhere in its body (`dist.init_process_group`
    -> torch.distributed.init_process_group), through `imports`, the imports of the module
    that defines it: what a helper of a local module does when a script calls it."""
    from ddpify.walk import walk  # the analysis package stays importable on its own

    found: set[str] = set()

    def enter(node: cst.CSTNode) -> None:
        if type(node) is cst.Call:
            name = imports.qualify(node.func)
            if name is not None:
                found.add(name)

    walk(function.body, enter, lambda node: None)
    return frozenset(found)


def returned_callees(function: cst.FunctionDef, imports: ImportMap) -> frozenset[str]:
    """The qualified calls `function` returns (`return DDP(m)`, or a local bound to such a
    call and returned), qualified through `imports`, the imports of the module that
    defines it: what a helper of a local module hands back."""
    return frozenset(_returned_callees(function, imports))


def _returned_callees(function: cst.FunctionDef, imports: ImportMap) -> set[str]:
    """The qualified calls `function` returns, directly or through a local name."""
    from ddpify.walk import walk  # the analysis package stays importable on its own

    local: dict[str, list[cst.BaseExpression]] = defaultdict(list)
    returned: list[cst.BaseExpression] = []

    def enter(node: cst.CSTNode) -> None:
        if isinstance(node, cst.Assign) and len(node.targets) == 1:
            name = dotted(node.targets[0].target)
            if name is not None:
                local[name].append(node.value)
        elif isinstance(node, cst.Return) and node.value is not None:
            returned.append(node.value)

    walk(function.body, enter, lambda node: None)
    found = set()
    for value in returned:
        values = local.get(dotted(value) or "", [value]) if isinstance(value, cst.Name) else [value]
        for candidate in values:
            options = (
                [candidate.body, candidate.orelse]
                if isinstance(candidate, cst.IfExp)
                else [candidate]
            )
            for option in options:
                call = unwrap_call_chain(option)
                name = imports.qualify(call.func) if call is not None else None
                if name is not None:
                    found.add(name)
    return found
