"""Parameters whose `requires_grad` changes, and whether a DDP wrap came before.

DDP registers its hooks and buckets on the parameters that need gradients at
construction. Freezing some afterwards (`p.requires_grad = False` in a loop over
`model.parameters()`, `model.backbone.requires_grad_(False)`) leaves DDP waiting for
gradients that never come ("Expected to have finished reduction in the prior
iteration") unless it was built with `find_unused_parameters=True`. DDP031 reports the
change itself; DDP034 reports the wrap that is not told about it.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.wrappers import Place, Wrap, WrapperFacts, may_follow
from ddpify.walk import children

# Iterating these over the model reaches its parameters (`for p in model.parameters()`).
PARAMETER_ITERATORS = frozenset(
    {"parameters", "named_parameters", "modules", "named_modules", "children"}
)


def loop_targets(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for e in target.elements for n in loop_targets(e.value)}
    return set()


def iterated_models(iterable: cst.BaseExpression) -> set[str]:
    """`model` for `model.parameters()`, `model.module.backbone.named_parameters()`."""
    found = set()
    stack: list[cst.CSTNode] = [iterable]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Call) and method_name(node) in PARAMETER_ITERATORS:
            receiver = dotted(node.func.value)  # type: ignore[attr-defined]
            if receiver is not None:
                found.add(receiver)
        stack.extend(children(node))
    return found


def model_roots(expr: cst.BaseExpression, ancestors: Sequence[cst.CSTNode]) -> frozenset[str]:
    """Names through which `expr` reaches a model: itself when dotted, else the iterable
    of the loop that binds it (`for p in model.parameters()`)."""
    name = dotted(expr)
    if name is None:
        return frozenset()
    head = name.split(".")[0]
    for node in reversed(ancestors):
        if isinstance(node, cst.For) and head in loop_targets(node.target):
            return frozenset(iterated_models(node.iter))
    return frozenset({name})


def wrap_before(facts: WrapperFacts, roots: frozenset[str], place: Place) -> Wrap | None:
    """A wrap of the model that `roots` reach, which runs before `place`."""
    for wrap in facts.wraps:
        if not may_follow(wrap.place, place):
            continue
        if any(_reaches(facts, root, wrap, place) for root in roots):
            return wrap
    return None


def _reaches(facts: WrapperFacts, root: str, wrap: Wrap, place: Place) -> bool:
    """`root` is the wrapper (or a part of its `.module`) or the module it wraps, as
    bound at the wrap."""
    target = wrap.target
    if target is not None and (root == target or root.startswith(f"{target}.module")):
        return facts.wrap_held(cst.parse_expression(target), place) is wrap
    if wrap.inner is None or not (root == wrap.inner or root.startswith(f"{wrap.inner}.")):
        return False
    binding = facts.binding_of(wrap.inner, place)
    return binding is None or binding.place.seq < wrap.place.seq


def may_switch_off(value: cst.BaseExpression | None) -> bool:
    """Whether a `requires_grad` value may be False: anything but a literal True
    (`requires_grad_()` with no argument is True)."""
    if value is None:
        return False
    return not (isinstance(value, cst.Name) and value.value == "True")
