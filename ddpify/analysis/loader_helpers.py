"""Loader helpers: a function that builds a DataLoader and returns it (`data_provider(args,
flag)`, `get_loader(split)`), and where its result lands. One such helper often builds the
training loader and the evaluation loaders alike, so a sampler added inside it for training
shards evaluation too.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.tree import Tree

MAX_DEPTH = 4  # helpers returning helpers' results: `_get_data` around `data_provider`


def helper_results(tree: Tree, loader: cst.Call) -> list[tuple[cst.Call, str]]:
    """(the call of the helper, the name its loader is bound to) for every place in the
    project (`tree.view`) where the loader `loader` builds is kept, following helpers that
    return it in turn; empty when `loader` is not built in a function that returns it."""
    view = tree.view
    func = view.function(loader)
    if func is None:
        return []
    index = _position_returned(view, func, _bound_name(view, loader), loader)
    if index is None:
        return []
    found: list[tuple[cst.Call, str]] = []
    frontier = [(func, index)]
    seen = {id(func)}
    for _ in range(MAX_DEPTH):
        later = []
        for helper, position in frontier:
            for site, name in _kept_results(view, helper, position):
                outer = view.function(site)
                passed_on = _position_returned(view, outer, name, None) if outer else None
                if passed_on is not None and id(outer) not in seen:
                    seen.add(id(outer))
                    later.append((outer, passed_on))
                elif passed_on is None:
                    found.append((site, name))
        frontier = later
    return found


def _position_returned(view, func, name: str | None, node: cst.CSTNode | None) -> int | None:
    """Where `func` returns `name` (or the expression `node`): -1 alone, else the index in
    the returned tuple; None if it does not return it."""
    for ret in view.within(func, cst.Return):
        value = ret.value
        if value is None:
            continue
        if value is node or (name is not None and dotted(value) == name):
            return -1
        if isinstance(value, cst.Tuple):
            for index, element in enumerate(value.elements):
                if element.value is node or (name is not None and dotted(element.value) == name):
                    return index
    return None


def _kept_results(view, helper: cst.FunctionDef, position: int) -> list[tuple[cst.Call, str]]:
    """`x = helper(...)` / `a, x = helper(...)`: (the call, `x`) for each call of `helper`."""
    found = []
    for call in view.find(cst.Call):
        callee = dotted(call.func)
        if callee is None or callee.rsplit(".", 1)[-1] != helper.name.value:
            continue
        statement = view.statement(call)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not isinstance(small, cst.Assign) or small.value is not call:
            continue
        target = small.targets[0].target
        if position == -1:
            name = dotted(target)
        elif isinstance(target, (cst.Tuple, cst.List)) and position < len(target.elements):
            name = dotted(target.elements[position].value)
        else:
            name = None
        if name is not None:
            found.append((call, name))
    return found


def _bound_name(view, call: cst.Call) -> str | None:
    """`x` in `x = call(...)`."""
    statement = view.statement(call)
    small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
    if isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1:
        return dotted(small.targets[0].target)
    return None
