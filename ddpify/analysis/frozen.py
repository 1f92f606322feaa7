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


def freezes_part(owner: cst.BaseExpression, ancestors: Sequence[cst.CSTNode], wrap: Wrap) -> bool:
    """Whether switching off `owner`'s gradients leaves others of the wrapped model on.

    DDP only stops when some parameters get gradients and others do not: a model frozen
    whole (`for p in teacher.parameters(): p.requires_grad = False`, an EMA teacher that
    never runs a backward) finishes no reduction and starts none. So: a submodule
    (`model.module.backbone`), or a loop over the parameters that picks some under an
    `if` or iterates a submodule's."""
    whole = {name for name in (wrap.target, wrap.inner) if name is not None}
    whole |= {f"{name}.module" for name in whole}
    name = dotted(owner)
    if name is None:
        return False
    head = name.split(".")[0]
    for index in range(len(ancestors) - 1, -1, -1):
        loop = ancestors[index]
        if isinstance(loop, cst.For) and head in loop_targets(loop.target):
            if not iterated_models(loop.iter) <= whole:
                return True  # `for p in model.module.encoder.parameters()`
            return any(isinstance(node, cst.If) for node in ancestors[index + 1 :])
    return name not in whole
