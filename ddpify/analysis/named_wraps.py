"""DataParallel applied to a class's nets by name (pix2pix's `BaseModel.parallelize`):

    for name in self.model_names:
        net = getattr(self, "net" + name)
        setattr(self, "net" + name, torch.nn.DataParallel(net, self.opt.gpu_ids))

The nets are the `self.net<Name>` attributes the class's code builds; the ones an
optimizer trains are wrapped in DDP where they are built (or, built lazily, before their
optimizer), so under DDP this DataParallel only adds a second wrapper around them (and
on GPUs scatters every rank's batch over `gpu_ids`)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.roles import DATA_PARALLEL, trained_model_names
from ddpify.analysis.values import only_value_in_function


@dataclass(frozen=True)
class WrapByName:
    call: cst.Call  # DataParallel(net, ...)
    net: str  # `net`: the module it wraps, read with getattr
    attribute: str  # `"net" + name`: the computed attribute name, as written
    prefix: str  # `net`: the literal start of the attribute name ("" when none)


def data_parallel_by_name(tree) -> list[WrapByName]:
    """The `setattr(self, <attr>, DataParallel(net, ...))` calls of this module whose
    `net` is `getattr(self, <the same attr>)` in the same function."""
    found = []
    for call in tree.calls_to(DATA_PARALLEL):
        setter = _setattr_around(tree, call)
        if setter is None or not call.args or not isinstance(call.args[0].value, cst.Name):
            continue
        attribute = setter.args[1].value
        net = call.args[0].value.value
        if _got_by_name(tree, call, net, tree.code(attribute)):
            found.append(WrapByName(call, net, tree.code(attribute), _prefix(attribute)))
    return found


def trained_by_name(tree, wrap: WrapByName) -> list[str]:
    """The trained `self.` models whose attribute name the wrap can compute (those that
    start with its literal prefix): the nets DDP wraps elsewhere."""
    return sorted(
        name
        for name in trained_model_names(tree)
        if name.startswith("self.") and "." not in name[5:] and name[5:].startswith(wrap.prefix)
    )


def _setattr_around(tree, call: cst.Call) -> cst.Call | None:
    arg = tree.parent.get(call)
    setter = tree.parent.get(arg) if isinstance(arg, cst.Arg) else None
    if (
        isinstance(setter, cst.Call)
        and dotted(setter.func) == "setattr"
        and len(setter.args) == 3
        and setter.args[2] is arg
        and dotted(setter.args[0].value) == "self"
    ):
        return setter
    return None


def fetched_from_self(value: cst.BaseExpression | None) -> cst.BaseExpression | None:
    """The attribute name `value` reads from `self` when it is `getattr(self, <name>)`
    (a net fetched by name: `getattr(self, "net" + name)`); None for anything else."""
    if not (isinstance(value, cst.Call) and dotted(value.func) == "getattr"):
        return None
    args = value.args
    if len(args) != 2 or dotted(args[0].value) != "self":
        return None
    return args[1].value


def _got_by_name(tree, call: cst.Call, net: str, attribute: str) -> bool:
    """`net = getattr(self, <attribute>)`, the one binding of `net` in the function."""
    fetched = fetched_from_self(only_value_in_function(tree, call, net))
    return fetched is not None and tree.code(fetched) == attribute


def _prefix(attribute: cst.BaseExpression) -> str:
    """`net` of `"net" + name` (the leftmost string literal of a `+` chain)."""
    while isinstance(attribute, cst.BinaryOperation):
        attribute = attribute.left
    if isinstance(attribute, cst.SimpleString):
        value = attribute.evaluated_value
        return value if isinstance(value, str) else ""
    return ""
