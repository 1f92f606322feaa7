"""Facts the device and wrapping rules share: is this script distributed, where does a
value come from (global rank, local rank), and in which order do calls run.

These would sit well in `ddpify/analysis/`; they live here until the script model
grows the same questions.
"""

from __future__ import annotations

import enum
import functools
from collections import defaultdict
from collections.abc import Iterator

import libcst as cst

from ddpify.analysis.guards import Scope, rank_scope, single_process_only
from ddpify.analysis.model import ScriptModel
from ddpify.analysis.names import ImportMap, dotted
from ddpify.rules.base import Rule
from ddpify.walk import children

DDP = "torch.nn.parallel.DistributedDataParallel"
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"
SET_DEVICE = "torch.cuda.set_device"

# A process that sees one GPU only: "cuda:0" is then its own GPU.
PINNED_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

GLOBAL_RANK_KEYS = frozenset(
    {"RANK", "GLOBAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}
)
LOCAL_RANK_KEYS = frozenset(
    {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}
)


def string_value(node: cst.BaseExpression) -> str | None:
    if type(node) is cst.SimpleString:
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


class DistributedRule(Rule):
    """A rule that only speaks about distributed scripts; decide in `leave_Module`."""

    @property
    def model(self) -> ScriptModel:
        return self.context.model

    def is_distributed(self) -> bool:
        """Plain DDP code in this file: not single-GPU, not delegated to a framework."""
        return self.model.framework is None and self.model.is_distributed

    @functools.cached_property
    def resolver(self) -> RankResolver:
        """One per file: it keeps what it read of each scope for the next question."""
        return RankResolver(self.model, self.context.module)

    def pins_visible_devices(self) -> bool:
        return PINNED_VISIBLE_DEVICES in self.model.strings

    def enclosing_function(self) -> cst.FunctionDef | None:
        return self.context.enclosing(cst.FunctionDef)  # type: ignore[return-value]


class Rank(enum.Enum):
    GLOBAL = "global"
    LOCAL = "local"


def env_key(expr: cst.BaseExpression, imports: ImportMap) -> str | None:
    """`"RANK"` for `os.environ["RANK"]`, `os.environ.get("RANK")`, `os.getenv("RANK", 0)`."""
    if type(expr) is cst.Subscript and imports.qualify(expr.value) == "os.environ":
        index = expr.slice[0].slice if len(expr.slice) == 1 else None
        return string_value(index.value) if type(index) is cst.Index else None
    if type(expr) is cst.Call and expr.args:
        if imports.qualify(expr.func) in {"os.environ.get", "os.getenv"}:
            return string_value(expr.args[0].value)
    return None


def function_parameters(func: cst.FunctionDef | None) -> set[str]:
    if func is None:
        return set()
    params = func.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    for star in (params.star_arg, params.star_kwarg):
        if type(star) is cst.Param:
            every.append(star)
    return {param.name.value for param in every}


def assignments_by_name(
    body: cst.CSTNode, distributed_only: bool = False
) -> dict[str, list[cst.BaseExpression]]:
    """Values assigned to each name in `body`, in source order, not descending into nested
    functions or classes; with `distributed_only`, none from a branch that runs only
    without a process group, and no constant from an `except` fallback (`except
    Exception: rank = 0`). One read-only pass (libcst's `visit` rebuilds every node it
    passes, which costs about a parse)."""
    found: dict[str, list[cst.BaseExpression]] = defaultdict(list)
    stack: list[tuple[cst.CSTNode, bool]] = [(body, False)]  # (node, inside an except)
    while stack:
        node, handled = stack.pop()
        kind = type(node)
        if kind is cst.ClassDef or (kind is cst.FunctionDef and node is not body):
            continue
        if kind is cst.Assign:
            if not (distributed_only and handled and _is_integer(node.value)):
                for assign_target in node.targets:
                    _add(found, assign_target.target, node.value)
        elif kind is cst.AnnAssign and node.value is not None:
            _add(found, node.target, node.value)
        handled = handled or kind is cst.ExceptHandler
        branches = _branches(node) if distributed_only and kind is cst.If else children(node)
        stack.extend((child, handled) for child in reversed(list(branches)))
    return found


def _add(found: dict, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
    name = dotted(target)
    if name is not None:
        found[name].append(value)


def _branches(node: cst.If) -> Iterator[cst.CSTNode]:
    """The branches of `if` that may run with a process group (the test holds none)."""
    if not single_process_only(node.test):
        yield node.body
    if node.orelse is not None and not single_process_only(node.test, orelse=True):
        yield node.orelse


def _is_integer(value: cst.BaseExpression) -> bool:
    if type(value) is cst.UnaryOperation and type(value.operator) is cst.Minus:
        value = value.expression
    return type(value) is cst.Integer


class RankResolver:
    """Decides whether an expression holds the global or the local rank, by its origin.

    Structural evidence only (an env var, `dist.get_rank()`, an assignment from one of
    those); a bare name whose origin cannot be seen (a function parameter, as in
    mp.spawn workers where the spawned index *is* the local rank) resolves to None.
    """

    def __init__(self, model: ScriptModel, module: cst.Module) -> None:
        self.model = model
        self.imports = model.imports
        self.module = module
        # (id of a scope, distributed_only) -> (the scope, its assignments by name).
        self._assigned: dict[tuple[int, bool], tuple[cst.CSTNode, dict]] = {}

    def resolve(
        self, expr: cst.BaseExpression, func: cst.FunctionDef | None, depth: int = 0
    ) -> tuple[Rank, str] | None:
        """(rank kind, the origin as written), or None when it cannot be told."""
        if depth > 4:
            return None
        key = env_key(expr, self.imports)
        if key is not None:
            return self._from_env_key(key, expr)
        if type(expr) is cst.Call:
            return self._from_call(expr, func, depth)
        if type(expr) is cst.BinaryOperation:
            return self._from_arithmetic(expr, func, depth)
        name = dotted(expr)
        if name is None:
            return None
        if rank_scope(expr) is Scope.LOCAL:
            return Rank.LOCAL, name
        if "." in name:
            return self._from_attribute(name, depth)
        return self._from_name(name, func, depth)

    def _from_env_key(self, key: str, expr: cst.BaseExpression) -> tuple[Rank, str] | None:
        if key in GLOBAL_RANK_KEYS:
            return Rank.GLOBAL, self.module.code_for_node(expr)
        if key in LOCAL_RANK_KEYS:
            return Rank.LOCAL, self.module.code_for_node(expr)
        return None

    def _from_call(
        self, call: cst.Call, func: cst.FunctionDef | None, depth: int
    ) -> tuple[Rank, str] | None:
        name = self.imports.qualify(call.func)
        if name == "torch.distributed.get_rank":
            return Rank.GLOBAL, self.module.code_for_node(call)
        if name == "torch.distributed.get_node_local_rank":
            return Rank.LOCAL, self.module.code_for_node(call)
        if type(call.func) is cst.Name and call.func.value == "int" and call.args:
            return self.resolve(call.args[0].value, func, depth + 1)
        return None

    def _from_arithmetic(
        self, expr: cst.BinaryOperation, func: cst.FunctionDef | None, depth: int
    ) -> tuple[Rank, str] | None:
        if type(expr.operator) is cst.Modulo:
            # `rank % torch.cuda.device_count()`: the GPU index on this node.
            return Rank.LOCAL, "a modulo"
        if type(expr.operator) is cst.Add and any(
            type(side) is cst.BinaryOperation and type(side.operator) is cst.Multiply
            for side in (expr.left, expr.right)
        ):
            # `node_rank * gpus_per_node + gpu`: the global rank.
            return Rank.GLOBAL, self.module.code_for_node(expr)
        return None

    def _from_attribute(self, name: str, depth: int) -> tuple[Rank, str] | None:
        values = self.model.bindings.get(name, [])
        if values:
            # Attributes are bound in other methods: names there are out of scope.
            return self._combine([self.resolve(v, None, depth + 1) for v in values])
        head, _, last = name.rpartition(".")
        if head != "self" and last in {"rank", "global_rank", "world_rank"}:
            return Rank.GLOBAL, name  # `args.rank`: argparse's node or global rank
        return None

    def _from_name(
        self, name: str, func: cst.FunctionDef | None, depth: int
    ) -> tuple[Rank, str] | None:
        if name in function_parameters(func):
            return None
        scope: cst.CSTNode = func if func is not None else self.module
        values = self._assignments(scope, name)
        if not values and func is not None:
            scope, func = self.module, None
            values = self._assignments(scope, name)
        # `else: rank = 0` under `if distributed:` says nothing about the rank the
        # distributed branch holds: judge by the other assignments.
        values = self._assignments(scope, name, distributed_only=True) or values
        return self._combine([self.resolve(v, func, depth + 1) for v in values])

    def _assignments(
        self, scope: cst.CSTNode, name: str, distributed_only: bool = False
    ) -> list[cst.BaseExpression]:
        """Values assigned to `name` in `scope`: each scope read once for every name."""
        key = (id(scope), distributed_only)
        if key not in self._assigned:  # the entry keeps the scope alive: its id stays its own
            self._assigned[key] = (scope, assignments_by_name(scope, distributed_only))
        return self._assigned[key][1].get(name, [])

    @staticmethod
    def _combine(results: list[tuple[Rank, str] | None]) -> tuple[Rank, str] | None:
        """Global only when every assignment says so; anything unclear wins."""
        if results and all(r is not None and r[0] is Rank.GLOBAL for r in results):
            return results[0]
        if results and all(r is not None and r[0] is Rank.LOCAL for r in results):
            return results[0]
        return None
