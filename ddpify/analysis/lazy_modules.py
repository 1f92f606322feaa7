"""Where a module whose layers its first forward builds can be wrapped in DDP.

`roles.lazily_built_models` finds the models an optimizer trains only after a forward, in
a method of their class's owner (a data-dependent initialisation: pix2pix's
`data_dependent_initialize`, a patch-sampling head that makes its MLPs on its first call),
and models of `nn.Lazy*` layers that a dry-run forward materialises before their optimizer
is made, in the same function. DDP registers the parameters the module has when it is
wrapped (and refuses uninitialised ones), so the wrap must come after that forward and no
later than the optimizer: right before the statement that builds the optimizer. DDP
broadcasts rank 0's parameters as it is built, so every rank starts from rank 0's layers."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.roles import (
    LazilyBuilt,
    lazily_built_models,
    optimizer_calls,
    statement_before,
    trained_owners,
)

LAZY_LAYERS = "torch.nn.Lazy"  # torch.nn.LazyLinear, LazyConv2d, LazyBatchNorm1d, ...


def lazy_wrap_points(tree) -> list[tuple[LazilyBuilt, cst.SimpleStatementLine | None]]:
    """Each lazily built model, with the statement to wrap it before (the one that builds
    its optimizer), or None where no such statement can take a wrap before it."""
    view = tree.view
    lazy = lazily_built_models(tree) + dry_run_models(tree)
    return [(model, _wrap_point(view, model)) for model in lazy]


def dry_run_models(tree) -> list[LazilyBuilt]:
    """Models of this module built with `nn.Lazy*` layers (their own, or their class's)
    that a forward runs on (`model(x[:2])`) after they are built and before the optimizer
    over them is made, all in one function: the dry run materialises the layers, so the
    wrap goes after it (DDP refuses uninitialised parameters)."""
    view = tree.view
    lazy_classes = _classes_with_lazy_layers(view)
    found = []
    for optimizer in optimizer_calls(tree):
        scope = tree.scope(optimizer)
        for model in trained_owners(view, optimizer):
            binding = _lazy_binding(tree, scope, model, optimizer, lazy_classes)
            forward = binding is not None and _forward_between(
                tree, scope, model, binding, optimizer
            )
            if forward:
                name = scope.name.value if isinstance(scope, cst.FunctionDef) else "<module>"
                found.append(LazilyBuilt(model, optimizer, forward, name))
    return found


def _classes_with_lazy_layers(view) -> set[str]:
    return {
        cls.name.value
        for cls in view.find(cst.ClassDef)
        if any(_is_lazy_layer(view, call) for call in view.within(cls, cst.Call))
    }


def _is_lazy_layer(view, call: cst.Call) -> bool:
    return (view.qualify(call.func) or "").startswith(LAZY_LAYERS)


def _lazy_binding(tree, scope, model: str, optimizer: cst.Call, lazy_classes: set[str]):
    """The statement of `scope` before `optimizer` that binds `model` to a module built
    with lazy layers, if any (the last such binding)."""
    found = None
    for assign in tree.within(scope, cst.Assign):
        if tree.scope(assign) is not scope or not statement_before(tree, assign, optimizer):
            continue
        if not any(dotted(target.target) == model for target in assign.targets):
            continue
        calls = [assign.value, *tree.within(assign.value, cst.Call)]
        if any(
            isinstance(call, cst.Call)
            and (
                _is_lazy_layer(tree, call)
                or (dotted(call.func) or "").rsplit(".", 1)[-1] in lazy_classes
            )
            for call in calls
        ):
            found = assign
    return found


def _forward_between(tree, scope, model: str, binding, optimizer: cst.Call) -> cst.Call | None:
    for call in tree.within(scope, cst.Call):
        if (
            dotted(call.func) == model
            and statement_before(tree, binding, call)
            and statement_before(tree, call, optimizer)
        ):
            return call
    return None


def _wrap_point(view, lazy: LazilyBuilt) -> cst.SimpleStatementLine | None:
    statement = view.statement(lazy.optimizer)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None  # `for p in ...:` or `with ...:` headers: no line of its own
    if len(statement.body) != 1:
        return None  # `a = 1; opt = Adam(...)`: the wrap would split the line
    small = statement.body[0]
    if isinstance(small, (cst.Assign, cst.Expr, cst.AugAssign, cst.AnnAssign)):
        return statement
    return None
