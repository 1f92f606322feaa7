"""DDP045: a rank-local `break`, `return` or `sys.exit()` while collectives follow.

An exit is rank-local when an `if` around it tests the rank (`if rank == 0:`,
`if not is_main_process():`) or a value each rank computes on its own shard: a NaN or
inf check of the loss (error), or an early-stopping flag in a script that reduces
nothing across ranks (info: the metric behind it may still be the same everywhere).
It matters only when the ranks that stay meet a collective the others skip: the
backward or forward of the DDP wrapper, or a `torch.distributed` collective, in the
loop a `break` leaves, or in a loop around a `return` / `sys.exit()`.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.guards import classify, rank_zero_scope, single_process_step
from ddpify.analysis.names import dotted
from ddpify.analysis.training import (
    Located,
    collectives_in,
    names_of,
    reduced_names,
    walk_subtree,
)
from ddpify.diagnostics import Severity
from ddpify.rules.training_loop._common import LoopRule

_NAN_CHECKS = {"isnan", "isinf", "isfinite", "isneginf", "isposinf"}
_LOSS = re.compile(r"loss", re.I)
_EARLY_STOP = re.compile(r"early_?stop|should_stop|stop_training|patience|bad_epochs", re.I)
_LOOPS = (cst.For, cst.While)

RANK, NAN, EARLY_STOP = "rank", "nan", "early-stop"


class DivergentControlFlow(LoopRule):
    """One rank leaves the loop; the others wait for it in the next collective."""

    CODE = "DDP045"
    NAME = "divergent-control-flow"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "a `break` under a rank guard leaves the loop on some ranks only, and the others "
        "hang in the next collective; broadcast the decision so every rank takes it"
    )

    def visit_Break(self, node: cst.Break) -> None:
        self._feed(node)

    def visit_Return(self, node: cst.Return) -> None:
        self._feed(node)

    def visit_Call(self, node: cst.Call) -> None:
        self._feed(node)  # sys.exit(); LoopFacts tests the name cheaply

    def leave_Module(self, node: cst.Module) -> None:
        if not self.loops.exits or not self.applies():
            return
        wrappers = self.context.wrappers.wrapped_names()
        reduced: set[str] | None = None
        for exit_ in self.loops.exits:
            found = self._divergence(exit_)
            if found is None:
                continue
            kind, test = found
            if kind != RANK:
                if reduced is None:
                    reduced = reduced_names(self.context.model, node)
                if self._reduced(test, reduced):
                    continue
                # An early-stopping metric may be reduced in a helper the flag does not
                # name: only a script that reduces nothing at all is sure to diverge.
                if kind == EARLY_STOP and reduced:
                    continue
            collective = self._collective_after(exit_, wrappers)
            if collective is not None:
                self._report(exit_, kind, test, collective)

    def _divergence(self, exit_: Located) -> tuple[str, cst.BaseExpression | None] | None:
        """Why the exit is rank-local (and the test that makes it so), if it is."""
        boundary = _boundary(exit_)
        if boundary is None:
            return None
        found = None
        pairs = list(zip(exit_.ancestors[boundary:], exit_.ancestors[boundary + 1 :]))
        if any(single_process_step(parent, child) for parent, child in pairs):
            return None  # `if RANK == -1 and stopper(...): break`: no other rank to wait
        for parent, child in pairs:
            if type(parent) is not cst.If or child is parent.test:
                continue
            if classify(parent.test) is not None:
                return RANK, parent.test
            kind = _value_kind(parent.test)
            if kind is not None and found is None:
                found = kind, parent.test
        if found is None and rank_zero_scope(exit_.ancestors[boundary:]) is not None:
            return RANK, None  # after `if rank != 0: continue`, under `is_main and ...`
        return found

    def _reduced(self, test: cst.BaseExpression, reduced: set[str]) -> bool:
        """Whether the tested value (or what it was computed from) went through a
        collective or a reducing helper: then every rank sees the same value."""
        names = names_of(test)
        bindings = self.context.model.bindings
        for name in list(names):
            for value in bindings.get(name, ()):
                names |= names_of(value)
        return bool(names & reduced) or any(name.split(".")[0] in reduced for name in names)

    def _collective_after(self, exit_: Located, wrappers: set[str]) -> cst.Call | None:
        """A collective the other ranks meet after this exit: in the loop a `break`
        leaves, in a loop around a `return` or `sys.exit()` (within its function)."""
        model = self.context.model
        ancestors = exit_.ancestors
        if type(exit_.node) is cst.Break:
            loop = ancestors[_boundary(exit_)]  # type: ignore[index]
            found = collectives_in(model, loop, wrappers)
            return found[0] if found else None
        for node in reversed(ancestors[:-1]):
            if type(node) in (cst.FunctionDef, cst.ClassDef, cst.Lambda):
                return None
            if isinstance(node, _LOOPS):
                found = collectives_in(model, node, wrappers)
                if found:
                    return found[0]
        return None

    def _report(
        self, exit_: Located, kind: str, test: cst.BaseExpression | None, collective: cst.Call
    ) -> None:
        what = _exit_name(exit_.node)
        shown_test = self.context.code(test).strip() if test is not None else ""
        other = self._describe(collective)
        if kind == RANK:
            where = f"under `if {shown_test}:`" if test is not None else "under a rank guard"
            message = (
                f"`{what}` {where} runs on some ranks only; the others go on "
                f"to {other} and wait there for ranks that never come, so the job "
                "hangs; decide on one rank, broadcast the decision (`dist.broadcast`), and "
                f"`{what}` on every rank"
            )
            self.report(exit_.node, message)
            return
        if kind == NAN:
            message = (
                f"`{what}` on `{shown_test}` tests this rank's own loss: when one rank stops "
                f"and the others go on to {other}, they hang; all-reduce the flag "
                "(`dist.all_reduce(flag, op=dist.ReduceOp.MAX)`) so every rank decides alike"
            )
            self.report(exit_.node, message)
            return
        message = (
            f"`{what}` on `{shown_test}`: if the metric behind it is computed on each rank's "
            f"own shard, ranks stop at different epochs and the others hang in "
            f"{other}; all-reduce the metric or broadcast the flag from rank 0"
        )
        self.report(exit_.node, message, severity=Severity.INFO)

    def _describe(self, call: cst.Call) -> str:
        """`the backward`, `the forward of `model``, or `dist.barrier(...)`."""
        func = call.func
        if type(func) is cst.Attribute and func.attr.value == "backward":
            return "the backward"
        if self.context.qualify(func) is None:
            shown = self.context.code(func).removesuffix(".forward")
            return f"the forward of `{shown}`"
        return f"`{self.context.code(func)}(...)`"


def _boundary(exit_: Located) -> int | None:
    """Index in the ancestry of what the exit leaves: the loop of a `break`, the function
    of a `return`, the function or module of `sys.exit()`."""
    ancestors = exit_.ancestors
    for index in range(len(ancestors) - 2, -1, -1):
        node = ancestors[index]
        if type(exit_.node) is cst.Break:
            if isinstance(node, _LOOPS):
                return index
            if type(node) in (cst.FunctionDef, cst.ClassDef):
                return None
        elif type(node) in (cst.FunctionDef, cst.Lambda):
            return index if type(node) is cst.FunctionDef else None
    return None if type(exit_.node) in (cst.Break, cst.Return) else 0


def _value_kind(test: cst.BaseExpression) -> str | None:
    for node in walk_subtree(test):
        if type(node) is cst.Call:
            name = dotted(node.func) or ""
            if name.rsplit(".", 1)[-1] in _NAN_CHECKS and any(
                _LOSS.search(n) for n in names_of(node)
            ):
                return NAN
    if any(_EARLY_STOP.search(name) for name in names_of(test)):
        return EARLY_STOP
    return None


def _exit_name(node: cst.CSTNode) -> str:
    if type(node) is cst.Break:
        return "break"
    if type(node) is cst.Return:
        return "return"
    return f"{dotted(node.func)}()"  # type: ignore[attr-defined]
