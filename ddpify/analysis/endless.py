"""Endless generators over a loader: `def sample_data(loader): while True: yield from
loader`, and the `inf_generator` that restarts `iter(loader)` on StopIteration.

A step loop that draws its batches with next() from such a generator has no epoch loop:
a new pass over the loader starts inside the generator. These are the places where one
starts again, so that a DistributedSampler can be told of the new pass there.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted


@dataclass
class PassRestart:
    """Where an endless generator starts a new pass over its loader parameter."""

    function: cst.FunctionDef
    parameter: str  # the generator's parameter that holds the loader
    statement: cst.BaseStatement
    after: bool  # the new pass begins after `statement` (True) or at it (False)


def pass_restarts(view, loader_names: set[str]) -> list[PassRestart]:
    """The restarts of the endless generators that the project calls with one of
    `loader_names` (`batches = sample_data(train_loader)`)."""
    found: list[PassRestart] = []
    seen: set[int] = set()
    functions = view.functions()
    for call in view.find(cst.Call):
        func = functions.get(dotted(call.func) or "")
        if func is None or id(func) in seen:
            continue
        parameter = _parameter_fed(func, call, loader_names)
        if parameter is None:
            continue
        restarts = _restarts(func, parameter)
        if restarts:
            seen.add(id(func))
            found.extend(restarts)
    return found


def _parameter_fed(func: cst.FunctionDef, call: cst.Call, names: set[str]) -> str | None:
    """The parameter of `func` that `call` passes one of `names` to."""
    params = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for index, arg in enumerate(positional):
        if dotted(arg.value) in names and index < len(params):
            return params[index]
    for arg in call.args:
        if arg.keyword is not None and dotted(arg.value) in names:
            return arg.keyword.value
    return None


def _restarts(func: cst.FunctionDef, parameter: str) -> list[PassRestart]:
    """In a `while True:` of `func`: `for x in parameter:` and `yield from parameter` (the
    next pass begins after them), `it = iter(parameter)` (it begins there)."""
    found: list[PassRestart] = []
    for loop in _endless_loops(func):
        for statement in _statements(loop.body):
            if isinstance(statement, cst.For) and dotted(statement.iter) == parameter:
                found.append(PassRestart(func, parameter, statement, after=True))
            elif isinstance(statement, cst.SimpleStatementLine):
                small = statement.body[0]
                if _yields_from(small, parameter):
                    found.append(PassRestart(func, parameter, statement, after=True))
                elif isinstance(small, cst.Assign) and _iterates(small.value, parameter):
                    found.append(PassRestart(func, parameter, statement, after=False))
    return found


def _endless_loops(func: cst.FunctionDef) -> list[cst.While]:
    loops = []
    for statement in _statements(func.body):
        if isinstance(statement, cst.While) and _always_true(statement.test):
            loops.append(statement)
    return loops


def _always_true(test: cst.BaseExpression) -> bool:
    return (isinstance(test, cst.Name) and test.value == "True") or (
        isinstance(test, cst.Integer) and test.value == "1"
    )


def _statements(block: cst.CSTNode) -> list[cst.BaseStatement]:
    """The statements under `block`, through if/try/with blocks but not into loops or
    nested functions and classes."""
    found: list[cst.BaseStatement] = []
    pending = list(getattr(block, "body", []))
    while pending:
        statement = pending.pop(0)
        found.append(statement)
        if isinstance(statement, (cst.If, cst.With, cst.Try)):
            pending.extend(_blocks_of(statement))
    return found


def _blocks_of(statement: cst.BaseStatement) -> list[cst.BaseStatement]:
    suites = [statement.body]  # type: ignore[attr-defined]
    if isinstance(statement, cst.Try):
        suites += [handler.body for handler in statement.handlers]
        suites += [part.body for part in (statement.orelse, statement.finalbody) if part]
    found = [s for suite in suites for s in getattr(suite, "body", [])]
    if isinstance(statement, cst.If) and statement.orelse is not None:
        orelse = statement.orelse
        found += [orelse] if isinstance(orelse, cst.If) else list(orelse.body.body)
    return found


def _yields_from(small: cst.BaseSmallStatement, parameter: str) -> bool:
    return (
        isinstance(small, cst.Expr)
        and isinstance(small.value, cst.Yield)
        and isinstance(small.value.value, cst.From)
        and dotted(small.value.value.item) == parameter
    )


def _iterates(value: cst.BaseExpression, parameter: str) -> bool:
    """`iter(parameter)` or `parameter.__iter__()`."""
    if not isinstance(value, cst.Call):
        return False
    if dotted(value.func) == "iter" and len(value.args) == 1:
        return dotted(value.args[0].value) == parameter
    return (
        isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "__iter__"
        and dotted(value.func.value) == parameter
    )
