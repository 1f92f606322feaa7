"""Fetcher objects: a class of the project that draws batches from loaders handed to its
constructor (`self.loader = loader`, then `next(self.iter)` with `self.iter =
iter(self.loader)` made again on StopIteration), consumed in a step loop with
`inputs = next(fetcher)` or `fetcher.next_batch()`.

The loaders it is built from are the ones the step trains on; where it makes its iterator
again is where a new pass over a loader starts (its sampler's epoch moves on there).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import class_methods, dotted, find_arg
from ddpify.walk import subtree


@dataclass
class FetcherRestart:
    """`self.iter = iter(self.loader)` in a method of a fetcher class, under `except
    StopIteration` (or `TypeError`, the first call): a new pass over `self.loader`."""

    cls: cst.ClassDef
    attribute: str  # `self.loader`
    statement: cst.SimpleStatementLine


def fetched_loaders(view, pull: cst.Call, bindings) -> set[str]:
    """The names (as written at the constructor call: `loaders.src`) of the loaders that the
    fetcher object `pull` draws from: `next(fetcher)` or `fetcher.next_batch()`, with
    `fetcher` bound once to `Fetcher(...)` of a project class that iterates the constructor
    parameters given there. Empty when `pull` is no such call."""
    obj, method = _pulled_object(pull)
    values = bindings.get(obj or "", [])
    if len(values) != 1 or not isinstance(values[0], cst.Call):
        return set()
    cls = _classes(view).get((dotted(values[0].func) or "").rsplit(".", 1)[-1])
    if cls is None or method not in class_methods(cls) or not _pulls_inside(cls, method):
        return set()
    init = class_methods(cls).get("__init__")
    if init is None:
        return set()
    params = [p.name.value for p in init.params.params][1:]
    iterated = _iterated_attributes(cls)
    found = set()
    for index, param in enumerate(params):
        if _stored_in(init, param) & iterated:
            arg = find_arg(values[0], param, index)
            name = dotted(arg.value) if arg is not None else None
            if name is not None:
                found.add(name)
    return found


def fetcher_restarts(view, loader_names: set[str]) -> list[FetcherRestart]:
    """Where the fetcher classes the project builds from one of `loader_names` make their
    iterator over that loader again."""
    found: list[FetcherRestart] = []
    seen: set[int] = set()
    classes = _classes(view)
    for call in view.find(cst.Call):
        cls = classes.get((dotted(call.func) or "").rsplit(".", 1)[-1])
        init = class_methods(cls).get("__init__") if cls is not None else None
        if cls is None or init is None or id(cls) in seen:
            continue
        params = [p.name.value for p in init.params.params][1:]
        for index, param in enumerate(params):
            arg = find_arg(call, param, index)
            if arg is None or dotted(arg.value) not in loader_names:
                continue
            for attribute in _stored_in(init, param):
                found += _restarts(cls, attribute)
        seen.add(id(cls))
    return found


def _pulled_object(pull: cst.Call) -> tuple[str | None, str]:
    """(`fetcher`, `__next__`) for `next(fetcher)`; (`fetcher`, `next_batch`) for
    `fetcher.next_batch()`."""
    if dotted(pull.func) == "next" and pull.args:
        return dotted(pull.args[0].value), "__next__"
    if isinstance(pull.func, cst.Attribute):
        return dotted(pull.func.value), pull.func.attr.value
    return None, ""


def _classes(view) -> dict[str, cst.ClassDef]:
    return {cls.name.value: cls for cls in view.find(cst.ClassDef)}


def _pulls_inside(cls: cst.ClassDef, method: str) -> bool:
    """Whether `method` calls `next(...)` itself or through `self.<method>()` calls."""
    methods = class_methods(cls)
    pending, seen = [method], set()
    while pending:
        name = pending.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        for node in subtree(methods[name]):
            if not isinstance(node, cst.Call):
                continue
            callee = dotted(node.func) or ""
            if callee == "next":
                return True
            if callee.startswith("self."):
                pending.append(callee[5:])
    return False


def _stored_in(init: cst.FunctionDef, param: str) -> set[str]:
    """`self.loader` for `self.loader = loader` in the constructor."""
    found = set()
    for node in subtree(init):
        if isinstance(node, cst.Assign) and dotted(node.value) == param:
            found |= {dotted(t.target) for t in node.targets} - {None}
    return found  # type: ignore[return-value]


def _iterated_attributes(cls: cst.ClassDef) -> set[str]:
    """`self.loader` for every `iter(self.loader)` in the class."""
    return {
        dotted(node.args[0].value)  # type: ignore[misc]
        for node in subtree(cls)
        if isinstance(node, cst.Call) and _iter_of(node) is not None
    }


def _iter_of(call: cst.Call) -> str | None:
    if dotted(call.func) == "iter" and len(call.args) == 1:
        name = dotted(call.args[0].value)
        return name if name is not None and name.startswith("self.") else None
    return None


def _restarts(cls: cst.ClassDef, attribute: str) -> list[FetcherRestart]:
    """`self.x = iter(<attribute>)` statements of the class."""
    found = []
    for node in subtree(cls):
        if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
            continue
        small = node.body[0]
        if isinstance(small, cst.Assign) and isinstance(small.value, cst.Call):
            if _iter_of(small.value) == attribute:
                found.append(FetcherRestart(cls, attribute, node))
    return found
