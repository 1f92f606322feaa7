"""DDP026: a batch size or worker count that DDP applies to every process.

Off by default: a per-process batch is DDP's normal convention and most scripts mean
it, so the rule cannot tell a deliberate per-process value from a global one carried
over from DataParallel. It speaks only when nothing in the file divides by the world
size; see rules/DDP026.md.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.loaders import LoaderCall, names_in
from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.values import divides_by_world_size
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


class GlobalVsPerProcessBatch(LoaderRule):
    """Under DDP `batch_size` and `num_workers` count per process, not per job."""

    CODE = "DDP026"
    NAME = "global-vs-per-process-batch"
    SEVERITY = Severity.INFO
    MESSAGE = "`batch_size` applies to each process under DDP: the global batch is N× larger"
    DEFAULT_ENABLED = False

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not is_distributed(model):
            return
        sharded = [
            loader
            for loader in self.facts.loaders
            if self.facts.distributed_sampler_of(loader) is not None and not loader.has_star_args
        ]
        if not sharded or _adapts_to_world_size(node):
            return
        for loader in sharded:
            self._check(loader)

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
            if isinstance(node, cst.Call) and self.context.qualify(node.func) in _WHOLE_MACHINE:
                return True
            stack.extend(children(node))
        return False


def _text(expr: cst.BaseExpression) -> str | None:
    """The literal text of a string, implicitly concatenated string or f-string."""
    if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    if isinstance(expr, cst.FormattedString):
        return "".join(p.value for p in expr.parts if isinstance(p, cst.FormattedStringText))
    return None


def string_value(expr: cst.BaseExpression) -> str | None:
    value = expr.evaluated_value if isinstance(expr, cst.SimpleString) else None
    return value if isinstance(value, str) else None


def _adapts_to_world_size(module: cst.Module) -> bool:
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if divides_by_world_size(node):
            return True
        stack.extend(children(node))
    return False


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
