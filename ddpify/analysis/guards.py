"""Recognising code that runs on one rank only: `if rank == 0:` and its many spellings.

A guard is classified by what its `if` body runs on. Recognised forms include
`rank == 0`, `dist.get_rank() == 0`, `is_main_process()`, `args.rank % ngpus == 0`,
`local_rank in (-1, 0)`, `not rank`, `if rank != 0: return` early exits, and
`@rank_zero_only` decorators. Anything unrecognised counts as "not a guard".
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

import libcst as cst

from ddpify.analysis.names import dotted


class Scope(enum.Enum):
    """Which rank-0 a guard selects: one process in the job, or one per node."""

    GLOBAL = "global"
    LOCAL = "local"


class Guard(enum.Enum):
    RANK_ZERO = "rank-zero"
    NON_ZERO = "non-zero"


_PREDICATE = re.compile(
    r"^(is_|on_)?(local_|global_)?(main|master|primary|chief|leader|rank_?0|rank_zero|zero)"
    r"(_process|_proc|_rank|_node|_worker|_gpu)?(_only)?$"
)
_LOCAL_IDENTIFIERS = {"gpu", "gpu_id", "local_gpu", "device_id", "gpu_idx"}
_RANK_ZERO_DECORATORS = re.compile(r"(rank_?zero|rank_?0|master|main_process)(_only)?$")


def _scope_of_identifier(name: str) -> Scope | None:
    lowered = name.lower()
    if "local" in lowered and "rank" in lowered or lowered in _LOCAL_IDENTIFIERS:
        return Scope.LOCAL
    if "rank" in lowered:
        return Scope.GLOBAL
    return None


def rank_scope(expr: cst.BaseExpression) -> Scope | None:
    """Whether `expr` evaluates to a process rank (global or local), judged by its names."""
    if isinstance(expr, cst.Call):
        inner = expr.func.attr.value if isinstance(expr.func, cst.Attribute) else None
        if isinstance(expr.func, cst.Name):
            inner = expr.func.value
        if inner in {"int", "str"} and expr.args:
            return rank_scope(expr.args[0].value)
        if inner in {"get", "getenv"} and expr.args:
            return rank_scope(expr.args[0].value)
        return _scope_of_identifier(inner) if inner else None
    if isinstance(expr, cst.SimpleString):
        value = expr.evaluated_value
        if isinstance(value, str):
            return _scope_of_identifier(value)
        return None
    if isinstance(expr, cst.Subscript):
        index = expr.slice[0].slice if expr.slice else None
        if isinstance(index, cst.Index):
            return rank_scope(index.value)
        return None
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Modulo):
        # `args.rank % ngpus_per_node == 0`: the classic "first process of the job".
        return Scope.GLOBAL if rank_scope(expr.left) else None
    name = dotted(expr)
    if name is None:
        return None
    return _scope_of_identifier(name.rsplit(".", 1)[-1])


def _predicate_scope(expr: cst.BaseExpression) -> Scope | None:
    """`is_main_process()`, `self.is_master`, `args.local_master`: true on rank 0."""
    target = expr.func if isinstance(expr, cst.Call) else expr
    name = dotted(target)
    if name is None:
        return None
    last = name.rsplit(".", 1)[-1].lower()
    if not _PREDICATE.match(last):
        return None
    return Scope.LOCAL if "local" in last else Scope.GLOBAL


def _is_zero(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Integer):
        return expr.evaluated_value == 0
    if isinstance(expr, cst.SimpleString):
        return expr.evaluated_value == "0"
    return False


def _zero_or_minus_one(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Tuple, cst.List, cst.Set)):
        values = [e.value for e in expr.elements]
        return any(_is_zero(v) for v in values) and all(
            _is_zero(v)
            or (isinstance(v, cst.UnaryOperation) and isinstance(v.operator, cst.Minus))
            for v in values
        )
    return False


def _flip(guard: tuple[Guard, Scope] | None) -> tuple[Guard, Scope] | None:
    if guard is None:
        return None
    kind, scope = guard
    return (Guard.NON_ZERO if kind is Guard.RANK_ZERO else Guard.RANK_ZERO, scope)


def _compare(node: cst.Comparison) -> tuple[Guard, Scope] | None:
    if len(node.comparisons) != 1:
        return None
    target = node.comparisons[0]
    left, op, right = node.left, target.operator, target.comparator
    if _is_zero(left):
        left, right = right, left
        op = {cst.LessThanEqual: cst.GreaterThanEqual(), cst.GreaterThan: cst.LessThan()}.get(
            type(op), op
        )
    scope = rank_scope(left)
    if scope is None:
        return None
    if isinstance(op, (cst.Equal, cst.Is)) and _is_zero(right):
        return Guard.RANK_ZERO, scope
    if isinstance(op, (cst.NotEqual, cst.IsNot)) and _is_zero(right):
        return Guard.NON_ZERO, scope
    if isinstance(op, cst.LessThanEqual) and _is_zero(right):
        return Guard.RANK_ZERO, scope
    if isinstance(op, cst.GreaterThan) and _is_zero(right):
        return Guard.NON_ZERO, scope
    is_one = isinstance(right, cst.Integer) and right.value == "1"
    if isinstance(op, cst.LessThan) and is_one:
        return Guard.RANK_ZERO, scope
    if isinstance(op, cst.GreaterThanEqual) and is_one:
        return Guard.NON_ZERO, scope
    if isinstance(op, cst.In) and _zero_or_minus_one(right):
        return Guard.RANK_ZERO, scope
    if isinstance(op, cst.NotIn) and _zero_or_minus_one(right):
        return Guard.NON_ZERO, scope
    return None


def classify(test: cst.BaseExpression) -> tuple[Guard, Scope] | None:
    """What the body of `if test:` runs on, or None if `test` is not about ranks."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _flip(classify(test.expression))
    if isinstance(test, cst.BooleanOperation):
        left, right = classify(test.left), classify(test.right)
        parts = [g for g in (left, right) if g is not None]
        if isinstance(test.operator, cst.And):
            # `rank == 0 and epoch % 10 == 0` still runs on rank 0 only.
            return parts[0] if parts else None
        # `not distributed or rank == 0`: rank 0, or the single process of a plain run.
        if parts and all(kind is Guard.RANK_ZERO for kind, _ in parts):
            return parts[0]
        return None
    if isinstance(test, cst.Comparison):
        return _compare(test)
    scope = _predicate_scope(test)
    if scope is not None:
        return Guard.RANK_ZERO, scope
    scope = rank_scope(test)
    if scope is not None:  # `if rank:` is true on every rank but 0
        return Guard.NON_ZERO, scope
    return None


def _exits(block: cst.BaseSuite) -> bool:
    body = block.body
    last = body[-1] if body else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1] if last.body else None
    return isinstance(last, (cst.Return, cst.Continue, cst.Break, cst.Raise))


def _early_exit_guard(stmt: cst.BaseStatement) -> Scope | None:
    """`if rank != 0: return` makes the rest of the block rank-0 only."""
    if not isinstance(stmt, cst.If):
        return None
    guard = classify(stmt.test)
    if guard and guard[0] is Guard.NON_ZERO and _exits(stmt.body):
        return guard[1]
    return None


def _decorated_rank_zero(func: cst.FunctionDef) -> Scope | None:
    for decorator in func.decorators:
        expr = decorator.decorator
        name = dotted(expr.func if isinstance(expr, cst.Call) else expr)
        if name and _RANK_ZERO_DECORATORS.search(name.rsplit(".", 1)[-1].lower()):
            return Scope.GLOBAL
    return None


def rank_zero_scope(ancestors: Sequence[cst.CSTNode]) -> Scope | None:
    """The guard that makes the innermost node of `ancestors` run on rank 0 only, if any.

    `ancestors` runs from the module down to the node itself.
    """
    for depth in range(len(ancestors) - 2, -1, -1):
        parent, child = ancestors[depth], ancestors[depth + 1]
        if isinstance(parent, cst.If):
            guard = classify(parent.test)
            if guard is None:
                continue
            kind, scope = guard
            in_body = child is parent.body
            if (kind is Guard.RANK_ZERO) == in_body and (in_body or child is parent.orelse):
                return scope
        elif isinstance(parent, (cst.IndentedBlock, cst.Module)):
            body = parent.body
            for stmt in body:
                if stmt is child:
                    break
                scope = _early_exit_guard(stmt)
                if scope is not None:
                    return scope
        elif isinstance(parent, cst.FunctionDef):
            scope = _decorated_rank_zero(parent)
            if scope is not None:
                return scope
    return None
