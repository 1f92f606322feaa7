"""Which of a module's own functions the module itself runs.

A helper module that also has a `__main__` block (to print its tables, or to test one
function) is still a library for everything its own code never reaches: a
`get_dataloader(..., distributed=True)` it defines is run by the training script that
imports it, after that script set up the process group.

Reached means named — called, instantiated, or passed on (`mp.spawn(worker, ...)`) — by
code that runs when the module runs, or by a reached function or class. Naming is read
generously, so an unreached one really is one nothing in the module can run.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import identifiers

_UNITS = (cst.FunctionDef, cst.ClassDef)


def top_level_units(module: cst.Module) -> dict[str, cst.FunctionDef | cst.ClassDef]:
    """The module's own functions and classes, by name."""
    return {stmt.name.value: stmt for stmt in module.body if isinstance(stmt, _UNITS)}


def _run_at_import(stmt: cst.BaseStatement) -> list[cst.CSTNode]:
    """What of a top-level statement runs when the module runs: all of it, except the
    bodies of functions and classes (their decorators do run). A class's bases are
    evaluated too, but subclassing runs none of their methods: a base is reached with
    its reached subclass."""
    if isinstance(stmt, _UNITS):
        return [d.decorator for d in stmt.decorators]
    return [stmt]


def units_run_by_module(module: cst.Module) -> set[str]:
    """Names of the module's top-level functions and classes that its own code may run:
    named by code that runs at import or under `__main__`, or by a reached one. A test
    class that only a test runner finds (`unittest.main()`) is not reached."""
    units = top_level_units(module)
    named: set[str] = set()
    for stmt in module.body:
        for node in _run_at_import(stmt):
            named.update(identifiers(node))
    reached: set[str] = set()
    pending = [name for name in named if name in units]
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        pending.extend(n for n in identifiers(units[name]) if n in units)
    return reached


def enclosing_top_level_unit(
    ancestors: list[cst.CSTNode],
) -> cst.FunctionDef | cst.ClassDef | None:
    """The module-level `def` or `class` an innermost node sits in (ancestors from the
    module down)."""
    if len(ancestors) > 1 and isinstance(ancestors[1], _UNITS):
        return ancestors[1]
    return None


def in_imported_main_block(view, node: cst.CSTNode) -> bool:
    """Whether `node` lies under the `if __name__ == "__main__":` block of a module that
    the entry script imports (a demo at the end of `utils/lr_scheduler.py` that builds a
    resnet and an SGD to plot the schedule): that code never runs in the project's run,
    so its models, optimizers and loops are not the project's. `view`: a Tree (one
    module, its own entry: nothing excluded) or a ProjectView (the entry comes first)."""
    trees = getattr(view, "trees", None)
    if not trees:
        return False
    tree = view.owner(node)
    if tree is None or tree is trees[0]:
        return False
    guards = tree.__dict__.setdefault("_main_guard", [tree.main_guard()])
    return guards[0] is not None and tree.inside(node, guards[0])
