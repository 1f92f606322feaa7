"""Computations that compare the rows of a batch with each other.

A contrastive loss (supervised contrastive, NT-Xent, CLIP-style logits) multiplies a batch of
features by the transpose of a batch of features: every sample is compared with every other
(`torch.matmul(anchor, contrast.T)`, `z @ z.t()`, `torch.cdist(a, b)`). Split by rank, each
process compares only the samples of its own batch, and no gradient average gives back the
comparison over the whole batch; the features must be gathered across ranks for that.

Only plain local names computed from the function's arguments count as the compared batches:
`x @ self.weight.T` (a layer's weight, or a local bound to one) is a projection, and a
product of values a constructor builds (an initial weight from an SVD) compares no samples.

A loss can also regroup a batch's rows by a batch-size setting instead of the tensor's own
size (PatchNCE: `feat_q.view(self.opt.batch_size, -1, dim)`, then `torch.bmm(feat_q,
feat_k.transpose(2, 1))` compares the patches within each group). The grouping follows the
configuration, not the batch the loader made: whoever changes one and not the other (verify's
one-process run at N times the per-process batch) groups other rows than the script does.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.accumulation import assigned_names
from ddpify.analysis.frozen import loop_targets
from ddpify.analysis.module_globals import parameter_for
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.reachability import never_run
from ddpify.analysis.roles import train_loaders, training_loops
from ddpify.walk import walk

MATRIX_PRODUCTS = ("torch.matmul", "torch.mm")
BATCHED_PRODUCTS = ("torch.bmm", "torch.matmul")
RESHAPES = ("view", "reshape")
DISTANCES = ("torch.cdist",)
# Methods that give the same values back (a copy, another layout or dtype).
SAME_VALUES = frozenset({"contiguous", "detach", "clone", "float", "double", "half"})
# `x.transpose(0, 1)`, `x.permute(1, 0)`: the two dimensions of a (batch, features) matrix.
SWAPS = {("0", "1"), ("1", "0")}
# `x.transpose(1, 2)`, `x.transpose(-1, -2)`: the last two dimensions of a batch of matrices.
BATCHED_SWAPS = {("1", "2"), ("2", "1"), ("-1", "-2"), ("-2", "-1")}


def _products(tree, callees, test) -> list[cst.CSTNode]:
    """Calls of `callees` (two operands first) and `@` products whose operands pass
    `test(tree, node, left, right)`."""
    found: list[cst.CSTNode] = []
    for call in tree.calls_to(*callees):
        if len(call.args) >= 2 and test(tree, call, call.args[0].value, call.args[1].value):
            found.append(call)
    for product in tree.find(cst.BinaryOperation, _is_matrix_product):
        if test(tree, product, product.left, product.right):
            found.append(product)
    return found


def batch_comparisons(tree) -> list[cst.CSTNode]:
    """The products and distances in this module that compare the rows of one batch of
    features with the rows of another (or the same) batch."""
    found = _products(tree, MATRIX_PRODUCTS, _compares_rows)
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
    """`x` for `x.T`, `x.t()`, `x.transpose(0, 1)`, `x.permute(1, 0)`, also followed by
    calls that keep the values (`x.t().contiguous()`); else None."""
    expr = _without_copies(expr)
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


def _without_copies(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`x.t()` for `x.t().contiguous()`, `x.t().detach().float()`: copies of the same rows."""
    while (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and not expr.args
        and method_name(expr) in SAME_VALUES
    ):
        expr = expr.func.value
    return expr


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
    entry = tree.trees[0] is tree
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


def setting_groupings(tree) -> list[cst.CSTNode]:
    """Batched products (`torch.bmm(q, k.transpose(2, 1))`, `q @ k.transpose(1, 2)`) in
    this module that compare rows within groups a function made by a batch-size setting:
    an operand reshaped as `q.view(self.opt.batch_size, -1, dim)` (or through a local bound
    to such a setting)."""
    found = _products(tree, BATCHED_PRODUCTS, _groups_by_setting)
    return sorted(found, key=lambda node: tree.order.get(node, 0))


def _groups_by_setting(tree, node, left, right) -> bool:
    inner = _batch_transposed(right)
    function = tree.function(node)
    if inner is None or function is None:
        return False
    regrouped = _regrouped_by_setting(tree, function)
    names = {e.value for e in (left, inner) if isinstance(e, cst.Name)}
    return bool(names & regrouped)


def _batch_transposed(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """`x` for `x.transpose(1, 2)`, `x.transpose(-1, -2)`, `x.mT`; else None."""
    if isinstance(expr, cst.Attribute) and expr.attr.value == "mT":
        return expr.value
    if not (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)):
        return None
    if method_name(expr) != "transpose" or len(expr.args) != 2:
        return None
    positions = tuple(_integer_text(arg.value) for arg in expr.args if not arg.keyword)
    return expr.func.value if positions in BATCHED_SWAPS else None


def _integer_text(expr: cst.BaseExpression) -> str | None:
    """`2` for `2`, `-1` for `-1`; None for anything else."""
    if isinstance(expr, cst.Integer):
        return expr.value
    if (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
    ):
        return "-" + expr.expression.value
    return None


def _regrouped_by_setting(tree, function: cst.FunctionDef) -> set[str]:
    """The locals of `function` assigned `x.view(<batch-size setting>, ...)` or
    `x.reshape(...)` of one."""
    assignments = list(tree.within(function, cst.Assign))
    settings = set()
    for assign in assignments:
        if _is_batch_size_setting(assign.value, set()):
            for target in assign.targets:
                settings |= loop_targets(target.target)
    regrouped = set()
    for assign in assignments:
        value = assign.value
        if not (isinstance(value, cst.Call) and method_name(value) in RESHAPES and value.args):
            continue
        if _is_batch_size_setting(value.args[0].value, settings):
            for target in assign.targets:
                regrouped |= loop_targets(target.target)
    return regrouped


def _is_batch_size_setting(expr: cst.BaseExpression, locals_bound: set[str]) -> bool:
    """`opt.batch_size`, `self.args.batch_size`, `cfg["batch_size"]`: a batch size read from
    the configuration, or a local bound to one (a bare `batch_size` may be `x.size(0)`)."""
    if isinstance(expr, cst.Name):
        return expr.value in locals_bound
    if isinstance(expr, cst.Attribute):
        return expr.attr.value.lower().endswith("batch_size")
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        key = expr.slice[0].slice
        if isinstance(key, cst.Index) and isinstance(key.value, cst.SimpleString):
            return str(key.value.evaluated_value).lower().endswith("batch_size")
    return False


# Calls whose arguments give a tensor's shape: `torch.eye(2 * bs)`, `torch.arange(bs)`.
SIZED_FACTORIES = frozenset(
    {
        "torch.eye",
        "torch.arange",
        "torch.zeros",
        "torch.ones",
        "torch.full",
        "torch.empty",
        "torch.randn",
        "torch.rand",
        "torch.randperm",
    }
)
# Methods whose arguments give the result's shape: `x.view(bs, -1)`, `x.new_zeros(bs)`.
SIZED_METHODS = frozenset(
    {*RESHAPES, "expand", "repeat", "new_zeros", "new_ones", "new_full", "new_empty"}
)
# What may stand between a setting and the call or slice it sizes: `2 * bs`, `(bs, -1)`.
SIZE_ARITHMETIC = (
    cst.BinaryOperation,
    cst.UnaryOperation,
    cst.Arg,
    cst.Element,
    cst.Tuple,
    cst.List,
)


def setting_sized_tensors(tree) -> list[cst.BaseExpression]:
    """Reads of the training loader's batch-size setting that size a tensor in a training
    step of this module: `torch.eye(2 * args.batch_size)`, `out.view(batch_size, -1)`,
    `labels = torch.arange(batch_size)`, `z[:batch_size]`, where the loader was built
    here with `batch_size=args.batch_size` and `batch_size` is `args.batch_size` itself or
    a parameter every call of the step function binds to it. The step: a training loop's
    body, and the module's functions that loop calls by name (a loss helper).

    The shape follows the configuration, not the batch the loader made: whoever divides the
    loader's batch (migrate's global batch policy, `batch_size // WORLD_SIZE`) and not the
    setting sizes these tensors for rows the step no longer gets. Returned in source order,
    the read itself (`args.batch_size`, or the parameter's name)."""
    settings = _loader_settings(tree)
    if not settings:
        return []
    found: dict[int, cst.BaseExpression] = {}
    for body, function in _step_bodies(tree):
        params = _parameters_bound_to(tree, function, settings) if function else set()
        for node in tree.within(body):
            if _reads_setting(tree, node, settings, params) and _sizes_a_tensor(tree, node):
                found[id(node)] = node
    return sorted(found.values(), key=lambda node: tree.order.get(node, 0))


def _step_bodies(tree) -> list[tuple[cst.CSTNode, cst.FunctionDef | None]]:
    """The bodies of the training loops of this module (with the function around each), and
    of the module's functions a training loop calls by name."""
    functions = tree.functions()
    bodies: list[tuple[cst.CSTNode, cst.FunctionDef | None]] = []
    for loop in training_loops(tree):
        bodies.append((loop.body, tree.function(loop)))
        for call in tree.within(loop.body, cst.Call):
            helper = functions.get(dotted(call.func) or "")
            if helper is not None:
                bodies.append((helper.body, helper))
    return bodies


def _loader_settings(tree) -> set[str]:
    """The code of the `batch_size=` settings of the training loaders built in this module
    (`args.batch_size`, `cfg["batch_size"]`); a bare name or a literal is not a setting."""
    settings = set()
    for loader in train_loaders(tree)[0]:
        if not tree.owns(loader.call):
            continue
        size = find_arg(loader.call, "batch_size", 1)
        if size is not None and _is_batch_size_setting(size.value, set()):
            settings.add(tree.code(size.value))
    return settings


def _parameters_bound_to(tree, function: cst.FunctionDef, settings: set[str]) -> set[str]:
    """The parameters of `function` that every call of it by name in this module binds to
    one of `settings` (`train(net, loader, opt, args.batch_size)`), and that the function
    never rebinds."""
    calls = [c for c in tree.find(cst.Call) if dotted(c.func) == function.name.value]
    bound: dict[str, bool] = {}
    for call in calls:
        for arg in call.args:
            param = parameter_for(function, call, arg)
            if param is not None:
                passed = tree.code(arg.value) in settings
                bound[param] = bound.get(param, True) and passed
    rebound = assigned_names(function.body)
    return {param for param, always in bound.items() if always and param not in rebound}


def _reads_setting(tree, node: cst.CSTNode, settings: set[str], params: set[str]) -> bool:
    if isinstance(node, cst.Name):
        parent = tree.parent.get(node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return False  # the `batch_size` of `opt.batch_size`
        return node.value in params
    if isinstance(node, (cst.Attribute, cst.Subscript)):
        return _is_batch_size_setting(node, set()) and tree.code(node) in settings
    return False


def _sizes_a_tensor(tree, node: cst.CSTNode) -> bool:
    """Whether `node` (with arithmetic around it) is a shape argument of a tensor factory
    or a reshape, or a bound of a slice (`out[:bs]`, `out[bs:]`)."""
    child, parent = node, tree.parent.get(node)
    while isinstance(parent, SIZE_ARITHMETIC):
        child, parent = parent, tree.parent.get(parent)
    if isinstance(parent, cst.Slice):
        return child is parent.lower or child is parent.upper
    if not isinstance(parent, cst.Call) or parent.func is child:
        return False
    if isinstance(parent.func, cst.Attribute) and method_name(parent) in SIZED_METHODS:
        return True
    return tree.qualify(parent.func) in SIZED_FACTORIES
