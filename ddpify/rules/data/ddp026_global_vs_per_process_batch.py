"""DDP026: a batch size or worker count that DDP applies to every process.

Off by default: a per-process batch is DDP's normal convention and most scripts mean
it, so the rule cannot tell a deliberate per-process value from a global one carried
over from DataParallel. It speaks only when nothing in the file divides by the world
size, or when a batch size is divided by the device count of one node (the pytorch/
examples ImageNet idiom, right on a single node only); see rules/DDP026.md.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.loaders import LoaderCall, names_in
from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.values import divides_by_world_size, is_per_node_count
from ddpify.diagnostics import Severity
from ddpify.rules.data._common import LoaderRule, is_distributed
from ddpify.walk import children

# Worker counts that take the whole machine: started once per process, they multiply.
_WHOLE_MACHINE = {"os.cpu_count", "multiprocessing.cpu_count", "os.sched_getaffinity"}
DATA_PARALLEL = "torch.nn.parallel.DataParallel"
# A name that says the batch is the job's: `args.total_batch_size`, `global_bs`.
_GLOBAL_NAME = re.compile(r"(global|total|overall|effective)_?(batch|bs)", re.I)
# An option's help that says so: "total batch size of all GPUs on the current node".
_GLOBAL_HELP = re.compile(
    r"\b(total|global)\b|all (the )?(gpus|devices|processes)|across (all )?(gpus|devices|ranks)",
    re.I,
)
# A name that holds a batch size: `args.batch_size`, `cfg.train.batchsize`, `bs`.
_BATCH_NAME = re.compile(r"batch_?size|(^|_)(bs|batch)$", re.I)
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"


class GlobalVsPerProcessBatch(LoaderRule):
    """Under DDP `batch_size` and `num_workers` count per process, not per job."""

    CODE = "DDP026"
    NAME = "global-vs-per-process-batch"
    SEVERITY = Severity.INFO
    MESSAGE = "`batch_size` applies to each process under DDP: the global batch is N× larger"
    DEFAULT_ENABLED = False

    def __init__(self, context) -> None:
        super().__init__(context)
        # Divisions of a batch size: (the division, its divisor), judged at the end.
        self.batch_divisions: list[tuple[cst.CSTNode, cst.BaseExpression]] = []

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if type(node.operator) in (cst.Divide, cst.FloorDivide) and _names_batch(node.left):
            self.batch_divisions.append((node, node.right))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        divides = type(node.operator) in (cst.DivideAssign, cst.FloorDivideAssign)
        if divides and _names_batch(node.target):
            self.batch_divisions.append((node, node.value))

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not is_distributed(model):
            return
        self._check_per_node_divisions()
        sharded = [
            loader
            for loader in self.facts.loaders
            if self.facts.distributed_sampler_of(loader) is not None and not loader.has_star_args
        ]
        if not sharded or _adapts_to_world_size(node):
            return
        for loader in sharded:
            self._check(loader)

    def _check_per_node_divisions(self) -> None:
        """`args.batch_size / ngpus_per_node`: the global batch split over one node's
        devices, which is the world size only when the job runs on one node."""
        if self._single_node():
            return
        for division, divisor in self.batch_divisions:
            if self._per_node(divisor):
                shown = self.context.code(division)
                if len(shown) > 60 or "\n" in shown:
                    shown = "… / " + self.context.code(divisor)
                self.report(division, _per_node_message(shown, self.context.code(divisor)))

    def _per_node(self, expr: cst.BaseExpression) -> bool:
        return is_per_node_count(expr, self.context.imports, self.context.model.bindings)

    def _single_node(self) -> bool:
        """The process group's size is itself the node's device count
        (`init_process_group(..., world_size=torch.cuda.device_count())`): the script
        runs on one node by construction, where that count is the world size."""
        for call in self.context.model.calls_to(INIT_PROCESS_GROUP):
            size = find_arg(call, "world_size", 3)
            if size is not None and self._per_node(size.value):
                return True
        return False

    def _check(self, loader: LoaderCall) -> None:
        size = loader.arg("batch_size")
        if size is not None and not size.star and self._meant_as_global(size.value):
            shown = self.context.code(size.value)
            self.report(size, _batch_message(shown))
        workers = find_arg(loader.call, "num_workers")
        if workers is not None and self._whole_machine(workers.value):
            self.report(workers, _workers_message(self.context.code(workers.value)))

    def _meant_as_global(self, expr: cst.BaseExpression) -> bool:
        """Evidence that the batch size was chosen for the whole job: the script still uses
        DataParallel, the name says "total"/"global", or its command-line help does."""
        if self.context.model.calls_any(DATA_PARALLEL):
            return True
        if any(_GLOBAL_NAME.search(name) for name in names_in(expr)):
            return True
        option = dotted(expr)
        return option is not None and self._help_says_global(option.rsplit(".", 1)[-1])

    def _help_says_global(self, dest: str) -> bool:
        """`parser.add_argument("--batch-size", help="total batch size of all GPUs")`."""
        for call in self.context.model.method_calls.get("add_argument", ()):
            flags = [string_value(arg.value) for arg in call.args if arg.keyword is None]
            dests = {flag.lstrip("-").replace("-", "_") for flag in flags if flag}
            explicit = find_arg(call, "dest")
            if explicit is not None:
                dests = {string_value(explicit.value) or ""}
            if dest not in dests:
                continue
            help_arg = find_arg(call, "help")
            text = _text(help_arg.value) if help_arg is not None else None
            if text and _GLOBAL_HELP.search(text):
                return True
        return False

    def _whole_machine(self, expr: cst.BaseExpression) -> bool:
        stack: list[cst.CSTNode] = [expr]
        while stack:
            node = stack.pop()
            if type(node) is cst.Call and self.context.qualify(node.func) in _WHOLE_MACHINE:
                return True
            stack.extend(children(node))
        return False


def _text(expr: cst.BaseExpression) -> str | None:
    """The literal text of a string, implicitly concatenated string or f-string."""
    if type(expr) in (cst.SimpleString, cst.ConcatenatedString):
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    if type(expr) is cst.FormattedString:
        return "".join(p.value for p in expr.parts if type(p) is cst.FormattedStringText)
    return None


def string_value(expr: cst.BaseExpression) -> str | None:
    value = expr.evaluated_value if type(expr) is cst.SimpleString else None
    return value if isinstance(value, str) else None


def _adapts_to_world_size(module: cst.Module) -> bool:
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if divides_by_world_size(node):
            return True
        stack.extend(children(node))
    return False


def _names_batch(expr: cst.BaseExpression) -> bool:
    """Whether a name or key in `expr` says it is a batch size."""
    for child in _nodes(expr):
        if type(child) is cst.Name and _BATCH_NAME.search(child.value):
            return True
        if type(child) is cst.SimpleString:
            value = child.evaluated_value
            if isinstance(value, str) and _BATCH_NAME.search(value):
                return True
    return False


def _nodes(root: cst.CSTNode, limit: int = 64) -> list[cst.CSTNode]:
    """The first `limit` nodes of `root`: a batch size is a short expression, and a long
    chain of divisions must not cost the square of its length."""
    found, stack = [], [root]
    while stack and len(found) < limit:
        node = stack.pop()
        found.append(node)
        stack.extend(children(node))
    return found


def _per_node_message(division: str, divisor: str) -> str:
    return (
        f"`{division}` splits the batch over the devices of one node (`{divisor}`), which is "
        "the world size only on a single node: on N nodes every process keeps that share and "
        "the global batch is N times larger; if the batch is meant for the whole job, divide "
        "by the world size (`dist.get_world_size()`)"
    )


def _batch_message(size: str) -> str:
    return (
        f"`batch_size={size}` is per process under DDP, so the global batch is world_size × "
        f"{size}; if it was meant as the global batch (as with DataParallel), divide it by the "
        "world size"
    )


def _workers_message(workers: str) -> str:
    return (
        f"`num_workers={workers}` starts that many loader workers in every process, so the "
        "machine runs world_size times as many; divide it by the number of processes per node"
    )
