"""Which micro-step of a gradient-accumulation window a test picks.

`(i + 1) % accum == 0` picks the last micro-step of each window (counting from 0),
`i % accum == 0` the first. The optimizer must step on the micro-step whose backward
all-reduced (the one outside `no_sync`); when the two tests pick different micro-steps,
the step applies gradients that were accumulated without synchronisation and differ
between ranks. These helpers read such tests; DDP040 compares them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.model import ScriptModel
from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.training import (
    _ACCUMULATION,
    accumulation_test,
    is_optimizer_step,
    names_of,
    own_nodes,
)
from ddpify.walk import children


@dataclass(frozen=True)
class Phase:
    """`(counter + offset) % divisor == 0` when `on_zero`, `!= 0` otherwise. `counter`
    and `divisor` are the last parts of their names (`batch_idx`, `accum_grad`), so a
    test written in a method on `self.accum_grad` compares with one on `accum_grad`."""

    counter: str
    offset: int
    divisor: str
    on_zero: bool

    def negated(self) -> Phase:
        return Phase(self.counter, self.offset, self.divisor, not self.on_zero)

    def same_window(self, other: Phase) -> bool:
        return self.counter == other.counter and self.divisor == other.divisor

    def shown(self) -> str:
        counter = self.counter
        if self.offset:
            sign = "+" if self.offset > 0 else "-"
            counter = f"({counter} {sign} {abs(self.offset)})"
        return f"{counter} % {self.divisor} {'==' if self.on_zero else '!='} 0"


def phase_of(test: cst.BaseExpression, model: ScriptModel | None = None) -> Phase | None:
    """The phase a test picks, or None when it is anything but one plain modulo test
    (`not t`, and a name bound once to such a test, are followed)."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = phase_of(test.expression, model)
        return inner.negated() if inner is not None else None
    if isinstance(test, cst.Name) and model is not None:
        values = model.bindings.get(test.value, [])
        return phase_of(values[0]) if len(values) == 1 else None
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    target = test.comparisons[0]
    if not isinstance(target.operator, (cst.Equal, cst.NotEqual)):
        return None
    if not (isinstance(target.comparator, cst.Integer) and target.comparator.value == "0"):
        return None
    modulo = test.left
    if not (isinstance(modulo, cst.BinaryOperation) and isinstance(modulo.operator, cst.Modulo)):
        return None
    divisor = dotted(modulo.right)
    if divisor is None or not _ACCUMULATION.search(divisor.rsplit(".", 1)[-1]):
        return None
    counted = _counter_and_offset(modulo.left)
    if counted is None:
        return None
    counter, offset = counted
    last = divisor.rsplit(".", 1)[-1]
    return Phase(counter, offset, last, isinstance(target.operator, cst.Equal))


def _counter_and_offset(expr: cst.BaseExpression) -> tuple[str, int] | None:
    """`i` -> (i, 0); `i + 1` / `1 + i` -> (i, 1); `i - 1` -> (i, -1)."""
    name = dotted(expr)
    if name is not None:
        return name.rsplit(".", 1)[-1], 0
    if not isinstance(expr, cst.BinaryOperation):
        return None
    if not isinstance(expr.operator, (cst.Add, cst.Subtract)):
        return None
    sign = 1 if isinstance(expr.operator, cst.Add) else -1
    left, right = dotted(expr.left), expr.right
    if left is not None and isinstance(right, cst.Integer):
        return left.rsplit(".", 1)[-1], sign * int(right.value)
    if sign == 1 and isinstance(expr.left, cst.Integer) and dotted(expr.right) is not None:
        return dotted(expr.right).rsplit(".", 1)[-1], int(expr.left.value)  # type: ignore[union-attr]
    return None


def no_sync_choice(ancestors: Sequence[cst.CSTNode]) -> tuple[cst.BaseExpression, bool] | None:
    """For a `no_sync` mention: the test that chooses it and whether it is chosen when
    the test holds. `model.no_sync if t else nullcontext` -> (t, True); `nullcontext() if
    t else model.no_sync()` -> (t, False); `if t: ctx = model.no_sync` -> (t, True)."""
    for parent, child in zip(reversed(ancestors[:-1]), reversed(ancestors[1:])):
        if isinstance(parent, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            return None
        if isinstance(parent, cst.IfExp) and child is not parent.test:
            return parent.test, child is parent.body
        if isinstance(parent, cst.If) and child is not parent.test:
            return parent.test, child is parent.body
    return None


def synced_phase(
    ancestors: Sequence[cst.CSTNode], model: ScriptModel | None = None
) -> Phase | None:
    """The micro-steps that all-reduce: those where the `no_sync` (whose ancestry this
    is) is not chosen."""
    choice = no_sync_choice(ancestors)
    if choice is None:
        return None
    test, when_true = choice
    phase = phase_of(test, model)
    if phase is None:
        return None
    return phase.negated() if when_true else phase


def flag_synced_phase(
    ancestors: Sequence[cst.CSTNode], model: ScriptModel | None = None
) -> Phase | None:
    """For `model.require_backward_grad_sync = <test>` (the flag `no_sync` toggles, whose
    ancestry this is): the micro-steps that all-reduce, those where the test holds."""
    if len(ancestors) < 3:
        return None
    target, assign = ancestors[-2], ancestors[-3]
    if not (isinstance(target, cst.AssignTarget) and target.target is ancestors[-1]):
        return None
    if not isinstance(assign, cst.Assign):
        return None
    return phase_of(assign.value, model)


def step_phases(
    root: cst.CSTNode, model: ScriptModel | None = None, optimizers: Collection[str] = ()
) -> Iterator[Phase]:
    """The phase of every `if <test>:` under `root` whose body steps an optimizer
    (`optimizers`: the names known to hold one, see `is_optimizer_step`)."""
    for node in own_nodes(root):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            yield from step_phases(node, model, optimizers)
        elif isinstance(node, cst.If):
            body = own_nodes(node.body)
            if any(isinstance(n, cst.Call) and is_optimizer_step(n, optimizers) for n in body):
                phase = phase_of(node.test, model)
                if phase is not None:
                    yield phase


def steps_every_nth(
    step_if: cst.If, body: Sequence[cst.BaseStatement], optimizers: Collection[str] = ()
) -> bool:
    """`if batches_done % model.hyperparams["subdivisions"] == 0: optimizer.step()` in a
    loop body (`body`) whose backward runs on every iteration: accumulation, whatever its
    count is called, when the test is a modulo test, the `if` runs no backward of its own
    (a generator trained on every n-th critic step feeds its own step) and the body steps
    no optimizer and zeroes no gradient outside it (a step on every iteration, or
    gradients dropped on every iteration, accumulate nothing)."""
    if not any(
        type(n) is cst.BinaryOperation and type(n.operator) is cst.Modulo
        for n in own_nodes(step_if.test)
    ):
        return False
    inside = {id(n) for n in own_nodes(step_if.body)}
    if any(type(n) is cst.Call and method_name(n) == "backward" for n in own_nodes(step_if.body)):
        return False
    for statement in body:
        for node in own_nodes(statement):
            if type(node) is not cst.Call or id(node) in inside:
                continue
            if method_name(node) == "zero_grad" or is_optimizer_step(node, optimizers):
                return False
    return True


def counted_by_hand(root: cst.CSTNode, counter: str) -> bool:
    """Whether `counter` is ever incremented in place (`step += 1`): then a test before
    the increment and one after it may rightly differ by one."""
    for node in _all_nodes(root):
        if isinstance(node, cst.AugAssign):
            targets = [node.target]
        elif isinstance(node, cst.Assign) and isinstance(node.value, cst.BinaryOperation):
            targets = [t.target for t in node.targets]  # `step = step + 1`
        else:
            continue
        if any(_last(t) == counter for t in targets):
            return True
    return False


def _last(expr: cst.BaseExpression) -> str | None:
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name is not None else None


def _all_nodes(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    for node in own_nodes(root):
        yield node
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            yield from _all_nodes(node)


# -- a backward in a loop nested in the accumulation loop -------------------------------


def nested_backward(statement: cst.CSTNode, outer: cst.For | cst.While) -> cst.Call | None:
    """The `.backward()` that `statement`, one statement of `outer`'s body, runs from a
    loop of its own (a rollout over time steps, the chunks of a batch) on every
    iteration of `outer`; None when there is none.

    The call may sit under `if`s, but only under tests that read nothing `outer`
    changes between iterations, apart from the inner loops' own targets (`if t in
    backprop_steps:`): whether it runs then cannot depend on the outer iteration. A
    test on the accumulation window itself, or on anything else assigned in the outer
    body, makes the call conditional in a way this cannot judge: None.
    """
    changing = assigned_names(outer.body)
    if isinstance(outer, cst.For):
        changing |= _target_names(outer.target)
    return _backward_below(statement, frozenset(changing), frozenset(), in_loop=False)


def _backward_below(
    node: cst.CSTNode, changing: frozenset[str], counters: frozenset[str], in_loop: bool
) -> cst.Call | None:
    if isinstance(node, cst.Call) and method_name(node) == "backward":
        return node if in_loop else None
    if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
        return None  # runs at another time
    if isinstance(node, (cst.For, cst.While)):
        if isinstance(node, cst.For):
            counters = counters | _target_names(node.target)
        return _backward_below(node.body, changing, counters, in_loop=True)
    if isinstance(node, cst.Try):
        return _backward_below(node.body, changing, counters, in_loop)
    if isinstance(node, cst.If):
        if accumulation_test(node.test) or names_of(node.test) & (changing - counters):
            return None
        for branch in (node.body, node.orelse):
            found = None if branch is None else _backward_below(branch, changing, counters, in_loop)
            if found is not None:
                return found
        return None
    for child in children(node):
        found = _backward_below(child, changing, counters, in_loop)
        if found is not None:
            return found
    return None


def assigned_names(root: cst.CSTNode) -> set[str]:
    """The dotted names `root` assigns: `x = ...`, `self.x += ...`, `for x, y in`,
    `(x := ...)`, `d["k"] = ...` (which changes `d`). Not their heads: assigning
    `self.x` leaves `self.y` alone."""
    found: set[str] = set()
    for node in own_nodes(root):
        if isinstance(node, cst.Assign):
            for target in node.targets:
                found |= _target_names(target.target)
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.NamedExpr, cst.For)):
            found |= _target_names(node.target)
    return found


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return {name for element in target.elements for name in _target_names(element.value)}
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    if isinstance(target, cst.Subscript):
        return _target_names(target.value)
    name = dotted(target)
    return {name} if name is not None else set()
