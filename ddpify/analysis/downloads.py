"""Code that downloads a dataset or weights (`download=True`), in this file or in a helper.

A dataset getter in `data/cifar.py` that builds `CIFAR10(root, download=True)` downloads
on every rank that calls it, exactly as the same line in the training script would; the
call site decides whether that is a race. These questions are asked of one function's
body (a helper's, or a class's methods), so a rule can judge a call it cannot see into.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst

from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted, find_arg
from ddpify.walk import walk

# `with torch_distributed_zero_first(rank):`, `with main_process_first():`: rank 0 goes first.
_FIRST_CONTEXT = re.compile(r"(zero|main|master|primary|rank_?0|leader)\w*first", re.I)


def download_argument(call: cst.Call) -> cst.Arg | None:
    """The `download=True` argument of `call`, if it has one spelled literally."""
    if not any(arg.keyword is not None and arg.keyword.value == "download" for arg in call.args):
        return None
    found = find_arg(call, "download")
    if found is not None and isinstance(found.value, cst.Name) and found.value.value == "True":
        return found
    return None


def rank_zero_first(ancestors: Sequence[cst.CSTNode]) -> bool:
    """Inside `with <something>_zero_first(...)` / `main_process_first()`: rank 0 goes first."""
    for node in ancestors:
        if isinstance(node, cst.With):
            for item in node.items:
                call = item.item
                target = call.func if isinstance(call, cst.Call) else call
                name = dotted(target) or ""
                if _FIRST_CONTEXT.search(name.rsplit(".", 1)[-1]):
                    return True
    return False


def downloads_on_any_rank(function: cst.FunctionDef) -> bool:
    """Whether `function` calls something with `download=True` outside any rank-0 guard
    or "rank 0 first" context of its own (so every rank that calls it downloads). A helper
    with a barrier of its own is taken to order its ranks itself."""
    ancestors: list[cst.CSTNode] = []
    found: list[bool] = []
    barriers: list[cst.Call] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if not isinstance(node, cst.Call):
            return
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "barrier":
            barriers.append(node)
        elif download_argument(node) is not None:
            found.append(rank_zero_scope(ancestors) is None and not rank_zero_first(ancestors))

    walk(function, enter, lambda node: ancestors.pop())
    return any(found) and not barriers


def runs_rank_zero_first_by_callers(tree, func: cst.FunctionDef) -> bool:
    """`func` is a method of a project dataset class (`MNISTM`) every construction of which
    passes `download=True`, and it runs only from that construction (its `__init__`, or a
    method `__init__` calls through `self`, such as `self.download()`). The caller's
    statement that builds the dataset is what the migration runs on rank 0 first
    (migrate/downloads.py): rank 0 runs this alone, the others only after it, once the
    files are there. The ranks never meet in it, so no barrier belongs there (it would
    pair with the caller's wait), and the download in it races with nothing.

    `tree` is the module holding `func`; its `view` the project."""
    cls = tree.scope(func)
    if not isinstance(cls, cst.ClassDef):
        return False
    methods = {f.name.value: f for f in tree.within(cls, cst.FunctionDef) if tree.scope(f) is cls}
    if not _reached_from_init(tree, methods, func.name.value):
        return False
    view = tree.view
    constructions = view.find(
        cst.Call, lambda c: (dotted(c.func) or "").rsplit(".", 1)[-1] == cls.name.value
    )
    return bool(constructions) and all(download_argument(c) for c in constructions)


def _reached_from_init(tree, methods: dict, name: str) -> bool:
    """`name` is `__init__`, or a method `__init__` reaches through `self.<method>()`
    calls and that nothing else in the project calls."""
    reached = {"__init__"} & methods.keys()
    frontier = list(reached)
    while frontier:
        for call in tree.within(methods[frontier.pop()], cst.Call):
            callee = dotted(call.func) or ""
            method = callee[5:] if callee.startswith("self.") else None
            if method in methods and method not in reached:
                reached.add(method)
                frontier.append(method)
    if name not in reached or name == "__init__":
        return name in reached
    callers = [methods[m] for m in reached if m != name]
    cls = tree.scope(methods[name])
    calls = tree.view.find(cst.Call, lambda c: (dotted(c.func) or "").rsplit(".", 1)[-1] == name)
    for call in calls:
        own = dotted(call.func) == f"self.{name}"
        if own and not tree.inside(call, cls):
            continue  # another class's method of the same name, on its own `self`
        if not (own and any(tree.inside(call, m) for m in callers)):
            return False
    return True
