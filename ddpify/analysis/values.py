"""What a value is made of, as far as one file shows: whether it differs between the
processes of a job (a rank, the clock, the process id), whether it is divided by the
world size, and whether an expression picks the CPU when CUDA is missing.

Names are followed through the file's bindings (`seed = args.seed + rank`) a few levels
deep, without scope analysis, like the rest of the script model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import libcst as cst

from ddpify.analysis.guards import rank_scope
from ddpify.analysis.names import ImportMap, dotted
from ddpify.walk import children

# Calls whose result differs from one process to the next even with equal inputs.
_CLOCK_CALLS = {
    "time.time": "the clock",
    "time.time_ns": "the clock",
    "time.perf_counter": "the clock",
    "time.monotonic": "the clock",
    "datetime.datetime.now": "the clock",
    "datetime.datetime.utcnow": "the clock",
    "os.getpid": "the process id",
}
_MAX_DEPTH = 3

_WORLD_WORD = re.compile(
    r"world|replicas|nprocs?$|num_proc|num_processes|^n_?gpus?$|num_gpus?|ngpus|^gpus$"
    r"|device_count|num_devices|n_devices|local_world",
    re.I,
)
# Tests that ask whether CUDA can be used: `torch.cuda.is_available()`, `use_cuda`,
# `args.no_cuda`, `args.cpu`, `torch.cuda.device_count() > 0`.
_CUDA_TEST_WORD = re.compile(r"cuda|gpu|(^|_)cpu($|_)|device_count|is_available", re.I)


def _nodes(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(children(node))


def _references(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Like `_nodes`, but `args.seed`'s `seed` and `f(seed=...)`'s `seed`, which name no
    variable of their own, are left out."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (cst.Attribute, cst.Arg)):
            stack.append(node.value)
        else:
            stack.extend(children(node))


def per_process_source(
    expr: cst.BaseExpression,
    imports: ImportMap,
    bindings: Mapping[str, Sequence[cst.BaseExpression]],
    depth: int = 0,
) -> str | None:
    """Why `expr` differs between the processes of a job: "the rank", "the clock", "the
    process id"; None when nothing in it does (as far as the file shows).

    `args.seed + rank`, `int(time.time())`, `seed` bound to `base + dist.get_rank()`.
    """
    for node in _references(expr):
        if isinstance(node, cst.Call):
            source = _CLOCK_CALLS.get(imports.qualify(node.func) or "")
            if source is not None:
                return source
        if isinstance(node, (cst.Name, cst.Attribute, cst.Call)) and rank_scope(node):
            return "the rank"
        if depth < _MAX_DEPTH and isinstance(node, (cst.Name, cst.Attribute)):
            name = dotted(node)
            for value in bindings.get(name, ()) if name else ():
                source = per_process_source(value, imports, bindings, depth + 1)
                if source is not None:
                    return source
    return None


def mentions_world_size(node: cst.CSTNode) -> bool:
    """Whether an identifier or string in `node` names the world size or the GPU count."""
    for child in _nodes(node):
        if isinstance(child, cst.Name) and _WORLD_WORD.search(child.value):
            return True
        if isinstance(child, cst.SimpleString):
            value = child.evaluated_value
            if isinstance(value, str) and _WORLD_WORD.search(value):
                return True
    return False


def divides_by_world_size(node: cst.CSTNode) -> bool:
    """`x // world_size`, `int(x / ngpus_per_node)`, `x /= dist.get_world_size()`."""
    if isinstance(node, cst.BinaryOperation):
        return isinstance(node.operator, (cst.Divide, cst.FloorDivide)) and mentions_world_size(
            node.right
        )
    if isinstance(node, cst.AugAssign):
        return isinstance(
            node.operator, (cst.DivideAssign, cst.FloorDivideAssign)
        ) and mentions_world_size(node.value)
    return False


def is_cuda_test(test: cst.BaseExpression) -> bool:
    """Whether a condition asks if CUDA is usable (`torch.cuda.is_available()`, `use_cuda`,
    `args.no_cuda`, `args.cpu`)."""
    return any(
        isinstance(node, cst.Name) and _CUDA_TEST_WORD.search(node.value) for node in _nodes(test)
    )


def is_cpu_device(expr: cst.BaseExpression, imports: ImportMap) -> bool:
    """`"cpu"` or `torch.device("cpu")`."""
    if isinstance(expr, cst.Call) and imports.qualify(expr.func) == "torch.device" and expr.args:
        expr = expr.args[0].value
    return isinstance(expr, cst.SimpleString) and expr.evaluated_value == "cpu"


def falls_back_to_cpu(node: cst.CSTNode, imports: ImportMap) -> bool:
    """Whether `node` picks the CPU when CUDA is missing: `"cuda" if use_cuda else "cpu"`,
    or an `if torch.cuda.is_available(): ... else: device = "cpu"`."""
    if isinstance(node, cst.IfExp):
        # Two expressions: cheaper to look at than the test, and rarely the CPU.
        branches: list[cst.CSTNode] = [node.body, node.orelse]
        return any(_assigns_cpu(b, imports) for b in branches) and is_cuda_test(node.test)
    if isinstance(node, cst.If):
        branches = [node.body, *([node.orelse] if node.orelse is not None else [])]
        return is_cuda_test(node.test) and any(_assigns_cpu(b, imports) for b in branches)
    return False


def _assigns_cpu(branch: cst.CSTNode, imports: ImportMap) -> bool:
    if isinstance(branch, cst.BaseExpression):
        return is_cpu_device(branch, imports)
    for node in _nodes(branch):
        if isinstance(node, (cst.Assign, cst.AnnAssign)) and node.value is not None:
            if is_cpu_device(node.value, imports):
                return True
    return False


# The number of devices (or processes) on one node, never the whole job's: right as the
# world size only when the job runs on one node.
_PER_NODE_CALLS = frozenset(
    {"torch.cuda.device_count", "torch.xpu.device_count", "torch.accelerator.device_count"}
)
_PER_NODE_WORD = re.compile(r"per_?node|local_world_size|local_size$", re.I)
_PER_NODE_ENV = frozenset({"LOCAL_WORLD_SIZE", "NPROC_PER_NODE"})


def is_per_node_count(
    expr: cst.BaseExpression,
    imports: ImportMap,
    bindings: Mapping[str, Sequence[cst.BaseExpression]],
    depth: int = 0,
) -> bool:
    """Whether `expr` is the device count of one node: `torch.cuda.device_count()`,
    `ngpus_per_node`, `int(os.environ["LOCAL_WORLD_SIZE"])`, or a name every binding of
    which is one (`ngpus = torch.cuda.device_count()`).

    A value built from it is not (`args.world_size = ngpus_per_node * args.world_size`
    counts every node), so only whole aliases are followed."""
    if isinstance(expr, cst.Call):
        name = imports.qualify(expr.func)
        if name in _PER_NODE_CALLS:
            return True
        if name is None and dotted(expr.func) == "int" and len(expr.args) == 1:
            return is_per_node_count(expr.args[0].value, imports, bindings, depth)
        return _environ_key(expr, imports) in _PER_NODE_ENV
    if isinstance(expr, cst.Subscript):
        return _environ_key(expr, imports) in _PER_NODE_ENV
    name = dotted(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
    if name is None:
        return False
    if _PER_NODE_WORD.search(name.rsplit(".", 1)[-1]):
        return True
    values = bindings.get(name, ())
    return (
        depth < _MAX_DEPTH
        and bool(values)
        and all(is_per_node_count(value, imports, bindings, depth + 1) for value in values)
    )


def _environ_key(expr: cst.BaseExpression, imports: ImportMap) -> str | None:
    """`"KEY"` of `os.environ["KEY"]`, `os.environ.get("KEY", ...)`, `os.getenv("KEY")`."""
    key: cst.BaseExpression | None = None
    if isinstance(expr, cst.Subscript) and imports.qualify(expr.value) == "os.environ":
        element = expr.slice[0].slice if len(expr.slice) == 1 else None
        key = element.value if isinstance(element, cst.Index) else None
    elif isinstance(expr, cst.Call) and expr.args:
        if imports.qualify(expr.func) in {"os.environ.get", "os.getenv"}:
            key = expr.args[0].value
    value = key.evaluated_value if isinstance(key, cst.SimpleString) else None
    return value if isinstance(value, str) else None


def only_value_in_function(tree, near: cst.CSTNode, name: str) -> cst.BaseExpression | None:
    """The value `name` is bound to by the one plain assignment of it in the function
    around `near` (`net = getattr(self, "net" + name)`); None when there is no function,
    or no such assignment, or several."""
    func = tree.function(near)
    if func is None:
        return None
    values = [
        assign.value
        for assign in tree.within(func, cst.Assign)
        if any(dotted(target.target) == name for target in assign.targets)
    ]
    return values[0] if len(values) == 1 else None
