"""Bundles of models a helper function builds and returns, trained by key where received.

`self.nets, self.nets_ema = build_model(args)` with `build_model` (in any module of the
project) returning `Munch(generator=G, discriminator=D)` (or a dict), and the receiver
training the bundle's items by key: `optims[k] = Adam(self.nets[k].parameters())` for
`k in self.nets.keys()`. The questions: which helper builds the bundle, which entries it
holds, which of those it wraps in DataParallel (each entry a `DataParallel(...)`, so the
receiver reaches the module as `.module`), and which DataParallel calls feed the bundles
(copies for an EMA included: `deepcopy(generator)` of a DataParallel is one too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.roles import (
    DATA_PARALLEL,
    class_of,
    keyed_collection_owners,
    project_optimizer_calls,
    view_cached,
)
from ddpify.analysis.tree import Tree

# Dicts with attribute access a helper returns models in (`nets.generator`).
MAPPING_CLASSES = frozenset({"dict", "OrderedDict", "Munch", "EasyDict", "edict", "AttrDict"})


@dataclass
class HelperBundle:
    """What `helper` returns (at `position` of its tuple, None for the value itself)."""

    helper: cst.FunctionDef
    returned: str  # the helper's name for the bundle (`nets`)
    position: int | None
    container: str  # the mapping's class (`Munch`; `dict` for a display or `dict(...)`)
    entries: dict[str, str] = field(default_factory=dict)  # key -> the helper's name for it
    # keys whose value the helper wraps in DataParallel (`nn.DataParallel(Generator(...))`)
    data_parallel: set[str] = field(default_factory=set)


@dataclass
class TrainedBundle:
    """A bundle received from a helper (`self.nets` in `receiving`) whose items
    `optimizer` trains by key."""

    collection: str
    receiving: cst.BaseStatement
    optimizer: cst.Call
    bundle: HelperBundle


def trained_helper_bundles(tree: Tree) -> list[TrainedBundle]:
    """Every bundle of the project that a helper returns and the receiver trains by key."""
    view = tree.view
    return view_cached(view, "trained_helper_bundles", lambda: _trained_bundles(tree))


def _trained_bundles(tree: Tree) -> list[TrainedBundle]:
    view = tree.view
    found = []
    for optimizer in project_optimizer_calls(tree):
        for collection in keyed_collection_owners(view, optimizer):
            receiving = receiving_statement(view, collection, optimizer)
            if receiving is None:
                continue
            bundle = helper_bundle(view, receiving, collection)
            if bundle is not None:
                found.append(TrainedBundle(collection, receiving, optimizer, bundle))
    return found


def data_parallel_feeding_bundles(tree: Tree) -> list[cst.Call]:
    """The DataParallel calls of `tree` inside helpers whose bundles are trained by key:
    the trained entries' wrappers and their EMA copies' alike."""
    helpers = {id(t.bundle.helper) for t in trained_helper_bundles(tree)}
    return [
        call
        for call in tree.calls_to(DATA_PARALLEL)
        if (func := tree.function(call)) is not None and id(func) in helpers
    ]


def receiving_statement(view, collection: str, near: cst.CSTNode) -> cst.BaseStatement | None:
    """The statement that binds `collection` (alone or in a tuple) to a call's result:
    in the class of `near` for `self.nets`, in its function for a plain name."""
    cls = class_of(view, near) if collection.startswith("self.") else None
    scope = view.function(near)
    for assign in view.find(cst.Assign):
        if not isinstance(assign.value, cst.Call):
            continue
        if cls is not None and not view.inside(assign, cls):
            continue
        if cls is None and view.function(assign) is not scope:
            continue
        if any(_position(t.target, collection) is not False for t in assign.targets):
            return view.statement(assign)
    return None


def _position(target: cst.BaseExpression, name: str) -> int | None | bool:
    """None when `target` is `name`, its index in a tuple target, False when absent."""
    if dotted(target) == name:
        return None
    if isinstance(target, (cst.Tuple, cst.List)):
        for index, element in enumerate(target.elements):
            if dotted(element.value) == name:
                return index
    return False


def helper_bundle(view, receiving: cst.BaseStatement, collection: str) -> HelperBundle | None:
    """The bundle that the helper called in `receiving` returns into `collection`, when
    the helper is a module-level function of the project whose every return gives, at
    that position, one name bound to a mapping of models."""
    small = receiving.body[0] if isinstance(receiving, cst.SimpleStatementLine) else None
    if not isinstance(small, cst.Assign) or not isinstance(small.value, cst.Call):
        return None
    positions = [_position(t.target, collection) for t in small.targets]
    position = next((p for p in positions if p is not False), False)
    callee = dotted(small.value.func)
    helper = view.functions().get(callee.rsplit(".", 1)[-1]) if callee else None
    if position is False or helper is None or class_of(view, helper) is not None:
        return None
    returned = _returned_values(view, helper, position)
    if len(returned) != 1:
        return None
    if _container(returned[0]) is not None:  # `return dict(generator=g, ...), ...`
        return _mapping_bundle(view, helper, returned[0], "", position, {})
    name = dotted(returned[0])
    return _mapping_bound(view, helper, name, position) if name else None


def _returned_values(view, helper: cst.FunctionDef, position: int | None) -> list:
    """What each return of `helper` gives at `position`: one value per return, or []
    when a return gives no value there."""
    values = []
    for node in view.within(helper, cst.Return):
        value = node.value
        if position is not None:
            if not isinstance(value, cst.Tuple) or len(value.elements) <= position:
                return []
            value = value.elements[position].value
        if value is None:
            return []
        values.append(value)
    return values


def _mapping_bound(
    view, helper: cst.FunctionDef, name: str, position: int | None
) -> HelperBundle | None:
    """The one mapping `name` is bound to in `helper`, its entries (those set after it,
    `nets.fan = fan`, too) and which entries are DataParallel wrappers."""
    bindings = [
        assign
        for assign in view.within(helper, cst.Assign)
        if any(dotted(t.target) == name for t in assign.targets)
    ]
    if len(bindings) != 1:
        return None
    added = {}
    for assign in view.within(helper, cst.Assign):
        for target in assign.targets:
            key = _entry_set(target.target, name)
            if key is not None:
                added[key] = view.code(assign.value)
    return _mapping_bundle(view, helper, bindings[0].value, name, position, added)


def _mapping_bundle(
    view, helper, value: cst.BaseExpression, name: str, position: int | None, added: dict
) -> HelperBundle | None:
    entries = _entries(value)
    if entries is None:
        return None
    entries.update(added)
    bundle = HelperBundle(helper, name, position, _container(value) or "dict", entries)
    wrapped = _data_parallel_names(view, helper)
    bundle.data_parallel = {key for key, value in entries.items() if value in wrapped}
    return bundle


def _container(value: cst.BaseExpression) -> str | None:
    if isinstance(value, cst.Dict):
        return "dict"
    if isinstance(value, cst.Call):
        short = (dotted(value.func) or "").rsplit(".", 1)[-1]
        return short if short in MAPPING_CLASSES else None
    return None


def _entries(value: cst.BaseExpression) -> dict[str, str] | None:
    """`Munch(generator=g)`, `dict(generator=g)`, `{"generator": g}`: key -> value code."""
    module = cst.Module([])
    if isinstance(value, cst.Dict):
        entries = {}
        for element in value.elements:
            if not isinstance(element, cst.DictElement) or not isinstance(
                element.key, cst.SimpleString
            ):
                return None
            entries[str(element.key.evaluated_value)] = module.code_for_node(element.value)
        return entries
    if _container(value) is None or not isinstance(value, cst.Call):
        return None
    if any(arg.keyword is None for arg in value.args):
        return None  # `Munch(other)`: entries this helper does not spell out
    return {arg.keyword.value: module.code_for_node(arg.value) for arg in value.args}  # type: ignore[union-attr]


def _entry_set(target: cst.BaseExpression, name: str) -> str | None:
    """`fan` for `nets.fan = ...` or `nets["fan"] = ...`."""
    if isinstance(target, cst.Attribute) and dotted(target.value) == name:
        return target.attr.value
    if isinstance(target, cst.Subscript) and dotted(target.value) == name:
        key = target.slice[0].slice if len(target.slice) == 1 else None
        if isinstance(key, cst.Index) and isinstance(key.value, cst.SimpleString):
            return str(key.value.evaluated_value)
    return None


def _data_parallel_names(view, helper: cst.FunctionDef) -> set[str]:
    """Names `helper` binds to a DataParallel wrapper, or to a deep copy of one."""
    names: set[str] = set()
    for assign in view.within(helper, cst.Assign):
        value = assign.value
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            if value.func.attr.value not in ("to", "cuda", "eval", "train"):
                break
            value = value.func.value  # `nn.DataParallel(G()).to(device)`
        if not isinstance(value, cst.Call):
            continue
        qualified = view.qualify(value.func)
        wraps = qualified == DATA_PARALLEL
        copied = qualified == "copy.deepcopy" and value.args
        if copied and dotted(value.args[0].value) in names:
            wraps = True
        if wraps:
            names |= {n for t in assign.targets if (n := dotted(t.target))}
    return names
