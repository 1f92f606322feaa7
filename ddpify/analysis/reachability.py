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
from ddpify.walk import subtree

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


def _imported_owner(view, node: cst.CSTNode):
    """The module `node` lies in, when it is one the entry script imports (not the entry
    itself); None otherwise, and always for a single Tree (its own entry)."""
    tree = view.owner(node)
    return None if tree is None or tree is view.trees[0] else tree


def in_imported_main_block(view, node: cst.CSTNode) -> bool:
    """Whether `node` lies under the `if __name__ == "__main__":` block of a module that
    the entry script imports (a demo at the end of `utils/lr_scheduler.py` that builds a
    resnet and an SGD to plot the schedule): that code never runs in the project's run,
    so its models, optimizers and loops are not the project's. `view`: a Tree (one
    module, its own entry: nothing excluded) or a ProjectView (the entry comes first)."""
    tree = _imported_owner(view, node)
    if tree is None:
        return False
    guards = tree.__dict__.setdefault("_main_guard", [tree.main_guard()])
    return guards[0] is not None and tree.inside(node, guards[0])


# Ways a function may be reached by a name computed at run time: while any of them is in
# the project, no function counts as unnamed.
_COMPUTED_LOOKUPS = frozenset({"getattr", "globals", "vars", "locals", "eval", "exec"})


def in_unnamed_function(view, node: cst.CSTNode) -> bool:
    """Whether `node` lies in a top-level function of a module the entry script imports
    that nothing in the project names: not its own module outside its body, not another
    module (by name, unless that module defines the same name itself, or as an attribute),
    not a string, not a decorator. A `def test(): net = VGG(); print(net(x).size())` kept
    at the end of a model file (its call commented out) never runs in the project's run."""
    tree = _imported_owner(view, node)
    if tree is None:
        return False
    unit = enclosing_top_level_unit(tree.ancestors(node))
    if not isinstance(unit, cst.FunctionDef):
        return False
    unnamed = view.__dict__.get("_unnamed_functions")
    if unnamed is None:
        unnamed = view.__dict__["_unnamed_functions"] = _unnamed_functions(view.trees)
    return id(unit) in unnamed


def _unnamed_functions(trees: list) -> set[int]:
    """ids of the imported modules' top-level functions nothing in the project names."""
    if any(_looks_up_computed_names(tree.module) for tree in trees):
        return set()
    names = [_named_in(tree.module) for tree in trees]
    found = set()
    for index, tree in enumerate(trees[1:], start=1):
        own_words = names[index][0]
        for stmt in tree.module.body:
            if not isinstance(stmt, cst.FunctionDef) or stmt.decorators:
                continue
            name = stmt.name.value
            if _named_elsewhere(name, stmt, own_words, names, index, trees):
                continue
            found.add(id(stmt))
    return found


def _looks_up_computed_names(module: cst.Module) -> bool:
    """`getattr(models, args.arch)`, `globals()[name]`, `eval(...)`, `m.__dict__`: a
    function may be reached by a name the code computes."""
    for node in subtree(module):
        if isinstance(node, cst.Attribute) and node.attr.value == "__dict__":
            return True
        if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Name):
            continue
        if node.func.value == "getattr":
            if len(node.args) < 2 or not isinstance(node.args[1].value, cst.SimpleString):
                return True
        elif node.func.value in _COMPUTED_LOOKUPS:
            return True
    return False


def _named_in(module: cst.Module) -> tuple[set[str], set[str], set[str]]:
    """A module's identifiers, its attribute names, and its string literals."""
    words = set(identifiers(module))
    attrs = {n.attr.value for n in _nodes(module, cst.Attribute)}
    strings = {
        s.evaluated_value
        for s in _nodes(module, cst.SimpleString)
        if isinstance(s.evaluated_value, str)
    }
    return words, attrs, strings


def _named_elsewhere(name, func, own_words, names, index, trees) -> bool:
    if name in own_words and name in _words_outside(trees[index], func):
        return True
    for other, (words, attrs, strings) in enumerate(names):
        if name in strings or (other != index and name in attrs):
            return True
        if other != index and name in words and name not in top_level_names(trees[other].module):
            return True
    return False


def _words_outside(tree, func: cst.FunctionDef) -> set[str]:
    """The identifiers of the module's code outside `func` and outside its `__main__`
    block (which never runs in a module that is imported)."""
    skipped = (func, tree.main_guard())
    return {w for stmt in tree.module.body if stmt not in skipped for w in identifiers(stmt)}


def top_level_names(module: cst.Module) -> set[str]:
    """Names a module binds at its top level by `def`, `class` or a plain assignment."""
    found = set(top_level_units(module))
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    found |= {
                        t.target.value for t in small.targets if isinstance(t.target, cst.Name)
                    }
    return found


def _nodes(module: cst.Module, kind: type) -> list:
    return [node for node in subtree(module) if isinstance(node, kind)]


def never_run(view, node: cst.CSTNode) -> bool:
    """Code of an imported module that the project's run never reaches: its `__main__`
    demo, or a function of it that nothing in the project names."""
    return in_imported_main_block(view, node) or in_unnamed_function(view, node)
