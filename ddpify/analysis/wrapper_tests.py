"""Type tests for DataParallel alone: `isinstance(model, nn.DataParallel)`,
`type(model) == nn.DataParallel` (`is`, `!=`, `is not`).

Research code unwraps its model before saving or calling its own methods with
`model.module if isinstance(model, nn.DataParallel) else model`. A DDP wrapper is not a
DataParallel, so under DDP the test is false and the unwrap is skipped: checkpoints gain
the `module.` prefix and `model.generate(...)` raises AttributeError. A test that also
names DistributedDataParallel (in its class tuple, or beside it in an `or` chain), or
that asks `hasattr(model, "module")` there, holds for both wrappers.

Only a test that decides an unwrap counts (its `if` reads `<tested>.module`): an
`assert isinstance(x, DataParallel)` checks a type, it does not unwrap, and a branch that
wraps the module in a DataParallel again is DataParallel's own code.

The wrapping rule DDP036 reports such tests in a file that wraps in DDP; migrate's unwrap
pass widens them once DataParallel has become DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.walk import walk

DDP = "torch.nn.parallel.DistributedDataParallel"
DATA_PARALLEL = "torch.nn.parallel.DataParallel"

Qualify = Callable[[cst.BaseExpression], "str | None"]
_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


@dataclass(frozen=True)
class DataParallelTest:
    """One test for DataParallel that a DDP wrapper fails: `isinstance(tested, classes)`,
    or a comparison of `type(tested)` with them (`type(m) == nn.DataParallel`, `is`,
    `!=`, `is not`, `in (...)`, `not in (...)`)."""

    node: cst.BaseExpression  # the isinstance call or the comparison
    tested: cst.BaseExpression
    classes: cst.BaseExpression  # the class argument: a name, or a tuple of them

    @property
    def negated(self) -> bool:
        """`type(m) != DataParallel`: true, not false, for a DDP wrapper."""
        return type(self.node) is cst.Comparison and type(self.node.comparisons[0].operator) in (
            cst.NotEqual,
            cst.IsNot,
            cst.NotIn,
        )

    def edit(self, ddp: str) -> tuple[cst.BaseExpression, cst.BaseExpression]:
        """(node, replacement) that adds the DDP class `ddp` (as spelled in the module):
        `isinstance(m, nn.DataParallel)`'s class becomes `(nn.DataParallel, DDP)`,
        `type(m) == A` becomes `type(m) in (A, DDP)`, `type(m) is not A` becomes
        `type(m) not in (A, DDP)`."""
        added = cst.Element(cst.parse_expression(ddp))
        if type(self.classes) is cst.Tuple:
            *first, last = self.classes.elements
            elements = [*first, last.with_changes(comma=_COMMA), added]
            classes = self.classes.with_changes(elements=elements)
        else:
            classes = cst.Tuple([cst.Element(self.classes, comma=_COMMA), added])
        if type(self.node) is not cst.Comparison:
            return self.classes, classes
        target = self.node.comparisons[0]
        operator = _MEMBERSHIP[type(target.operator)]
        typed = self.node.left if _type_of(self.node.left) is not None else target.comparator
        changed = target.with_changes(operator=operator, comparator=classes)
        return self.node, self.node.with_changes(left=typed, comparisons=[changed])

    def widened(self, ddp: str) -> cst.BaseExpression:
        """The whole test once it accepts `ddp` too."""
        old, new = self.edit(ddp)
        if old is self.node:
            return new
        second = self.node.args[1].with_changes(value=new)  # type: ignore[attr-defined]
        return self.node.with_changes(args=[self.node.args[0], second])  # type: ignore[attr-defined]


_SPACED = {
    "whitespace_before": cst.SimpleWhitespace(" "),
    "whitespace_after": cst.SimpleWhitespace(" "),
}
# What a comparison of `type(m)` becomes once it names two classes.
_MEMBERSHIP = {
    cst.Equal: cst.In(**_SPACED),
    cst.Is: cst.In(**_SPACED),
    cst.In: cst.In(**_SPACED),
    cst.NotEqual: cst.NotIn(whitespace_between=cst.SimpleWhitespace(" "), **_SPACED),
    cst.IsNot: cst.NotIn(whitespace_between=cst.SimpleWhitespace(" "), **_SPACED),
    cst.NotIn: cst.NotIn(whitespace_between=cst.SimpleWhitespace(" "), **_SPACED),
}


def data_parallel_test(
    node: cst.BaseExpression, qualify: Qualify, subclasses: Iterable[str] = ()
) -> DataParallelTest | None:
    """`node` as a test for DataParallel (or one of the project's subclasses of it, by
    short name) that names no DDP class: an `isinstance` call or a comparison of
    `type(m)`; else None."""
    parts = _isinstance_parts(node) if type(node) is cst.Call else _type_comparison_parts(node)
    if parts is None:
        return None
    tested, classes = parts
    if type(classes) is cst.Tuple:
        if any(type(element) is not cst.Element for element in classes.elements):
            return None  # `(*bases, DataParallel)`: what else it holds is not known
        named = [element.value for element in classes.elements]
    else:
        named = [classes]
    qualified = [qualify(node) for node in named]
    if DDP in qualified:
        return None
    shorts = set(subclasses)
    if not any(
        name == DATA_PARALLEL or (dotted(node) or "").rsplit(".", 1)[-1] in shorts
        for node, name in zip(named, qualified)
    ):
        return None
    return DataParallelTest(node, tested, classes)


def _isinstance_parts(call: cst.Call) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(tested, classes) of `isinstance(tested, classes)`."""
    if dotted(call.func) != "isinstance" or len(call.args) != 2:
        return None
    if any(arg.keyword is not None or arg.star for arg in call.args):
        return None
    return call.args[0].value, call.args[1].value


def _type_comparison_parts(
    node: cst.CSTNode,
) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(tested, classes) of `type(tested) == classes` (`is`, `!=`, `is not`, `in`,
    `not in`), or of `classes == type(tested)`."""
    if type(node) is not cst.Comparison or len(node.comparisons) != 1:
        return None
    target = node.comparisons[0]
    if type(target.operator) not in _MEMBERSHIP:
        return None
    tested = _type_of(node.left)
    if tested is not None:
        return tested, target.comparator
    tested = _type_of(target.comparator)
    if tested is not None and type(target.operator) not in (cst.In, cst.NotIn):
        return tested, node.left
    return None


def _type_of(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """`m` of `type(m)`."""
    if type(expr) is not cst.Call or dotted(expr.func) != "type" or len(expr.args) != 1:
        return None
    arg = expr.args[0]
    return arg.value if arg.keyword is None and not arg.star else None


# What the `if` a test decides does with the tested model (`decided_by`).
UNWRAP = "unwrap"  # reads `<tested>.module`
REWRAP = "rewrap"  # and builds a DataParallel again: DataParallel's own code


def skips_unwrap_under_ddp(
    test: DataParallelTest, ancestors: Sequence[cst.CSTNode], qualify: Qualify
) -> bool:
    """Whether the unwrap the test decides is skipped for a DDP wrapper: it decides one,
    and nothing beside it in its `or` chain accepts DDP. `ancestors`: the call's, from
    the module down, the call excluded."""
    return decided_by(test, ancestors) == UNWRAP and not covered_beside(test, ancestors, qualify)


def rewraps_under_ddp(
    test: DataParallelTest, ancestors: Sequence[cst.CSTNode], qualify: Qualify
) -> bool:
    """Whether the test decides DataParallel's own code (its branch wraps the module in a
    DataParallel again, a sync-BatchNorm `convert_model`, an EMA's `ema_copy`): a DDP
    wrapper must not go through it, and takes the other branch, written for a plain
    model. Widening the test is wrong there; a human must look."""
    return decided_by(test, ancestors) == REWRAP and not covered_beside(test, ancestors, qualify)


def decided_by(test: DataParallelTest, ancestors: Sequence[cst.CSTNode]) -> str | None:
    """UNWRAP when the `if` (or conditional expression) the test is the condition of
    reads `<tested>.module` in one of its branches, REWRAP when that branch also builds a
    DataParallel, else None: an `assert isinstance(...)`, or a test of a loss module that
    only changes how a value is reduced, decides no unwrap."""
    tested = dotted(test.tested)
    if tested is None:
        return None
    for node in reversed(ancestors):
        if type(node) in (cst.If, cst.IfExp):
            branches = [node.body, node.orelse]
            break
        if type(node) not in (cst.BooleanOperation, cst.UnaryOperation):
            return None
    else:
        return None
    unwraps, rewraps = [], []

    def enter(node: cst.CSTNode) -> None:
        if type(node) is cst.Attribute and node.attr.value == "module":
            if dotted(node.value) == tested:
                unwraps.append(node)
        elif type(node) is cst.Call and _builds_data_parallel(node):
            rewraps.append(node)

    for branch in branches:
        if branch is not None:
            walk(branch, enter, lambda node: None)
    if not unwraps:
        return None
    return REWRAP if rewraps else UNWRAP


def _builds_data_parallel(call: cst.Call) -> bool:
    """`DataParallel(...)`, `DataParallelWithCallback(...)`, a subclass by its name."""
    short = (dotted(call.func) or "").rsplit(".", 1)[-1]
    return "DataParallel" in short and "Distributed" not in short


def covered_beside(
    test: DataParallelTest, ancestors: Sequence[cst.CSTNode], qualify: Qualify
) -> bool:
    """Whether the `or` chain around the test (its ancestors, innermost last, the call
    excluded) also accepts a DDP wrapper: `isinstance(m, DDP)` or `hasattr(m, "module")`."""
    chain = None
    for node in reversed(ancestors):
        if type(node) is cst.BooleanOperation and type(node.operator) is cst.Or:
            chain = node
        elif type(node) not in (cst.BooleanOperation, cst.UnaryOperation):
            break
    if chain is None:
        return False
    found = []

    def enter(node: cst.CSTNode) -> None:
        if node is not test.node and _accepts_ddp(node, qualify):
            found.append(node)

    walk(chain, enter, lambda node: None)
    return bool(found)


def _accepts_ddp(node: cst.CSTNode, qualify: Qualify) -> bool:
    """`isinstance(m, DDP)`, `type(m) == DDP` (or a tuple holding it), `hasattr(m, "module")`."""
    if type(node) is cst.Comparison:
        parts = _type_comparison_parts(node)
        negated = type(node.comparisons[0].operator) in (cst.NotEqual, cst.IsNot, cst.NotIn)
        return parts is not None and not negated and _names_ddp(parts[1], qualify)
    if type(node) is not cst.Call:
        return False
    name = dotted(node.func)
    if name == "hasattr" and len(node.args) == 2:
        value = node.args[1].value
        return type(value) is cst.SimpleString and value.evaluated_value == "module"
    if name != "isinstance" or len(node.args) != 2:
        return False
    return _names_ddp(node.args[1].value, qualify)


def _names_ddp(classes: cst.BaseExpression, qualify: Qualify) -> bool:
    named = [e.value for e in classes.elements] if type(classes) is cst.Tuple else [classes]
    return any(qualify(node) == DDP for node in named)
