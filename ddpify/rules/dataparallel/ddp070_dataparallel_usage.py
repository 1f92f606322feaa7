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
        if self.context.qualify(node.func) in DATA_PARALLEL:
            self.report(node.func)
