"""Computations that compare the rows of a batch with each other.

A contrastive loss (supervised contrastive, NT-Xent, CLIP-style logits) multiplies a batch of
features by the transpose of a batch of features: every sample is compared with every other
(`torch.matmul(anchor, contrast.T)`, `z @ z.t()`, `torch.cdist(a, b)`). Split by rank, each
process compares only the samples of its own batch, and no gradient average gives back the
comparison over the whole batch; the features must be gathered across ranks for that.

Only plain local names computed from the function's arguments count as the compared batches:
`x @ self.weight.T` (a layer's weight, or a local bound to one) is a projection, and a
product of values a constructor builds (an initial weight from an SVD) compares no samples.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.frozen import loop_targets
from ddpify.analysis.names import find_arg, method_name
from ddpify.analysis.reachability import never_run
from ddpify.analysis.roles import training_loops
from ddpify.walk import walk

MATRIX_PRODUCTS = ("torch.matmul", "torch.mm")
DISTANCES = ("torch.cdist",)
# `x.transpose(0, 1)`, `x.permute(1, 0)`: the two dimensions of a (batch, features) matrix.
SWAPS = {("0", "1"), ("1", "0")}


def batch_comparisons(tree) -> list[cst.CSTNode]:
    """The products and distances in this module that compare the rows of one batch of
    features with the rows of another (or the same) batch."""
    found: list[cst.CSTNode] = []
    for call in tree.calls_to(*MATRIX_PRODUCTS):
        if len(call.args) >= 2 and _compares_rows(
            tree, call, call.args[0].value, call.args[1].value
        ):
            found.append(call)
    for product in tree.find(cst.BinaryOperation, _is_matrix_product):
        if _compares_rows(tree, product, product.left, product.right):
            found.append(product)
    for call in tree.calls_to(*DISTANCES):
        values = [arg.value for arg in call.args[:2]]
        if len(values) == 2 and all(_batch_name(tree, call, v) for v in values):
            found.append(call)
    return sorted(found, key=lambda node: tree.order.get(node, 0))


def _is_matrix_product(node: cst.CSTNode) -> bool:
    return isinstance(node.operator, cst.MatrixMultiply)


def _compares_rows(tree, node, left, right) -> bool:
    inner = _transposed(right)
    return inner is not None and _batch_name(tree, node, left) and _batch_name(tree, node, inner)


def _transposed(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """`x` for `x.T`, `x.t()`, `x.transpose(0, 1)`, `x.permute(1, 0)`; else None."""
    if isinstance(expr, cst.Attribute) and expr.attr.value == "T":
        return expr.value
    if not (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)):
        return None
    name = method_name(expr)
    positions = tuple(
        arg.value.value
        for arg in expr.args
        if isinstance(arg.value, cst.Integer) and not arg.keyword
    )
    if name == "t" and not expr.args:
        return expr.func.value
    if name in ("transpose", "permute") and positions in SWAPS and len(expr.args) == 2:
        return expr.func.value
    return None


def _batch_name(tree, node: cst.CSTNode, expr: cst.BaseExpression) -> bool:
    """A plain local name inside a function, computed from what the function is given (not
    from `self`: a layer's weight, or an initial value built in a constructor)."""
    if not isinstance(expr, cst.Name):
        return False
    function = tree.function(node)
    return function is not None and expr.value in _from_arguments(tree, function)


def _from_arguments(tree, function: cst.FunctionDef) -> set[str]:
    """The function's parameters (but `self` and `cls`) and the locals assigned from them,
    followed in source order until nothing changes."""
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    derived = {p.name.value for p in every} - {"self", "cls"}
    assignments = list(tree.within(function, cst.Assign))
    changed = True
    while changed:
        changed = False
        for assign in assignments:
            if not _names_read(assign.value) & derived:
                continue
            for target in assign.targets:
                for name in loop_targets(target.target) - derived:
                    derived.add(name)
                    changed = True
    return derived


def _names_read(value: cst.BaseExpression) -> set[str]:
    """The plain names an expression reads: `self` in `self.dim`, never the `dim`."""
    found: set[str] = set()
    attributes: set[int] = set()

    def enter(node: cst.CSTNode) -> None:
        if type(node) is cst.Attribute:
            attributes.add(id(node.attr))
        elif type(node) is cst.Name and id(node) not in attributes:
            found.add(node.value)

    walk(value, enter, lambda node: None)
    return found


# Losses that can leave targets out of their mean (`ignore_index`).
MASKED_MEAN_LOSSES = frozenset(
    {
        "torch.nn.functional.cross_entropy",
        "torch.nn.functional.nll_loss",
        "torch.nn.CrossEntropyLoss",
        "torch.nn.NLLLoss",
    }
)


def masked_mean_losses(tree) -> list[cst.Call]:
    """`cross_entropy(..., ignore_index=-1)` with the mean reduction, in the entry
    script or a module that trains: it divides by the count of the batch's targets it
    does not ignore, so the batch's rows share one denominator. Split across ranks, each
    rank divides by its own count and DDP averages those means: not the original's mean
    when the ranks count different numbers."""
    found: list[cst.Call] = []
    # Only the entry script or a module that trains: a loss library a configuration picks
    # from (or never names) holds many losses the run may not use.
    entry = getattr(tree.view, "trees", [tree])[0] is tree
    if not entry and not any(tree.owns(loop) for loop in training_loops(tree)):
        return found
    for call in tree.calls_to(*MASKED_MEAN_LOSSES):
        if find_arg(call, "ignore_index") is None or never_run(tree.view, call):
            continue  # (a helper module's function the project never names)
        reduction = find_arg(call, "reduction")
        if reduction is not None and not _is_mean(reduction.value):
            continue
        if any(_is_false(find_arg(call, legacy)) for legacy in ("reduce", "size_average")):
            continue  # the legacy spellings of reduction="none" and "sum"
        found.append(call)
    return found


def _is_false(arg: cst.Arg | None) -> bool:
    return arg is not None and isinstance(arg.value, cst.Name) and arg.value.value == "False"


def _is_mean(value: cst.BaseExpression) -> bool:
    return isinstance(value, cst.SimpleString) and value.evaluated_value == "mean"
