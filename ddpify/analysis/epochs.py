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

from ddpify.analysis.module_globals import called_by_name, local_names, module_functions
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


def names_an_epoch_reads(tree: Tree, loop: cst.For | cst.While) -> set[str]:
    """The dotted names an epoch loop reads in its own body, and the module-level names
    read by the functions of this module it calls by name, through their own calls in
    turn: `for epoch in ...: train(epoch)`, where `train` iterates the global
    `trainloader`, reads `trainloader`. A name the loop's own function binds is not the
    module-level one its callees read, so it is left out."""
    found = names_read(loop)
    functions = module_functions(tree)
    shadowed = local_names(tree.function(loop)) if tree.function(loop) else set()
    pending = [functions[name] for name in called_by_name(loop) if name in functions]
    seen: set[int] = set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        local = local_names(function)
        for name in names_read(function.body):
            head = name.split(".", 1)[0]
            if head not in local and head not in shadowed:
                found.add(name)
        pending += [functions[name] for name in called_by_name(function) if name in functions]
    return found


def names_read(node: cst.CSTNode) -> set[str]:
    """Dotted names read in `node`, keyword-argument names left out: `step(dataloader=
    train_dl)` reads `train_dl`, not a `dataloader`."""
    found: set[str] = set()

    class _Visit(cst.CSTVisitor):
        def visit_Arg(self, arg: cst.Arg) -> bool:
            arg.value.visit(self)
            return False

        def visit_Attribute(self, attribute: cst.Attribute) -> None:
            name = dotted(attribute)
            if name:
                found.add(name)

        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

    node.visit(_Visit())
    return found
