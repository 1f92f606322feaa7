"""Which objects play which role in training: the model, the optimizer, the loaders that
feed the step, the loops that run it; and where hand-made batches enter the step.

Both `ddpify migrate` (every pass) and the rules ask these questions here. Each function
takes the `Tree` of one module; when the module is part of a project (`tree.view` is a
`ProjectView`), the search runs over every module of the project (a loop in
`trainer.py` that iterates a loader built in `data.py`), and what is returned for
rewriting stays in the module asked about.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.batches import BatchAssignment, batch_assignments, names_read
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.trained import trained_modules
from ddpify.analysis.tree import Tree

DDP = "torch.nn.parallel.DistributedDataParallel"
DATA_PARALLEL = "torch.nn.parallel.DataParallel"
DATA_LOADER = "torch.utils.data.DataLoader"
DIST_SAMPLER = "torch.utils.data.DistributedSampler"
ITERABLE_DATASET = "torch.utils.data.IterableDataset"
# Wrappers around the loader in `for batch in tqdm(enumerate(loader))`.
ITER_WRAPPERS = {"enumerate", "tqdm", "iter", "zip", "progress_bar"}


def local_rank_arguments(tree: Tree) -> list[cst.Call]:
    """`parser.add_argument("--local_rank", ...)`: the torch.distributed.launch contract."""
    found = []
    for call in tree.find(cst.Call, lambda c: method_name(c) == "add_argument"):
        for arg in call.args:
            value = arg.value
            if isinstance(value, cst.SimpleString) and value.evaluated_value in (
                "--local_rank",
                "--local-rank",
            ):
                found.append(call)
                break
    return found


# -- objects ----------------------------------------------------------------------------


def optimizer_calls(tree: Tree) -> list[cst.Call]:
    def is_optimizer(call: cst.Call) -> bool:
        name = tree.qualify(call.func) or ""
        return name.startswith("torch.optim.") and ".lr_scheduler." not in name

    return tree.find(cst.Call, is_optimizer)


def bound_target(tree: Tree, call: cst.Call) -> str | None:
    """`x` in `x = call(...)` (also through `.to()` chains), else None."""
    statement = tree.statement(call)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    small = statement.body[0]
    if isinstance(small, (cst.Assign, cst.AnnAssign)):
        value = small.value
        while (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value is not call
            and isinstance(value.func.value, cst.Call)
        ):
            value = value.func.value
        if value is call:
            target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
            return dotted(target)
    return None


def model_names(tree: Tree) -> set[str]:
    """Names that hold the model: `X` in `optim.SGD(X.parameters())`, DDP/DP targets,
    and the parameters of the script's functions that receive one of them."""
    names: set[str] = set()
    names.update(trained_modules(optimizer_calls(tree)))
    for call in tree.calls_to(DDP, DATA_PARALLEL):
        target = bound_target(tree, call)
        if target:
            names.add(target)
    return names | propagate(tree, names)


def optimizer_names(tree: Tree) -> set[str]:
    names = {bound_target(tree, call) for call in optimizer_calls(tree)} - {None}
    return names | propagate(tree, names)  # type: ignore[operator]


def propagate(tree: Tree, names: set[str]) -> set[str]:
    """Parameters of the script's own functions that receive one of `names`."""
    found: set[str] = set()
    functions = tree.functions()
    for call in tree.find(cst.Call):
        callee = dotted(call.func)
        if callee is None:
            continue
        func = functions.get(callee.rsplit(".", 1)[-1])
        if func is None:
            continue
        params = [p.name.value for p in func.params.params]
        if params and params[0] in ("self", "cls") and "." in callee:
            params = params[1:]
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for index, arg in enumerate(positional):
            if dotted(arg.value) in names and index < len(params):
                found.add(params[index])
        for arg in call.args:
            if arg.keyword is not None and dotted(arg.value) in names:
                found.add(arg.keyword.value)
    return found


def backward_calls(tree: Tree) -> list[cst.Call]:
    return tree.find(cst.Call, lambda c: method_name(c) == "backward")


def training_loops(tree: Tree) -> list[cst.For]:
    """The `for` loops that run the backward pass, also through a step helper they call."""
    loops: list[cst.For] = []
    pending = [(call, 0) for call in backward_calls(tree)]
    while pending:
        node, depth = pending.pop(0)
        current = tree.parent.get(node)
        while current is not None and not isinstance(current, (cst.For, cst.FunctionDef)):
            current = tree.parent.get(current)
        if isinstance(current, cst.For):
            if current not in loops:
                loops.append(current)
        elif isinstance(current, cst.FunctionDef) and depth < 3:
            pending += [(call, depth + 1) for call in _calls_of(tree, current)]
    return loops


def _calls_of(tree: Tree, func: cst.FunctionDef) -> list[cst.Call]:
    def calls_func(call: cst.Call) -> bool:
        callee = dotted(call.func)
        return callee is not None and callee.rsplit(".", 1)[-1] == func.name.value

    return [call for call in tree.find(cst.Call, calls_func) if not tree.inside(call, func)]


def iterated_name(loop: cst.For, tree: Tree | None = None) -> str | None:
    """`loader` in `for x in tqdm(enumerate(loader), ...)`; with the tree, also through a
    progress bar kept in a variable (`pbar = tqdm(loader)`; `for x in pbar`)."""
    name = _unwrapped(loop.iter)
    bindings = _bindings(tree) if tree is not None else {}
    for _ in range(3):  # `bar = tqdm(enumerate(loader))`, at most a few hops
        values = bindings.get(name or "", [])
        if len(values) != 1 or not _is_iter_wrapper(values[0]):
            break
        name = _unwrapped(values[0])
    return name


def _is_iter_wrapper(expr: cst.BaseExpression) -> bool:
    callee = dotted(expr.func) if isinstance(expr, cst.Call) else None
    return callee is not None and callee.rsplit(".", 1)[-1] in ITER_WRAPPERS and bool(expr.args)


def _unwrapped(expr: cst.BaseExpression) -> str | None:
    while _is_iter_wrapper(expr):
        expr = expr.args[0].value  # type: ignore[attr-defined]
    return dotted(expr)


@dataclass
class Loader:
    call: cst.Call  # the DataLoader(...) call
    names: set[str]  # names it is bound to, at its call sites


def train_loaders(tree: Tree) -> tuple[list[Loader], list[cst.For]]:
    """The DataLoaders the training loops iterate, and the training loops that iterate
    something that is not a DataLoader of this script."""
    loops = training_loops(tree)
    loader_names: set[str] = set()
    unresolved = []
    for loop in loops:
        name = iterated_name(loop, tree)
        if name is None:
            unresolved.append(loop)
            continue
        loader_names |= {name} | _arguments_for(tree, loop, name)
    loaders = []
    for call in tree.calls_to(DATA_LOADER):
        names = _names_of_loader(tree, call)
        if names & loader_names:
            loaders.append(Loader(call, names))
    found = {n for loader in loaders for n in loader.names}
    for loop in loops:
        name = iterated_name(loop, tree)
        if name is not None and not ({name} | _arguments_for(tree, loop, name)) & found:
            unresolved.append(loop)
    # `for x, y in loader: for net, opt in zip(nets, opts): ...`: the batch comes from the
    # enclosing loop over the loader.
    every = [Loader(call, _names_of_loader(tree, call)) for call in tree.calls_to(DATA_LOADER)]
    still = []
    for loop in unresolved:
        outer = _enclosing_loader(tree, loop, every)
        if outer is None:
            still.append(loop)
        elif all(outer.call is not known.call for known in loaders):
            loaders.append(outer)
    return _loaders_fed_by_next(tree, loaders, still)


def _enclosing_loader(tree: Tree, loop: cst.For, every: list[Loader]) -> Loader | None:
    current = tree.parent.get(loop)
    while current is not None and not isinstance(current, cst.FunctionDef):
        if isinstance(current, cst.For):
            name = iterated_name(current, tree)
            for loader in every:
                if name in loader.names:
                    return loader
        current = tree.parent.get(current)
    return None


def _loaders_fed_by_next(
    tree: Tree, loaders: list[Loader], unresolved: list[cst.For]
) -> tuple[list[Loader], list[cst.For]]:
    """Step loops that pull their batch from a DataLoader (`x, y = next(batches)` with
    `batches = iter(loader)` or an infinite generator over it) train on that loader."""
    if not unresolved:
        return loaders, unresolved
    every = [Loader(call, _names_of_loader(tree, call)) for call in tree.calls_to(DATA_LOADER)]
    bindings = _bindings(tree)
    models = model_names(tree)
    still = []
    for loop in unresolved:
        feeding = set()
        for batch in batch_assignments(loop, models):
            read = names_read(batch.value)
            for name in list(read):
                for value in bindings.get(name, []):
                    read |= names_read(value)
            feeding |= {id(loader.call) for loader in every if loader.names & read}
        if not feeding:
            still.append(loop)
        for loader in every:
            if id(loader.call) in feeding and all(loader.call is not t.call for t in loaders):
                loaders.append(loader)
    return loaders, still


def hand_made_batches(tree: Tree) -> list[BatchAssignment]:
    """Where the batches of loops that use no DataLoader enter the step."""
    _, unresolved = train_loaders(tree)
    models = model_names(tree)
    return [batch for loop in unresolved for batch in batch_assignments(loop, models)]


def _arguments_for(tree: Tree, loop: cst.For, name: str) -> set[str]:
    """If `name` is a parameter of the loop's function, what the callers pass for it."""
    func = tree.function(loop)
    if func is None:
        return set()
    params = [p.name.value for p in func.params.params]
    if name not in params:
        return set()
    index = params.index(name)
    offset = 1 if params and params[0] in ("self", "cls") else 0
    found = set()
    for call in tree.find(cst.Call):
        callee = dotted(call.func)
        if callee is None or callee.rsplit(".", 1)[-1] != func.name.value:
            continue
        arg = find_arg(call, name, index - offset)
        if arg is not None and dotted(arg.value):
            found.add(dotted(arg.value))  # type: ignore[arg-type]
    return found


def _names_of_loader(tree: Tree, call: cst.Call) -> set[str]:
    """Where a DataLoader(...) ends up: `x = DataLoader(..)`, or returned by a helper whose
    result is bound (`train, val = make_loaders()`)."""
    target = bound_target(tree, call)
    if target is not None:
        names = {target}
        func = tree.function(call)
        returned = _returned_position(tree, func, target) if func else None
        if returned is not None:
            names |= _helper_results(tree, func, returned)  # type: ignore[arg-type]
        return names
    func = tree.function(call)
    statement = tree.statement(call)
    if func is None or not isinstance(statement, cst.SimpleStatementLine):
        return set()
    small = statement.body[0]
    if not isinstance(small, cst.Return) or small.value is None:
        return set()
    if small.value is call:
        return _helper_results(tree, func, None)
    if isinstance(small.value, cst.Tuple):
        for index, element in enumerate(small.value.elements):
            if element.value is call:
                return _helper_results(tree, func, index)
    return set()


def _returned_position(tree: Tree, func: cst.FunctionDef, name: str) -> int | None:
    for ret in tree.within(func, cst.Return):
        value = ret.value
        if value is not None and dotted(value) == name:
            return -1
        if isinstance(value, cst.Tuple):
            for index, element in enumerate(value.elements):
                if dotted(element.value) == name:
                    return index
    return None


def _helper_results(tree: Tree, func: cst.FunctionDef, index: int | None) -> set[str]:
    index = None if index == -1 else index
    found = set()
    for call in tree.find(cst.Call):
        callee = dotted(call.func)
        if callee is None or callee.rsplit(".", 1)[-1] != func.name.value:
            continue
        statement = tree.statement(call)
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        small = statement.body[0]
        if not isinstance(small, cst.Assign) or small.value is not call:
            continue
        target = small.targets[0].target
        if index is None and dotted(target):
            found.add(dotted(target))
        elif index is not None and isinstance(target, (cst.Tuple, cst.List)):
            if index < len(target.elements) and dotted(target.elements[index].value):
                found.add(dotted(target.elements[index].value))  # type: ignore[arg-type]
    return found


def iterable_dataset_classes(tree: Tree) -> set[str]:
    names = set()
    for cls in tree.find(cst.ClassDef):
        if any(tree.qualify(base.value) == ITERABLE_DATASET for base in cls.bases):
            names.add(cls.name.value)
    return names


def _bindings(tree: Tree) -> dict[str, list[cst.BaseExpression]]:
    found: dict[str, list[cst.BaseExpression]] = {}
    for assign in tree.find(cst.Assign):
        for target in assign.targets:
            name = dotted(target.target)
            if name:
                found.setdefault(name, []).append(assign.value)
    return found
