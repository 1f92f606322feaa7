from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.batch_norm import BATCH_NORM, may_hold_batch_norm
from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.tree import rebound_between
from ddpify.diagnostics import Severity
from ddpify.rules.devices._common import DDP, DistributedRule

CONVERT_SYNC_BATCHNORM = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"


@dataclass(frozen=True)
class _Ordered:
    call: cst.Call
    function: cst.FunctionDef | None
    order: int
    names: frozenset[str]  # the wrapped model and the names the result is bound to


class BatchNormNotSynced(DistributedRule):
    """BatchNorm under DDP normalises with each rank's own batch statistics."""

    CODE = "DDP030"
    NAME = "batchnorm-not-synced"
    SEVERITY = Severity.INFO
    MESSAGE = "BatchNorm statistics stay per rank under DDP"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.order = 0
        # A call builds or is given a BatchNorm layer (`nn.BatchNorm2d(16)`,
        # `resnet(norm_layer=nn.BatchNorm2d)`): only then is the analysis asked.
        self.mentions_batch_norm = False
        self.wraps: list[_Ordered] = []
        self.conversions: list[_Ordered] = []

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        name = self.context.qualify(node.func)
        if not self.mentions_batch_norm and _mentions_batch_norm(node):
            self.mentions_batch_norm = True
        if name == DDP:
            module = find_arg(node, "module", 0)
            names = {dotted(module.value)} if module is not None else set()
            names |= self._assigned_to(node)
            self.wraps.append(self._ordered(node, names))
        elif name == CONVERT_SYNC_BATCHNORM and node.args:
            self.conversions.append(self._ordered(node, {dotted(node.args[0].value)}))

    def _ordered(self, call: cst.Call, names: set[str | None]) -> _Ordered:
        named = frozenset(n for n in names if n is not None)
        return _Ordered(call, self.enclosing_function(), self.order, named)

    def _assigned_to(self, call: cst.Call) -> set[str | None]:
        parent = self.context.ancestors[-2] if len(self.context.ancestors) > 1 else None
        if type(parent) is cst.Assign and parent.value is call:
            return {dotted(target.target) for target in parent.targets}
        return set()

    def leave_Module(self, node: cst.Module) -> None:
        if not self.is_distributed() or not self.wraps:
            return
        if not self.conversions:
            if self.mentions_batch_norm:
                for wrap in self.wraps:
                    model = find_arg(wrap.call, "module", 0)
                    # The one answer the wrap pass converts by (analysis/batch_norm.py).
                    if model is not None and may_hold_batch_norm(self.context.tree, model.value):
                        self._report_unsynced(wrap)
            return
        for conversion in self.conversions:
            if self._converts_after_wrap(conversion):
                self.report(
                    conversion.call,
                    f"`{self._shown(conversion.call)}` runs after the model is wrapped in DDP; "
                    "convert the model before wrapping it",
                    severity=Severity.ERROR,
                )

    def _report_unsynced(self, wrap: _Ordered) -> None:
        model = find_arg(wrap.call, "module", 0)
        shown = self._shown(model.value) if model is not None else "the model"
        self.report(
            wrap.call,
            f"`{shown}` is wrapped in DDP with BatchNorm layers whose statistics stay per rank; "
            f"if per-GPU batches are small, apply `nn.SyncBatchNorm.convert_sync_batchnorm` "
            "before the wrap (on CUDA only)",
        )

    def _converts_after_wrap(self, conversion: _Ordered) -> bool:
        return any(
            wrap.function is conversion.function
            and wrap.order < conversion.order
            and any(
                # `net = checkpoint["net"]` between them: a fresh module, not the wrapped one.
                not rebound_between(self.context.tree, name, wrap.call, conversion.call)
                for name in wrap.names & conversion.names
            )
            for wrap in self.wraps
        )

    def _shown(self, node: cst.CSTNode) -> str:
        code = self.context.code(node)
        return code if len(code) <= 60 and "\n" not in code else "the model"


def _mentions_batch_norm(call: cst.Call) -> bool:
    """`nn.BatchNorm2d(16)`, or a BatchNorm class among the arguments (asked of every
    call: a string test on each last identifier before the pattern)."""
    for expr in (call.func, *(arg.value for arg in call.args)):
        kind = type(expr)  # exact types: see ddpify.walk.is_kind
        if kind is cst.Attribute:
            last = expr.attr.value
        elif kind is cst.Name:
            last = expr.value
        else:
            continue
        if "BatchNorm" in last and BATCH_NORM.match(last):
            return True
    return False
