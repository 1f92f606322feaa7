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
