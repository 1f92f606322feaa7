from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.wrapper_tests import (
    DATA_PARALLEL,
    DDP,
    DataParallelTest,
    data_parallel_test,
    skips_unwrap_under_ddp,
)
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.wrapping._common import WrapperRule


class DataParallelOnlyTest(WrapperRule):
    """`isinstance(model, nn.DataParallel)` (`type(model) == nn.DataParallel`) in a file
    that wraps in DDP: false for the
    DDP wrapper, so the `.module` unwrap it guards is skipped (analysis/wrapper_tests.py)."""

    CODE = "DDP036"
    NAME = "isinstance-dataparallel-only"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "this tests for DataParallel only; a DDP wrapper fails it, so the `.module` "
        "unwrap it guards is skipped"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.tests: list[DataParallelTest] = []

    def visit_Call(self, node: cst.Call) -> None:
        if self.wrappers.callee is not None:
            return  # `isinstance` is a builtin: nothing imported qualifies to it
        self._note(node)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self._note(node)  # `type(model) == nn.DataParallel`

    def _note(self, node: cst.BaseExpression) -> None:
        test = data_parallel_test(node, self.context.qualify)
        if test is None:
            return
        if skips_unwrap_under_ddp(test, self.context.ancestors[:-1], self.context.qualify):
            self.tests.append(test)

    def leave_Module(self, node: cst.Module) -> None:
        if not self.tests or not self.speaks():
            return
        wrapped = self.wrappers.wrapped_names()
        # A file that makes DataParallel wrappers too may test for one of those on purpose;
        # there, only a test of a name that holds a DDP wrapper is known to be wrong.
        makes_data_parallel = self.context.model.calls_any(DATA_PARALLEL)
        for test in self.tests:
            if makes_data_parallel and dotted(test.tested) not in wrapped:
                continue
            self.report(test.node, self._message(test), fix=self._fix(test))

    def _message(self, test: DataParallelTest) -> str:
        return (
            f"`{self.shown(test.node)}` is {'true' if test.negated else 'false'} for a DDP "
            "wrapper, so the `.module` unwrap "
            "it guards is skipped under DDP: a saved state_dict gains the `module.` prefix "
            "and the model's own methods raise AttributeError; accept "
            "DistributedDataParallel too"
        )

    def _fix(self, test: DataParallelTest) -> NodeFix | None:
        ddp = self.context.tree.alias_for(DDP)
        if ddp is None:
            return None
        return NodeFix(
            f"Also accept `{ddp}`",
            (test.edit(ddp),),
            Applicability.SAFE,
        )
