"""Pass, wrap (after wrap.py): tests for DataParallel that a DDP wrapper would fail.

`isinstance(model, nn.DataParallel)` (or `type(model) == nn.DataParallel`) guards the
`.module` unwrap before a save, in an EMA helper, before calling the model's own
methods. Once the model is a DDP wrapper the test is false and the unwrap is skipped:
the checkpoint's keys gain `module.`, an EMA's shadow names change, a method call raises
AttributeError. Each such test in the project (analysis/wrapper_tests.py) also names
DistributedDataParallel, so it holds for both wrappers; a module that imports nothing
DDP can be named by gets it imported.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.roles import data_parallel_subclasses, ddp_wrapper_names, wrapper_receivers
from ddpify.analysis.tree import Tree
from ddpify.analysis.wrapper_tests import (
    DDP,
    DataParallelTest,
    data_parallel_test,
    rewraps_under_ddp,
    skips_unwrap_under_ddp,
)
from ddpify.migrate.analyze import Plan
from ddpify.migrate.edits import Edits

NAME = "wrap"


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if not plan.shape.converts or not {"isinstance", "type"} & tree.names():
        return edits
    subclasses = data_parallel_subclasses(tree)
    for node in _candidate_tests(tree):
        test = data_parallel_test(node, tree.qualify, subclasses)
        if test is None:
            continue
        ancestors = tree.ancestors(node)[:-1]
        if rewraps_under_ddp(test, ancestors, tree.qualify) and _handed_a_wrapper(tree, test):
            plan.needs_human(
                "this tests for DataParallel and its branch builds a DataParallel again, so "
                "the DDP wrapper takes the other branch, written for a plain model; make that "
                "branch unwrap `.module` first",
                tree.code(tree.statement(node)),
            )
            continue
        if not skips_unwrap_under_ddp(test, ancestors, tree.qualify):
            continue
        ddp = _ddp_spelling(tree, plan)
        edits.replace(*test.edit(ddp))
        widened = test.widened(ddp)
        plan.change(
            NAME,
            "the test for DataParallel also accepts the DDP wrapper, so the `.module` it "
            "unwraps is still the model's own (state_dict keys without a `module.` prefix)",
            tree.code(widened),
            "DDP036",
        )
    return edits


def _candidate_tests(tree: Tree) -> list:
    """`isinstance(...)` calls and comparisons of `type(...)`, in source order."""
    calls = [call for call, path, _ in tree.call_names() if path == "isinstance"]
    if "type" not in tree.names():
        return calls
    compared = tree.find(cst.Comparison)  # data_parallel_test reads each one's shape only
    return sorted(calls + compared, key=tree.order.__getitem__)


def _handed_a_wrapper(tree: Tree, test: DataParallelTest) -> bool:
    """Whether the tested name holds a DDP wrapper, or is a parameter of a function some
    call hands one (a `convert_model` the project only ever gives a plain model is not
    reached by a wrapper, so its DataParallel branch needs no one's attention)."""
    names = ddp_wrapper_names(tree)
    tested = dotted(test.tested)
    function = tree.function(test.node)
    if function is None or tested not in [p.name.value for p in function.params.params]:
        return tested in names
    receivers = wrapper_receivers(tree, names)
    return tested in receivers.get(function.name.value, ())


def _ddp_spelling(tree: Tree, plan: Plan) -> str:
    """The module's own name for DistributedDataParallel, or the one the imports pass adds."""
    alias = tree.alias_for(DDP)
    if alias is not None:
        return alias
    plan.needs.add("ddp")
    return plan.ddp
