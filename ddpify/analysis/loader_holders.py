"""Classes that hold a DataLoader and hand out its batches (pix2pix's
`CustomDatasetDataLoader`: `self.dataloader = DataLoader(self.dataset, ...)` in
`__init__`, `__iter__` yielding from it, often `load_data()` returning `self`), and the
training loops that iterate an instance of one: the loader to shard is the held one.

The instance is followed from the loop's iterable back to the class through what made it:
the class itself (`Holder(opt)`), a method of an instance that returns `self`
(`holder.load_data()`), or a function of the project whose every return is one of those
(`create_dataset(opt)`), through names bound once in that function."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import class_methods, dotted
from ddpify.analysis.values import only_value_in_function


@dataclass(frozen=True)
class HeldLoader:
    """The DataLoader a holder class builds, and how its code reaches it."""

    holder: str  # the class: `CustomDatasetDataLoader`
    attribute: str  # where the class keeps it: `self.dataloader`
    call: cst.Call  # the DataLoader(...) call
    set_epoch: cst.FunctionDef | None  # the class's own `set_epoch(self, epoch)`, if any


def held_loaders(view) -> dict[str, HeldLoader]:
    """Class name -> the loader it holds, for classes that hold exactly one DataLoader
    their `__iter__` hands out (more than one: which feeds the loop is not told)."""
    from ddpify.analysis.roles import bound_target, loader_holding_classes, view_cached

    def compute() -> dict[str, HeldLoader]:
        by_class: dict[str, list[cst.Call]] = {}
        for name, call in loader_holding_classes(view):
            by_class.setdefault(name, []).append(call)
        classes = {cls.name.value: cls for cls in view.find(cst.ClassDef)}
        found = {}
        for name, calls in by_class.items():
            cls = classes.get(name)
            if len(calls) != 1 or cls is None:
                continue
            attribute = bound_target(view.owner(calls[0]), calls[0])
            if attribute is not None:
                found[name] = HeldLoader(
                    name, attribute, calls[0], class_methods(cls).get("set_epoch")
                )
        return found

    return view_cached(view, "held_loaders", compute)


def held_loader_of(view, loop: cst.For) -> tuple[str, HeldLoader] | None:
    """(the name the loop iterates, the loader its holder hands out) when `loop` iterates
    an instance of a holder class; None when it iterates anything else or cannot be told."""
    from ddpify.analysis.roles import _class_at_run_time, iterated_source

    holders = held_loaders(view)
    if not holders or not isinstance(loop, cst.For):
        return None
    tree = view.owner(loop)
    source = iterated_source(tree, loop) if tree is not None else None
    if source is None or source.made_by is None or _class_at_run_time(view, source.made_by):
        return None
    holder = _holder_made_by(view, source.made_by, holders, depth=0)
    return (source.name, holders[holder]) if holder is not None else None


def _holder_made_by(view, call: cst.Call, holders: dict, depth: int) -> str | None:
    """The holder class an instance made by `call` belongs to, or None."""
    if depth > 3:
        return None
    callee = dotted(call.func) or ""
    short = callee.rsplit(".", 1)[-1]
    if short in holders:
        return short
    if isinstance(call.func, cst.Attribute):  # `holder.load_data()`: a method returning self
        receiver = _value_of(view, call, call.func.value)
        holder = (
            _holder_made_by(view, receiver, holders, depth + 1)
            if isinstance(receiver, cst.Call)
            else None
        )
        if holder is not None and _returns_self(view, holder, call.func.attr.value):
            return holder
        return None
    func = view.functions().get(short)
    returns = [r.value for r in view.within(func, cst.Return)] if func is not None else []
    if not returns or any(value is None for value in returns):
        return None
    made = set()
    for value in returns:
        value = _value_of(view, value, value)
        made.add(
            _holder_made_by(view, value, holders, depth + 1)
            if isinstance(value, cst.Call)
            else None
        )
    return made.pop() if len(made) == 1 else None


def _value_of(view, near: cst.CSTNode, expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """`expr`, or the one value a plain name is bound to in the function around `near`."""
    if not isinstance(expr, cst.Name):
        return expr
    return only_value_in_function(view, near, expr.value)


def _returns_self(view, holder: str, method: str) -> bool:
    cls = _class_named(view, holder)
    func = class_methods(cls).get(method) if cls is not None else None
    if func is None:
        return False
    returns = [r.value for r in view.within(func, cst.Return)]
    return bool(returns) and all(value is not None and dotted(value) == "self" for value in returns)


def early_stop(view, held: HeldLoader) -> cst.If | None:
    """The test in the holder's `__iter__` that ends the pass early (`if i * batch_size >=
    max_dataset_size: break`): it counts the batches this process sees."""
    cls = _class_named(view, held.holder)
    method = class_methods(cls).get("__iter__") if cls is not None else None
    if method is None:
        return None
    for test in view.within(method, cst.If):
        if any(isinstance(node, (cst.Break, cst.Return)) for node in view.within(test.body)):
            return test
    return None


def _class_named(view, name: str) -> cst.ClassDef | None:
    """The first class of the project by that name."""
    return next((c for c in view.find(cst.ClassDef) if c.name.value == name), None)
