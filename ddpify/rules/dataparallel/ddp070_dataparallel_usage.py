import libcst as cst

from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule

DATA_PARALLEL = ("torch.nn.parallel.DataParallel", "torch.nn.parallel.data_parallel")


class DataParallelUsage(Rule):
    """`nn.DataParallel` runs one process that scatters each batch over the GPUs."""

    CODE = "DDP070"
    NAME = "dataparallel-usage"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`DataParallel` is single-process and slower than DistributedDataParallel; "
        "`ddpify migrate` converts it"
    )

    def visit_Call(self, node: cst.Call) -> None:
        if self.context.qualify(node.func) in DATA_PARALLEL and not _one_device(node):
            self.report(node.func)


def _one_device(call: cst.Call) -> bool:
    """`device_ids=[LOCAL_RANK]` (perhaps `... if torch.cuda.is_available() else None`):
    DataParallel over one device only calls its module, scattering nothing; ddpify
    migrate leaves a helper's EMA copies so, in each process of a DDP run."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "device_ids":
            value = arg.value
            if isinstance(value, cst.IfExp) and _is_none(value.orelse):
                value = value.body
            return isinstance(value, cst.List) and len(value.elements) == 1
    return False


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"
