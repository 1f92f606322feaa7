"""Which modules an optimizer trains: the owners of the parameters it is given.

`optim.Adam(model.parameters())` trains `model`; so do the spellings real scripts use:
`itertools.chain(G.parameters(), D.parameters())`, `list(enc.parameters()) +
list(dec.parameters())`, parameter groups `[{"params": net.head.parameters()}, ...]`
and per-layer optimizers (`SGD(model.fc.parameters())`). Several optimizers (a GAN's
generator and discriminator) train several modules: every one of them must be wrapped,
or the ranks train different copies of the one left out.

Purely syntactic: the caller resolves names (`model.fc` to the `model` it belongs to).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted, method_name
from ddpify.walk import walk

PARAMETER_METHODS = ("parameters", "named_parameters")
LITERAL_KEYS = (cst.SimpleString, cst.Integer)


def parameter_owners(optimizer: cst.Call) -> list[str]:
    """The dotted receivers of `.parameters()` calls in an optimizer's arguments, in
    order of appearance, without repeats (`G`, `D` for `chain(G.parameters(), D...)`)."""
    owners: list[str] = []

    def enter(node: cst.CSTNode) -> None:
        if isinstance(node, cst.Call) and method_name(node) in PARAMETER_METHODS:
            name = dotted(node.func.value)  # type: ignore[attr-defined]
            if name is not None and name not in owners:
                owners.append(name)

    for arg in optimizer.args:
        walk(arg.value, enter, lambda node: None)
    return owners


def collection_owners(optimizer: cst.Call) -> list[str]:
    """The collections whose items the optimizer trains: `nets` for
    `Adam(nets["g"].parameters())` or `SGD(models[0].parameters())`, an item picked by a
    literal key or index (`nets[key]` may be any item: not an owner)."""
    owners: list[str] = []

    def enter(node: cst.CSTNode) -> None:
        if not (isinstance(node, cst.Call) and method_name(node) in PARAMETER_METHODS):
            return
        item = node.func.value  # type: ignore[attr-defined]
        if not isinstance(item, cst.Subscript) or len(item.slice) != 1:
            return
        key = item.slice[0].slice
        literal = isinstance(key, cst.Index) and isinstance(key.value, LITERAL_KEYS)
        name = dotted(item.value)
        if literal and name is not None and name not in owners:
            owners.append(name)

    for arg in optimizer.args:
        walk(arg.value, enter, lambda node: None)
    return owners
