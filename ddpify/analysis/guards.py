"""Recognising code that runs on one rank only: `if rank == 0:` and its many spellings.

Every test is read as two implications: *body* (the test is true only on rank 0, so
its `if` body runs there alone) and *else* (the test is false only on rank 0, so its
`else`, and whatever follows an early `return` under it, runs there alone). `rank != 0`
gives *else*; `rank != 0 and is_eval` gives neither, since the other ranks skip the
`return` whenever `is_eval` is false. A "distributed?" test (`dist.is_initialized()`,
`args.world_size > 1`) implies rank 0 when false: a single process is rank 0.

Recognised forms include `rank == 0`, `dist.get_rank() == 0`, `is_main_process()`,
`args.rank % ngpus == 0`, `local_rank in (-1, 0)`, `not rank`, early exits
(`return`, `continue`, `sys.exit()`), `x if rank == 0 else None`, `is_main and x`,
and `@rank_zero_only` decorators. Anything unrecognised counts as "not a guard".
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.walk import walk


class Scope(enum.Enum):
    """Which rank 0 a guard selects: one process in the job, or one per node."""

    GLOBAL = "global"
    LOCAL = "local"


class Guard(enum.Enum):
    RANK_ZERO = "rank-zero"  # the `if` body runs on rank 0 only
    NON_ZERO = "non-zero"  # the `else` (or what follows an early exit) runs on rank 0 only


class _Single(enum.Enum):
    """Rank 0 of a run that is not distributed at all: neutral when combined."""

    PROCESS = "single-process"


_Implied = Optional[Union[Scope, _Single]]

_PREDICATE = re.compile(
    r"^(is_)?(local_|global_)?(main|master|primary|chief|leader|root|rank_?0|rank_zero|zero)"
    r"(_process|_proc|_rank|_node|_worker|_gpu)?(_only)?$"
)
_PROCESS_ZERO = re.compile(r"^is_(world|local)_process_zero$")
_RANK_WORD = re.compile(r"(?:^|_)(local_?)?rank(?:$|_|\d)")
_LOCAL_IDENTIFIERS = {"gpu", "gpu_id", "local_gpu", "device_id", "gpu_idx"}
_DISTRIBUTED_PREDICATE = re.compile(
    r"^(is_)?(dist|distributed|ddp|use_ddp|multiprocessing_distributed|"
    r"is_dist_avail_and_initialized|initialized|dist_initialized)$"
)
_WORLD_SIZE = re.compile(r"world_size|num_processes|nprocs|num_replicas")
_RANK_ZERO_DECORATORS = re.compile(r"(rank_?zero|rank_?0|master|main_process)(_only)?$")
_EXIT_CALLS = {"sys.exit", "exit", "quit", "os._exit"}


def _scope_of_identifier(name: str) -> Scope | None:
    lowered = name.lower()
    if "node" in lowered:  # node_rank == 0 holds for every process of the first node
        return None
    if lowered in _LOCAL_IDENTIFIERS:
        return Scope.LOCAL
    match = _RANK_WORD.search(lowered)
    if match is None:
        return None
    return Scope.LOCAL if match.group(1) or "local" in lowered else Scope.GLOBAL


def rank_scope(expr: cst.BaseExpression) -> Scope | None:
    """Whether `expr` evaluates to a process rank (global or local), judged by its names."""
    if isinstance(expr, cst.Call):
        inner = expr.func.attr.value if isinstance(expr.func, cst.Attribute) else None
        if isinstance(expr.func, cst.Name):
            inner = expr.func.value
        if inner in {"int", "str", "get", "getenv"} and expr.args:
            return rank_scope(expr.args[0].value)
        return _scope_of_identifier(inner) if inner else None
    if isinstance(expr, cst.SimpleString):
        value = expr.evaluated_value
        return _scope_of_identifier(value) if isinstance(value, str) else None
    if isinstance(expr, cst.Subscript):
        index = expr.slice[0].slice if expr.slice else None
        return rank_scope(index.value) if isinstance(index, cst.Index) else None
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Modulo):
        # `args.rank % ngpus_per_node == 0`: the classic "first process of the job".
        return Scope.GLOBAL if rank_scope(expr.left) else None
    name = dotted(expr)
    if name is None:
        return None
    return _scope_of_identifier(name.rsplit(".", 1)[-1])


def _last_identifier(expr: cst.BaseExpression) -> str | None:
    target = expr.func if isinstance(expr, cst.Call) else expr
    name = dotted(target)
    return name.rsplit(".", 1)[-1].lower() if name else None


def _predicate_scope(expr: cst.BaseExpression) -> Scope | None:
    """`is_main_process()`, `self.is_master`, `args.local_master`: true on rank 0;
    also Hugging Face's `trainer.is_world_process_zero()` / `is_local_process_zero()`."""
    last = _last_identifier(expr)
    if last is None or not (_PREDICATE.match(last) or _PROCESS_ZERO.match(last)):
        return None
    return Scope.LOCAL if "local" in last else Scope.GLOBAL


# How to judge a call the names do not explain (`if utils.check_primary():`): by the body
# of the function it calls, in this file or a local module. Set by the engine for the
# file being checked (`judging_calls_with`); None elsewhere (a guard is then read by its
# names alone, as before).
_CALL_JUDGE: ContextVar[Callable[[cst.Call], Scope | None] | None] = ContextVar(
    "ddpify_call_judge", default=None
)


@contextmanager
def judging_calls_with(judge: Callable[[cst.Call], Scope | None] | None) -> Iterator[None]:
    token = _CALL_JUDGE.set(judge)
    try:
        yield
    finally:
        _CALL_JUDGE.reset(token)


def _judged_call_scope(expr: cst.BaseExpression) -> Scope | None:
    judge = _CALL_JUDGE.get()
    if judge is None or not isinstance(expr, cst.Call):
        return None
    with judging_calls_with(None):  # the helper's body is read by names alone
        return judge(expr)


def returns_rank_zero(func: cst.FunctionDef) -> Scope | None:
    """Whether `func` is a rank-0 predicate whatever its name: every `return` gives a
    rank-0 test (`return dist.get_rank() == 0`, `return rank in (-1, 0)`), or `True` only
    where the job is not distributed (`if not dist.is_initialized(): return True`)."""
    scopes: list[Scope] = []
    ancestors: list[cst.CSTNode] = []
    state = {"nested": 0, "failed": False}
    definitions = (cst.FunctionDef, cst.Lambda, cst.ClassDef)

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if isinstance(node, definitions) and node is not func:
            state["nested"] += 1  # a nested definition's returns are not ours
        if not isinstance(node, cst.Return) or state["nested"]:
            return
        guard = classify(node.value) if node.value is not None else None
        if guard is not None and guard[0] is Guard.RANK_ZERO:
            scopes.append(guard[1])
        elif not (_is_true(node.value) and single_process_branch(ancestors)):
            state["failed"] = True

    def leave(node: cst.CSTNode) -> None:
        ancestors.pop()
        if isinstance(node, definitions) and node is not func:
            state["nested"] -= 1

    walk(func, enter, leave)
    if state["failed"] or not scopes:
        return None
    return Scope.LOCAL if Scope.LOCAL in scopes else Scope.GLOBAL


def _is_true(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "True"


def single_process_branch(ancestors: Sequence[cst.CSTNode]) -> bool:
    """Whether the last node sits in a branch that runs only in a run of one process
    (`if not args.distributed:`, the `else` of `elif args.distributed:`)."""
    return any(
        single_process_step(parent, child) for parent, child in zip(ancestors, ancestors[1:])
    )


def single_process_step(parent: cst.CSTNode, child: cst.CSTNode) -> bool:
    """Whether `child` is a branch of `parent` that runs only in a run of one process."""
    if not isinstance(parent, cst.If) or child is parent.test:
        return False
    return single_process_only(parent.test, orelse=child is not parent.body)


def _is_distributed_test(expr: cst.BaseExpression) -> bool:
    """`dist.is_initialized()`, `args.distributed`, `world_size > 1`: false in one process."""
    if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1:
        target = expr.comparisons[0]
        names = dotted(expr.left) or _last_identifier(expr.left) or ""
        bound = target.comparator
        is_one = isinstance(bound, cst.Integer) and bound.value == "1"
        return (
            bool(_WORLD_SIZE.search(names.lower()))
            and is_one
            and isinstance(target.operator, (cst.GreaterThan, cst.NotEqual))
        )
    last = _last_identifier(expr)
    return last is not None and bool(_DISTRIBUTED_PREDICATE.match(last))


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
            _is_zero(v) or (isinstance(v, cst.UnaryOperation) and isinstance(v.operator, cst.Minus))
            for v in values
        )
    return False


@dataclass(frozen=True)
class _Facts:
    body: _Implied = None  # the test is true only on this rank 0
    orelse: _Implied = None  # the test is false only on this rank 0

    def negated(self) -> _Facts:
        return _Facts(self.orelse, self.body)


_NOTHING = _Facts()

# `x -> (is it true only there?, is it false only there?)` for rank comparisons.
_MIRRORED = {
    cst.LessThanEqual: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.LessThanEqual,
    cst.LessThan: cst.GreaterThan,
    cst.GreaterThan: cst.LessThan,
}


def _compare(node: cst.Comparison) -> _Facts:
    if len(node.comparisons) != 1:
        return _NOTHING
    target = node.comparisons[0]
    left, op, right = node.left, target.operator, target.comparator
    if _is_zero(left):
        left, right = right, left
        op = _MIRRORED.get(type(op), type(op))()
    scope = rank_scope(left)
    if scope is None:
        return _NOTHING
    rank_zero, others = _Facts(body=scope), _Facts(orelse=scope)
    is_one = isinstance(right, cst.Integer) and right.value == "1"
    if _is_zero(right):
        if isinstance(op, (cst.Equal, cst.Is, cst.LessThanEqual)):
            return rank_zero
        if isinstance(op, (cst.NotEqual, cst.IsNot, cst.GreaterThan)):
            return others
    if is_one and isinstance(op, cst.LessThan):
        return rank_zero
    if is_one and isinstance(op, cst.GreaterThanEqual):
        return others
    if _zero_or_minus_one(right):
        if isinstance(op, cst.In):
            return rank_zero
        if isinstance(op, cst.NotIn):
            return others
    if _is_minus_one(right):
        # `rank == -1`: the convention (yolov5, transformers' examples) for "not
        # distributed", so it holds only in a single process, and `rank != -1` only in a
        # distributed run.
        if isinstance(op, (cst.Equal, cst.Is)):
            return _Facts(body=_Single.PROCESS)
        if isinstance(op, (cst.NotEqual, cst.IsNot)):
            return _Facts(orelse=_Single.PROCESS)
    return _NOTHING


def _is_minus_one(expr: cst.BaseExpression) -> bool:
    return (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
        and expr.expression.value == "1"
    )


def _stronger(a: _Implied, b: _Implied) -> _Implied:
    """What `a and b` implies when either implication alone suffices."""
    if a is None or b is None:
        return a if b is None else b
    if Scope.GLOBAL in (a, b):
        return Scope.GLOBAL
    return Scope.LOCAL if Scope.LOCAL in (a, b) else _Single.PROCESS


def _weaker(a: _Implied, b: _Implied) -> _Implied:
    """What holds when both implications are needed (either side may be the true one)."""
    if a is None or b is None:
        return None
    if Scope.LOCAL in (a, b):
        return Scope.LOCAL
    return Scope.GLOBAL if Scope.GLOBAL in (a, b) else _Single.PROCESS


def _facts(test: cst.BaseExpression) -> _Facts:
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _facts(test.expression).negated()
    if isinstance(test, cst.BooleanOperation):
        left, right = _facts(test.left), _facts(test.right)
        if isinstance(test.operator, cst.And):
            return _Facts(_stronger(left.body, right.body), _weaker(left.orelse, right.orelse))
        return _Facts(_weaker(left.body, right.body), _stronger(left.orelse, right.orelse))
    if isinstance(test, cst.Comparison):
        facts = _compare(test)
        if facts == _NOTHING and _is_distributed_test(test):
            return _Facts(orelse=_Single.PROCESS)
        return facts
    scope = _predicate_scope(test) or _judged_call_scope(test)
    if scope is not None:
        return _Facts(body=scope)
    if _is_distributed_test(test):
        return _Facts(orelse=_Single.PROCESS)
    scope = rank_scope(test)
    if scope is not None:  # `if rank:` is true on every rank but 0
        return _Facts(orelse=scope)
    return _NOTHING


def _as_scope(implied: _Implied) -> Scope | None:
    return implied if isinstance(implied, Scope) else None


def classify(test: cst.BaseExpression) -> tuple[Guard, Scope] | None:
    """What `if test:` selects: its body runs on rank 0 only (RANK_ZERO), or its `else`
    does (NON_ZERO); None if `test` is not about ranks."""
    facts = _facts(test)
    if _as_scope(facts.body):
        return Guard.RANK_ZERO, facts.body
    if _as_scope(facts.orelse):
        return Guard.NON_ZERO, facts.orelse
    return None


def excludes_rank_zero(test: cst.BaseExpression) -> bool:
    """Whether `if test:` runs its body only on ranks other than 0, perhaps not on all of
    them: `rank != 0`, `not is_main`, `not is_leader and num_gpus > 1` (the other side of
    an `and` can only narrow it)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return excludes_rank_zero(test.left) or excludes_rank_zero(test.right)
    return _as_scope(_facts(test).orelse) is not None


def single_process_only(test: cst.BaseExpression, *, orelse: bool = False) -> bool:
    """Whether `if test:` runs its body (its `else` with `orelse=True`) only when the job
    is not distributed at all: `local_rank == -1 and ...`, `not dist.is_initialized()`."""
    facts = _facts(test)
    return (facts.orelse if orelse else facts.body) is _Single.PROCESS


def exits(block: cst.BaseSuite) -> bool:
    """Whether a block always leaves: return, continue, break, raise or sys.exit()."""
    body = block.body
    last = body[-1] if body else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1] if last.body else None
    if isinstance(last, cst.Expr) and isinstance(last.value, cst.Call):
        return dotted(last.value.func) in _EXIT_CALLS
    return isinstance(last, (cst.Return, cst.Continue, cst.Break, cst.Raise))


def _after_early_exit(stmt: cst.BaseStatement) -> Scope | None:
    """`if rank != 0: return` (or `if rank == 0: ... else: return`) before a statement."""
    if type(stmt) is not cst.If:  # exact type: isinstance against libcst's ABCs is slow
        return None
    facts = _facts(stmt.test)
    if exits(stmt.body) and _as_scope(facts.orelse):
        return facts.orelse
    if isinstance(stmt.orelse, cst.Else) and exits(stmt.orelse.body) and _as_scope(facts.body):
        return facts.body
    return None


def _decorated_rank_zero(func: cst.FunctionDef) -> Scope | None:
    for decorator in func.decorators:
        expr = decorator.decorator
        name = dotted(expr.func if isinstance(expr, cst.Call) else expr)
        if name and _RANK_ZERO_DECORATORS.search(name.rsplit(".", 1)[-1].lower()):
            return Scope.GLOBAL
    return None


def _guard_between(parent: cst.CSTNode, child: cst.CSTNode) -> Scope | None:
    """The guard `parent` puts on `child`, one level of the ancestry."""
    kind = type(parent)  # exact types: isinstance against libcst's ABCs is slow
    if kind is cst.If or kind is cst.IfExp:
        if child is parent.test:
            return None
        facts = _facts(parent.test)
        return _as_scope(facts.body if child is parent.body else facts.orelse)
    if kind is cst.BooleanOperation and child is parent.right:
        facts = _facts(parent.left)  # `is_main and log(x)`, `not is_main or log(x)`
        return _as_scope(facts.body if isinstance(parent.operator, cst.And) else facts.orelse)
    if kind is cst.IndentedBlock or kind is cst.Module:
        if len(parent.body) > _LONG_BLOCK:
            return _exit_before_in_long_block(parent, child)
        for stmt in parent.body:
            if stmt is child:
                break
            scope = _after_early_exit(stmt)
            if scope is not None:
                return scope
        return None
    if isinstance(parent, cst.FunctionDef):
        return _decorated_rank_zero(parent)
    return None


_LONG_BLOCK = 32
# Long block (by id, with the block kept alive) -> where its first early exit stands.
_first_exits: dict[int, tuple[cst.CSTNode, dict[int, int], int, Scope | None]] = {}


def _exit_before_in_long_block(block: cst.CSTNode, child: cst.CSTNode) -> Scope | None:
    """`_guard_between` for a block of many statements (a module), without scanning the
    block for each node asked about: rules and passes ask for every node of the file."""
    known = _first_exits.get(id(block))
    if known is None or known[0] is not block:
        if len(_first_exits) >= 8:  # a few modules at a time: they are kept alive here
            _first_exits.clear()
        index = {id(stmt): i for i, stmt in enumerate(block.body)}
        first, scope = len(block.body), None
        for i, stmt in enumerate(block.body):
            scope = _after_early_exit(stmt)
            if scope is not None:
                first = i
                break
        known = _first_exits[id(block)] = (block, index, first, scope)
    _, index, first, scope = known
    position = index.get(id(child), len(block.body))
    return scope if first < position else None


def rank_zero_scope(ancestors: Sequence[cst.CSTNode]) -> Scope | None:
    """Whether the last node of `ancestors` (module first) runs on rank 0 only, and which
    rank 0: a global guard anywhere around it wins over a local one."""
    found: Scope | None = None
    for depth in range(len(ancestors) - 2, -1, -1):
        scope = _guard_between(ancestors[depth], ancestors[depth + 1])
        if scope is Scope.GLOBAL:
            return scope
        found = found or scope
    return found
