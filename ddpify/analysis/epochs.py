"""Which loops run over epochs: the one answer the data rules (`set_epoch`), the seeding
rule ("does this script train?") and the migration's `set_epoch` pass all read.

A loop is an epoch loop when its target or iterable names an epoch (`for epoch in
range(args.epochs)`, `for _ in range(self.num_epochs)`), a `while` test does
(`while epoch < max_epochs`), or its own body runs one epoch per turn through a helper
(`while True: self._train_epoch()`).
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.names import dotted, identifiers
from ddpify.analysis.tree import Tree

_EPOCH_RUNNER = re.compile(r"(train|run|fit)\w*_epoch$")


def is_epoch_loop(node: cst.CSTNode) -> bool:
    """Whether `node` is a `for` or `while` loop over epochs (see the module docstring)."""
    if isinstance(node, cst.For):
        names = identifiers(node.target) + identifiers(node.iter)
    elif isinstance(node, cst.While):
        names = identifiers(node.test)
    else:
        return False
    return any("epoch" in name.lower() for name in names) or _runs_epoch_helper(node)


def epoch_loops(tree: Tree) -> list[cst.For | cst.While]:
    """The epoch loops of one module, in source order (nested ones too)."""
    return [loop for loop in tree.find((cst.For, cst.While)) if is_epoch_loop(loop)]


def _runs_epoch_helper(loop: cst.For | cst.While) -> bool:
    """A statement of the loop's own body calls `train_epoch()`, `self._run_epoch()`, ..."""
    for statement in loop.body.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            value = getattr(small, "value", None)
            if isinstance(value, cst.Call):
                name = dotted(value.func)
                if name and _EPOCH_RUNNER.search(name.rsplit(".", 1)[-1].lower()):
                    return True
    return False
