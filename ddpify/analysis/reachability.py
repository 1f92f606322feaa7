"""Which of a module's own functions the module itself runs.

A helper module that also has a `__main__` block (to print its tables, or to test one
function) is still a library for everything its own code never reaches: a
`get_dataloader(..., distributed=True)` it defines is run by the training script that
imports it, after that script set up the process group.

Reached means named — called, or passed on (`mp.spawn(worker, ...)`) — by module-level
code, by any class body or method (classes are judged elsewhere), or by a reached
function. Naming is read generously, so an unreached function really is one nothing in
the module can run.
"""

from __future__ import annotations

import libcst as cst

from ddpify.walk import walk


def _names_in(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    def enter(child: cst.CSTNode) -> None:
        if isinstance(child, cst.Name):
            names.add(child.value)

    walk(node, enter, lambda child: None)
    return names


def top_level_functions(module: cst.Module) -> dict[str, cst.FunctionDef]:
    return {stmt.name.value: stmt for stmt in module.body if isinstance(stmt, cst.FunctionDef)}


def functions_run_by_module(module: cst.Module) -> set[str]:
    """Names of the module's top-level functions that its own code may run."""
    functions = top_level_functions(module)
    named: set[str] = set()
    for stmt in module.body:
        if not isinstance(stmt, cst.FunctionDef):
            named |= _names_in(stmt)
        else:  # decorators and defaults run when the def does
            for decorator in stmt.decorators:
                named |= _names_in(decorator)
    reached: set[str] = set()
    pending = [name for name in named if name in functions]
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        pending.extend(n for n in _names_in(functions[name]) if n in functions)
    return reached


def enclosing_top_level_function(ancestors: list[cst.CSTNode]) -> cst.FunctionDef | None:
    """The module-level `def` an innermost node sits in (ancestors from the module down)."""
    if len(ancestors) > 1 and isinstance(ancestors[1], cst.FunctionDef):
        return ancestors[1]
    return None
