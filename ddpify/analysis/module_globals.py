"""A module's top-level functions and the module-level names they read: a function that
does not bind a name itself (parameter, assignment) reads the module's binding of it, so a
flat script's `def train(epoch)` iterates the global `trainloader` and steps the global
`net`, which may hold the DDP wrapper by the time it runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import libcst as cst

from ddpify.analysis.accumulation import assigned_names
from ddpify.analysis.names import ImportMap
from ddpify.analysis.project import LocalFunctions
from ddpify.analysis.training import own_nodes
from ddpify.analysis.tree import Tree
from ddpify.walk import walk


def module_functions(tree: Tree) -> dict[str, cst.FunctionDef]:
    """The functions defined at the module's top level, by name (the later def wins, as
    in Python). Read only."""
    return tree.top_functions


def called_by_name(node: cst.CSTNode) -> set[str]:
    """The plain names `node` calls: `train(epoch)`, not `self.train()` nor `loader.next()`."""
    found: set[str] = set()

    def enter(child: cst.CSTNode) -> None:
        if type(child) is cst.Call and type(child.func) is cst.Name:
            found.add(child.func.value)

    walk(node, enter, lambda child: None)  # iterative: no depth limit from the input
    return found


def local_names(function: cst.FunctionDef) -> set[str]:
    """The plain names `function` binds for itself: its parameters and what it assigns,
    less those it declares `global`."""
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    local = {param.name.value for param in every}
    local |= {name for name in assigned_names(function.body) if "." not in name}
    declared: set[str] = set()
    for node in own_nodes(function.body):
        if isinstance(node, cst.Global):
            declared |= {item.name.value for item in node.names}
    return local - declared


def reads_module_binding(tree: Tree, node: cst.CSTNode, name: str) -> bool:
    """Whether `node`, inside a top-level function of this module (not a method, not a
    nested function), reads the module's own binding of `name`'s head: the function
    binds no local of that name."""
    function = tree.function(node)
    if function is None or tree.parent.get(function) is not tree.module:
        return False
    return name.split(".", 1)[0] not in local_names(function)


def first_module_level_call(tree: Tree, function: cst.FunctionDef) -> cst.CSTNode | None:
    """The first top-level statement of the module that calls `function` by name (directly,
    not through another function), or None."""
    for statement in tree.module.body:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            continue
        if function.name.value in called_by_name(statement):
            return statement
    return None


def functions_run_after(tree: Tree, statement: cst.CSTNode) -> set[str]:
    """The top-level functions of this module that run only after the top-level
    `statement`: called by name first from a later top-level statement, or, never called
    from top-level code, called only from such functions."""
    functions = module_functions(tree)
    order = {id(s): index for index, s in enumerate(tree.module.body)}
    anchor = order.get(id(statement))
    if anchor is None:
        return set()
    after: set[str] = set()
    unplaced: dict[str, cst.FunctionDef] = {}
    for name, function in functions.items():
        first = first_module_level_call(tree, function)
        if first is None:
            unplaced[name] = function
        elif order[id(first)] > anchor:
            after.add(name)
    callers = {name: called_by_name(function.body) for name, function in functions.items()}
    changed = True
    while changed:
        changed = False
        for name in list(unplaced):
            calling = {c for c, called in callers.items() if name in called}
            if calling and calling <= after:
                after.add(name)
                del unplaced[name]
                changed = True
    return after


# How many helpers deep a parameter is followed (`evaluate(net)` -> `_losses(net, batch)`).
MAX_HAND_ON = 6


def parameter_for(function: cst.FunctionDef, call: cst.Call, arg: cst.Arg) -> str | None:
    """The parameter of `function` that `arg` of `call` binds: by keyword, else by
    position among the positional parameters (None past them, or for a `*x` / `**x`
    argument, whose parameter cannot be told)."""
    if arg.star:
        return None
    params = function.params
    if arg.keyword is not None:
        named = [*params.posonly_params, *params.params, *params.kwonly_params]
        found = arg.keyword.value
        return found if any(p.name.value == found for p in named) else None
    positional = [a for a in call.args if a.keyword is None]
    index = next(i for i, a in enumerate(positional) if a is arg)
    if any(a.star for a in positional[:index]):
        return None
    slots = [*params.posonly_params, *params.params]
    return slots[index].name.value if index < len(slots) else None


# What a call inside a function reaches: the function it runs and how to resolve the
# calls inside that one (each module resolves names its own way); None when unknown.
Callee = Callable[[cst.Call], "tuple[cst.FunctionDef, Callee] | None"]


def own_functions_callee(tree: Tree) -> Callee:
    """Plain-name calls of the module's own top-level functions (`evaluate(net)`)."""
    functions = module_functions(tree)

    def callee(call: cst.Call) -> tuple[cst.FunctionDef, Callee] | None:
        found = functions.get(call.func.value) if type(call.func) is cst.Name else None
        return (found, callee) if found is not None else None

    return callee


def project_callee(tree: Tree, imports: ImportMap, local: LocalFunctions) -> Callee:
    """The module's own top-level functions, else a function of a local module the call
    names through an import (`sequence_logprobs(model, ...)` from `rollout`); inside such
    a module, the plain-name calls of what it defines or imports from a local module."""
    own = own_functions_callee(tree)

    def in_module(path: Path) -> Callee:
        def callee(call: cst.Call) -> tuple[cst.FunctionDef, Callee] | None:
            if type(call.func) is not cst.Name:
                return None
            found = local.function_in(path, call.func.value)
            return (found.node, in_module(found.path)) if found is not None else None

        return callee

    def callee(call: cst.Call) -> tuple[cst.FunctionDef, Callee] | None:
        found = own(call)
        if found is not None:
            return found[0], callee
        qualified = imports.qualify_local(call.func)
        helper = local.function(qualified) if qualified is not None else None
        return (helper.node, in_module(helper.path)) if helper is not None else None

    return callee


def runs_parameter(
    tree: Tree,
    function: cst.FunctionDef,
    name: str,
    depth: int = 0,
    callee: Callee | None = None,
) -> bool:
    """Whether `function` calls what its caller passed as `name` (`name(x)`,
    `name.forward(x)`), itself or through a function it hands `name` on to (by default
    a top-level function of the module; `callee` resolves others). A function that
    rebinds `name` (`net = net.module`) runs something else, and `name.module(x)` is not
    a call of `name`."""
    if depth > MAX_HAND_ON or name in assigned_names(function.body):
        return False
    if callee is None:
        callee = own_functions_callee(tree)
    for node in own_nodes(function.body):
        if type(node) is not cst.Call:
            continue
        if _calls_name(node.func, name):
            return True
        found = callee(node)
        if found is None or found[0] is function:
            continue
        helper, inner = found
        for arg in node.args:
            if type(arg.value) is not cst.Name or arg.value.value != name:
                continue
            param = parameter_for(helper, node, arg)
            if param is not None and runs_parameter(tree, helper, param, depth + 1, inner):
                return True
    return False


def _calls_name(func: cst.BaseExpression, name: str) -> bool:
    if type(func) is cst.Attribute and func.attr.value == "forward":
        func = func.value
    return type(func) is cst.Name and func.value == name
