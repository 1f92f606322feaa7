"""Which models hold BatchNorm layers.

A project's class holds BatchNorm when its body names a BatchNorm layer (built in
`__init__`, perhaps only under a condition such as `if self.do_bn:`, or passed on as
`norm_layer=nn.BatchNorm2d`), names another class or function of the project that holds
one, or derives from such a class. An expression holds BatchNorm when it builds such a
model: `Net(...)`, `nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))`, a list or dict of
models, or a name bound to one of those.

The answers are "may hold": True where some instance may hold BatchNorm (converting one
that does not is a no-op), False where nothing that builds it names BatchNorm, None where
code outside the project builds it (`torchvision.models.resnet18()`) and the caller must
decide. The wrap pass asks before writing a SyncBatchNorm conversion.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.roles import view_cached

BATCH_NORM = re.compile(r"^(Lazy)?BatchNorm[123]d$")
# Methods that return the module they are called on.
MOVES = frozenset({"to", "cuda", "cpu", "half", "float", "double", "train", "eval"})
# List methods whose last argument goes into the list.
FILLS = frozenset({"append", "insert"})
# torch.nn containers: they hold what they are given.
CONTAINERS = frozenset(
    f"torch.nn.{name}" for name in ("Sequential", "ModuleList", "ModuleDict", "ParameterList")
)


def may_hold_batch_norm(tree, model: str | cst.BaseExpression | None) -> bool:
    """Whether a model (a name it is bound to, or an expression: `model`, `Net().cuda()`)
    may hold BatchNorm layers: what DDP030 reports and the wrap pass converts. The
    analysis decides for a model the project builds; for one built elsewhere
    (`torchvision.models.resnet18()`) or not known, whether the project names a BatchNorm
    layer at all (`nn.BatchNorm2d(...)`, `norm_layer=nn.BatchNorm2d`)."""
    if model is None:
        holds = None
    elif isinstance(model, str):
        holds = holds_batch_norm(tree, model)
    else:
        holds = expression_holds_batch_norm(tree, model)
    return names_batch_norm(tree) if holds is None else holds


def names_batch_norm(tree) -> bool:
    """Whether some module of the project names a BatchNorm layer (`BatchNorm2d`,
    `LazyBatchNorm1d`; not SyncBatchNorm): the model's layers may live in another module
    of the project (models/, layers/)."""
    return any(
        t.find(cst.Name, lambda name: BATCH_NORM.match(name.value) is not None) for t in tree.trees
    )


def holds_batch_norm(tree, target: str) -> bool | None:
    """Whether the model (or list, dict of models) bound to `target` may hold BatchNorm:
    the values assigned to `target` anywhere in the project, combined."""
    values = _filled(_bindings(tree.view).get(target, []))
    if not values:
        return None
    return _any([expression_holds_batch_norm(tree, value) for value in values])


def expression_holds_batch_norm(tree, expr: cst.BaseExpression, seen=None) -> bool | None:
    view = tree.view
    seen = set() if seen is None else seen
    if isinstance(expr, (cst.List, cst.Tuple, cst.Set, cst.Dict)) and not expr.elements:
        return None  # filled elsewhere (`nets = []` then `nets.append(Net())`, `nets["g"] = G()`)
    if isinstance(expr, (cst.List, cst.Tuple, cst.Set)):
        return _any([expression_holds_batch_norm(tree, e.value, seen) for e in expr.elements])
    if isinstance(expr, cst.Dict):
        values = [e.value for e in expr.elements if isinstance(e, cst.DictElement)]
        return _any([expression_holds_batch_norm(tree, v, seen) for v in values])
    if isinstance(expr, (cst.ListComp, cst.GeneratorExp, cst.SetComp)):
        return expression_holds_batch_norm(tree, expr.elt, seen)
    if isinstance(expr, cst.DictComp):
        return expression_holds_batch_norm(tree, expr.value, seen)
    if isinstance(expr, cst.Call):
        return _call_holds(tree, expr, seen)
    name = dotted(expr)
    if name is None:
        return None
    if _names_holder(view, name):
        return True
    if name in seen:
        return False  # already being answered higher up
    values = _filled(_bindings(view).get(name, []))
    if not values:
        return None
    seen.add(name)
    return _any([expression_holds_batch_norm(tree, value, seen) for value in values])


def _call_holds(tree, call: cst.Call, seen) -> bool | None:
    """`Net(...)` of a class that holds BatchNorm, or any call given something that does."""
    view = tree.view
    if isinstance(call.func, cst.Attribute) and call.func.attr.value in MOVES:
        return expression_holds_batch_norm(tree, call.func.value, seen)  # `Net().to(device)`
    arguments = [expression_holds_batch_norm(tree, a.value, seen) for a in call.args]
    callee = dotted(call.func)
    if callee is None:
        return _any([*arguments, None])
    if _names_holder(view, callee):
        return True
    short = callee.rsplit(".", 1)[-1]
    qualified = view.qualify(call.func) or ""
    if qualified in CONTAINERS:
        return _any(arguments)
    if short in _project_definitions(view) or qualified.startswith("torch.nn."):
        # A class or function of the project that names no BatchNorm, or a torch layer:
        # BatchNorm only through what it is given (`Wrapper(backbone)`).
        return True if True in arguments else False
    return True if True in arguments else None


def _names_holder(view, name: str) -> bool:
    short = name.rsplit(".", 1)[-1]
    return bool(BATCH_NORM.match(short)) or short in batch_norm_holders(view)


def batch_norm_holders(view) -> frozenset[str]:
    """Names of the project's classes and functions that may build BatchNorm layers."""
    return view_cached(view, "batch_norm_holders", lambda: _holders(view))


def _holders(view) -> frozenset[str]:
    definitions = _project_definitions(view)
    mentioned = {name: _names_in(view, node) for name, node in definitions.items()}
    holders = {name for name, names in mentioned.items() if any(map(BATCH_NORM.match, names))}
    grew = True
    while grew:  # a class that builds a holder, or derives from one, holds one too
        grew = False
        for name, names in mentioned.items():
            if name not in holders and names & holders:
                holders.add(name)
                grew = True
    return frozenset(holders)


def _project_definitions(view) -> dict[str, cst.CSTNode]:
    """Class and function name -> its definition, over the project's modules."""

    def compute() -> dict[str, cst.CSTNode]:
        found: dict[str, cst.CSTNode] = {}
        for tree in view.trees:
            for node in tree.module.body:  # methods are part of their class
                if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
                    found.setdefault(node.name.value, node)
                for name, value in _module_constants(node):
                    found.setdefault(name, value)
        return found

    return view_cached(view, "batch_norm_definitions", compute)


def _module_constants(node: cst.CSTNode) -> list[tuple[str, cst.BaseExpression]]:
    """`NORM = nn.BatchNorm2d` at module level: a name a class may build its layers with."""
    if not isinstance(node, cst.SimpleStatementLine):
        return []
    return [
        (small.targets[0].target.value, small.value)
        for small in node.body
        if isinstance(small, cst.Assign)
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
    ]


def _names_in(view, node: cst.CSTNode) -> frozenset[str]:
    """Every name in `node` (the last part of each attribute; bases included), not the
    name it defines."""
    return view.names_in(node) - {getattr(getattr(node, "name", None), "value", None)}


def _bindings(view) -> dict[str, list[cst.BaseExpression]]:
    """Name -> the values assigned to it, over the project's modules."""

    def compute() -> dict[str, list[cst.BaseExpression]]:
        found: dict[str, list[cst.BaseExpression]] = {}
        for assign in view.find(cst.Assign):
            for target in assign.targets:
                # `nets["g"] = Generator()` adds to `nets`
                item = target.target
                name = dotted(item.value if isinstance(item, cst.Subscript) else item)
                if name:
                    found.setdefault(name, []).append(assign.value)
        for call in view.find(cst.Call):  # `nets.append(Net())` adds to `nets`
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value in FILLS and call.args:
                name = dotted(func.value)
                if name:
                    found.setdefault(name, []).append(call.args[-1].value)
        return found

    return view_cached(view, "batch_norm_bindings", compute)


def _filled(values: list[cst.BaseExpression]) -> list[cst.BaseExpression]:
    """The values put in a collection, without the empty display it starts from (`nets =
    {}` says nothing about what `nets["g"] = G()` puts in it)."""
    empty = (cst.List, cst.Tuple, cst.Set, cst.Dict)
    filled = [v for v in values if not (isinstance(v, empty) and not v.elements)]
    return filled or values


def _any(answers: list[bool | None]) -> bool | None:
    if True in answers:
        return True
    if None in answers:
        return None
    return False
