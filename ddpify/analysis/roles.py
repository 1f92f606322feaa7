"""Which objects play which role in training: the model, the optimizer, the loaders that
feed the step, the loops that run it; and where hand-made batches enter the step.

Both `ddpify migrate` (every pass) and the rules ask these questions here. Each function
takes the `Tree` of one module; when the module is part of a project (`tree.view` is a
`ProjectView`), the search runs over every module of the project (a loop in
`trainer.py` that iterates a loader built in `data.py`), and what is returned for
rewriting stays in the module asked about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.batch_streams import batch_stream_makers, item_names, maker_of, unwrap
from ddpify.analysis.batches import BatchAssignment, batch_assignments, body_nodes, names_read
from ddpify.analysis.evaluation import looks_like_eval
from ddpify.analysis.fetchers import fetched_loaders
from ddpify.analysis.loader_helpers import helper_results
from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.names import class_methods, dotted, find_arg, method_name, root_name
from ddpify.analysis.reachability import in_imported_main_block
from ddpify.analysis.trained import PARAMETER_METHODS, collection_owners, parameter_owners
from ddpify.analysis.tree import Tree
from ddpify.analysis.unsplittable import unsplittable_step
from ddpify.walk import children

DDP = "torch.nn.parallel.DistributedDataParallel"
DATA_PARALLEL = "torch.nn.parallel.DataParallel"
DATA_LOADER = "torch.utils.data.DataLoader"
DIST_SAMPLER = "torch.utils.data.DistributedSampler"
ITERABLE_DATASET = "torch.utils.data.IterableDataset"
# Wrappers around the loader in `for batch in tqdm(enumerate(loader))` (`track`: rich's).
ITER_WRAPPERS = {"enumerate", "tqdm", "iter", "zip", "progress_bar", "track"}
_SCHEDULER_OR_OPTIMIZER = re.compile(r"sched|optim", re.I)
# Training loops: `for` over batches or epochs, `while step < max_iters` step loops.
LOOPS = (cst.For, cst.While)


def view_cached(view, key, compute):
    """Facts about a whole view (one tree, or a project's modules) asked by every pass and
    for every module: computed once per view; trees are never edited in place, so a view
    is a snapshot."""
    cache = view.__dict__.setdefault("_roles_cache", {})
    if key not in cache:
        cache[key] = compute()
    return cache[key]


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
    """The optimizers constructed in this module."""
    return _optimizer_calls(tree)


def project_optimizer_calls(tree: Tree) -> list[cst.Call]:
    """The optimizers constructed in any module of the project."""
    return _optimizer_calls(tree.view)


# Public names under torch.optim that are no optimizer: the base class, schedulers, SWA.
_NOT_OPTIMIZERS = {"Optimizer"}
_NOT_OPTIMIZER_MODULES = {"lr_scheduler", "swa_utils"}


def is_optimizer(qualified: str | None) -> bool:
    """`torch.optim.SGD`, `torch.optim.adamw.AdamW`: a torch optimizer class; not an LR
    scheduler (`torch.optim.lr_scheduler.StepLR`), nor SWA's `AveragedModel` / `SWALR`,
    nor the `Optimizer` base class."""
    if qualified is None or not qualified.startswith("torch.optim."):
        return False
    parts = qualified.split(".")
    if len(parts) > 4 or set(parts) & _NOT_OPTIMIZER_MODULES:
        return False
    return parts[-1][:1].isupper() and parts[-1] not in _NOT_OPTIMIZERS


def _optimizer_calls(view) -> list[cst.Call]:
    # The view's calls qualified once (per tree), each qualified name judged once; the
    # calls that may choose their class by configuration found once per statement.
    judged: dict[str | None, bool] = {}
    may_choose = {id(call) for call in view.calls_where(_may_choose_optimizer)}
    found = []
    for call, name in view.qualified_calls():
        verdict = judged.get(name)
        if verdict is None:
            verdict = judged[name] = is_optimizer(name)
        if not verdict and id(call) in may_choose:
            verdict = _chosen_optimizer(view, call)
        if verdict and _project_code(view, call):
            found.append(call)
    return found


def _chosen_optimizer(view, call: cst.Call) -> bool:
    """`getattr(torch.optim, config["type"])(params, ...)`, or a project helper returning
    that form for the module it is passed (`get_instance(torch.optim, "optimizer", config,
    params)`): an optimizer whatever class the configuration names (torch.optim holds
    little else: its schedulers live in `torch.optim.lr_scheduler`)."""
    if not _may_choose_optimizer(call):
        return False
    # loader_classes reads this module's loaders: imported here, not at the top.
    from ddpify.analysis.loader_classes import module_chosen_from

    return module_chosen_from(view, call) == "torch.optim"


def _may_choose_optimizer(call: cst.Call) -> bool:
    """The syntax `_chosen_optimizer` needs: a call of a call, or a `...optim` argument."""
    return type(call.func) is cst.Call or any(_ends_with_optim(a.value) for a in call.args)


def _ends_with_optim(expr: cst.BaseExpression) -> bool:
    """`(dotted(expr) or "").endswith("optim")`, reading the last name first."""
    if type(expr) is cst.Attribute:
        last = expr.attr.value  # type: ignore[attr-defined]
    elif type(expr) is cst.Name:
        last = expr.value  # type: ignore[attr-defined]
    else:
        return False
    return last.endswith("optim") and dotted(expr) is not None


def _project_code(view, node: cst.CSTNode) -> bool:
    """Whether `node` runs in the project's run: not in the `__main__` demo of a module
    the entry imports (`view`: a module's Tree or the project's view)."""
    return not in_imported_main_block(view.view, node)


def ddp_wrapper_names(tree: Tree) -> set[str]:
    """The names the project's `DistributedDataParallel(...)` calls are bound to (once
    migrated, the names that hold a DDP wrapper)."""
    names = {bound_target(tree, call) for call in tree.view.calls_to(DDP)}
    return names - {None}  # type: ignore[return-value]


def bound_target(tree: Tree, call: cst.Call) -> str | None:
    """`x` in `x = call(...)` (also through `.to()` chains), else None."""
    statement = tree.view.statement(call)
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
    return set(view_cached(tree.view, "model_names", lambda: frozenset(_model_names(tree))))


def _model_names(tree: Tree) -> set[str]:
    """Names that hold the model: `X` in `optim.SGD(X.parameters())`, DDP/DP targets,
    and the parameters of the script's functions that receive one of them (in any module
    of the project)."""
    names: set[str] = set()
    names.update(_trained_modules(tree.view))
    for call in tree.view.calls_to(DDP, DATA_PARALLEL):
        target = bound_target(tree, call)
        if target and _project_code(tree.view, call):
            names.add(target)
    return names | propagate(tree, names)


def trained_model_names(tree: Tree) -> set[str]:
    """Names that hold a module an optimizer trains (in any module of the project), and
    the parameters that receive one: `model_names` without mere DataParallel/DDP targets."""
    trained = set(_trained_modules(tree.view))
    return trained | propagate(tree, trained)


def trained_owners(view, optimizer: cst.Call) -> list[str]:
    """The modules `optimizer` trains: the owners of the `.parameters()` calls in its
    arguments, or `model` in `AdamW(model.get_parameters())` when a class of the script
    (or project) defines `get_parameters` over its own parameters (`self.parameters()`,
    `self.backbone.parameters()`: parameter groups built by the model itself). A name
    given as the parameters is traced to what the function binds it to (`params =
    filter(lambda p: p.requires_grad, model.parameters())`, parameter groups on either
    branch of an if/else) or, for a parameter of a factory, to what its callers pass."""
    owners = parameter_owners(optimizer) + collection_owners(optimizer)
    if not owners and _builds_optimizer(view, optimizer):
        owners = keyed_collection_owners(view, optimizer)
    if owners:
        return owners
    for value in _parameters_given(view, optimizer):
        if isinstance(value, cst.Name):
            # Traced through its assignments for an optimizer only (`StepLR(optimizer)`
            # schedules an optimizer bound to `SGD(model.parameters())`: it trains nothing).
            owners = (
                _owners_of_binding(view, optimizer, value.value)
                if _builds_optimizer(view, optimizer)
                else None
            )
            if owners is None:  # bound nowhere in the function: one of its parameters
                owners = _owners_through_factory(view, optimizer, value.value)
        else:
            owners = _group_method_owners(view, value)
        if owners:
            return owners
    return []


def _builds_optimizer(view, call: cst.Call) -> bool:
    return is_optimizer(view.qualify(call.func)) or _chosen_optimizer(view, call)


def keyed_collection_owners(view, optimizer: cst.Call) -> list[str]:
    """The dicts (or lists) whose items `optimizer` trains by key: `nets` for
    `optims[k] = Adam(nets[k].parameters())` in `for k in nets:` (or `nets.keys()`,
    `range(len(nets))`), and in `{k: Adam(nets[k].parameters()) for k in nets}`. Every
    item the loop reaches is trained (the caller checks whether the loop skips some)."""
    owners: list[str] = []
    for call in view.within(optimizer, cst.Call):
        if method_name(call) not in PARAMETER_METHODS:
            continue
        item = call.func.value  # type: ignore[attr-defined]
        if not (isinstance(item, cst.Subscript) and len(item.slice) == 1):
            continue
        key = item.slice[0].slice
        collection = dotted(item.value)
        if not (isinstance(key, cst.Index) and isinstance(key.value, cst.Name)) or not collection:
            continue
        if keys_loop(view, optimizer, key.value.value, collection) and collection not in owners:
            owners.append(collection)
    return owners


def keys_loop(view, node: cst.CSTNode, key: str, collection: str) -> cst.CSTNode | None:
    """The loop (statement or comprehension clause) around `node` that binds `key` to the
    keys of `collection`: `for key in collection`, `collection.keys()`,
    `range(len(collection))`."""
    current = view.parent.get(node)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.ClassDef)):
        clause = current.for_in if isinstance(current, COMPREHENSIONS) else current
        if isinstance(clause, (cst.CompFor, cst.For)) and dotted(clause.target) == key:
            return clause if _keys_of(clause.iter) == collection else None
        current = view.parent.get(current)
    return None


def _keys_of(iterable: cst.BaseExpression) -> str | None:
    if not isinstance(iterable, cst.Call):
        return dotted(iterable)
    if isinstance(iterable.func, cst.Attribute) and iterable.func.attr.value == "keys":
        return dotted(iterable.func.value) if not iterable.args else None
    if dotted(iterable.func) == "range" and len(iterable.args) == 1:
        inner = iterable.args[0].value
        if isinstance(inner, cst.Call) and dotted(inner.func) == "len" and len(inner.args) == 1:
            return dotted(inner.args[0].value)
    return None


def _parameters_given(view, optimizer: cst.Call) -> list[cst.BaseExpression]:
    """What may hold the parameters of `optimizer`: its `params` argument; for a helper
    that makes a class chosen from torch.optim (`get_instance(torch.optim, "optimizer",
    config, params)`), each positional argument after the module (names, not strings)."""
    if isinstance(optimizer.func, cst.Call) or not _chosen_optimizer(view, optimizer):
        first = find_arg(optimizer, "params", 0)
        return [first.value] if first is not None else []
    positional = [a.value for a in optimizer.args if a.keyword is None and not a.star]
    after = next((i + 1 for i, v in enumerate(positional) if view.qualify(v) == "torch.optim"), 0)
    return [v for v in positional[after:] if not isinstance(v, cst.SimpleString)]


def _owners_of_binding(view, optimizer: cst.Call, name: str) -> list[str] | None:
    """The modules whose parameters every assignment of `name` in the optimizer's
    function (or module) holds, `.module` of a wrapper read as the model it wraps (both
    branches of `if differential_lr: params = [{"params": model.module.head()}, ...]
    else: params = model.parameters()` name `model`). [] when one assignment names no
    module (the optimizer may train what ddpify cannot see); None when none binds it."""
    scope = view.function(optimizer)
    assigns = [
        a
        for a in (view.within(scope, cst.Assign) if scope is not None else view.find(cst.Assign))
        if len(a.targets) == 1 and dotted(a.targets[0].target) == name
    ]
    if not assigns:
        return None
    owners: list[str] = []
    for assign in assigns:
        found = _group_method_owners(view, assign.value) + parameter_owners(
            cst.Call(func=cst.Name("params"), args=[cst.Arg(assign.value)])
        )
        if not found:
            return []
        for owner in found:
            owner = owner[: -len(".module")] if owner.endswith(".module") else owner
            if owner not in owners:
                owners.append(owner)
    return owners


def _group_method_owners(view, value: cst.BaseExpression) -> list[str]:
    """`model` for each `model.get_decoder_params()` in `value`, a method of a class of
    the project over its own parameters (`_parameter_group_methods`)."""
    methods = _parameter_group_methods(view)
    owners: list[str] = []
    calls = [value] if isinstance(value, cst.Call) else []
    for call in calls + list(view.within(value, cst.Call)):
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value in methods):
            continue
        owner = dotted(call.func.value)
        if owner is not None and owner not in owners:
            owners.append(owner)
    return owners


def _owners_through_factory(view, optimizer: cst.Call, param: str) -> list[str]:
    """`get_optimizer(config, model.parameters())` calling a factory that builds
    `optim.Adam(parameters, ...)`: the owners of what its callers pass as `parameters`."""
    func = view.function(optimizer)
    if func is None:
        return []
    params = [p.name.value for p in func.params.params]
    if param not in params:
        return []
    index = params.index(param)
    if params and params[0] in ("self", "cls"):
        index -= 1
    owners: list[str] = []
    name = func.name.value
    for call in view.find(cst.Call, lambda c: (dotted(c.func) or "").rsplit(".", 1)[-1] == name):
        arg = find_arg(call, param, index)
        if arg is None:
            continue
        fake = cst.Call(func=cst.Name("optimizer"), args=[arg.with_changes(keyword=None)])
        owners += [o for o in parameter_owners(fake) if o not in owners]
    return owners


def _parameter_group_methods(view) -> frozenset[str]:
    """Names of methods, defined in a class of the view, that read `self.parameters()`
    or `self.named_parameters()`."""

    def compute() -> frozenset[str]:
        found = set()
        for cls in view.find(cst.ClassDef):
            for statement in cls.body.body:
                if isinstance(statement, cst.FunctionDef) and any(
                    method_name(call) in PARAMETER_METHODS and _of_self(call.func.value)  # type: ignore[attr-defined]
                    for call in view.within(statement, cst.Call)
                ):
                    found.add(statement.name.value)
        return frozenset(found - set(PARAMETER_METHODS))

    return view_cached(view, "parameter_group_methods", compute)


def _of_self(receiver: cst.BaseExpression) -> bool:
    """`self` or one of its parts (`self.backbone`): the instance's own parameters."""
    name = dotted(receiver) or ""
    return name == "self" or name.startswith("self.")


def _trained_modules(view) -> list[str]:
    """Every module some optimizer of the view trains, in order of first appearance."""
    found: list[str] = []
    for call in _optimizer_calls(view):
        for name in trained_owners(view, call):
            if name not in found:
                found.append(name)
    return found


def ranged_collection(tree: Tree, node: cst.CSTNode, name: str) -> tuple[str, str] | None:
    """(`nets`, `net`) when `name`, read at `node`, is the variable of an enclosing loop
    over the collection `nets`: a comprehension `[Adam(net.parameters()) for net in nets]`
    or a statement `for net in nets: opts.append(Adam(net.parameters()))`; (`nets`,
    `key, net`) for `for key, net in nets.items()`. None when no enclosing loop binds
    `name`, or it ranges over something other than a named collection."""
    current = tree.parent.get(node)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.ClassDef)):
        clause = current.for_in if isinstance(current, COMPREHENSIONS) else current
        if isinstance(clause, (cst.CompFor, cst.For)):
            found = _ranged_by(clause.target, clause.iter, name)
            if found is not None:
                return found
        current = tree.parent.get(current)
    return None


COMPREHENSIONS = (cst.ListComp, cst.GeneratorExp, cst.DictComp, cst.SetComp)


def _ranged_by(
    target: cst.BaseExpression, iterable: cst.BaseExpression, name: str
) -> tuple[str, str] | None:
    source = dotted(iterable)
    if isinstance(target, cst.Name):
        return (source, name) if target.value == name and source is not None else None
    names = target.elements if isinstance(target, cst.Tuple) else []
    if len(names) != 2 or not all(isinstance(e.value, cst.Name) for e in names):
        return None
    key, value = (e.value.value for e in names)  # type: ignore[attr-defined]
    call = iterable
    if value != name or not (isinstance(call, cst.Call) and not call.args):
        return None
    if not isinstance(call.func, cst.Attribute) or call.func.attr.value != "items":
        return None
    source = dotted(call.func.value)
    return (source, f"{key}, {value}") if source is not None else None


def optimizer_names(tree: Tree) -> set[str]:
    names = {bound_target(tree, call) for call in _optimizer_calls(tree.view)} - {None}
    return names | propagate(tree, names)  # type: ignore[operator]


def propagate(tree: Tree, names: set[str]) -> set[str]:
    key = ("propagate", frozenset(names))
    return set(view_cached(tree.view, key, lambda: frozenset(_propagate(tree, names))))


def _propagate(tree: Tree, names: set[str]) -> set[str]:
    """Parameters of the script's own functions that receive one of `names`; for a
    class constructed with one (`Trainer(model, ...)`), its `__init__` parameters and
    the `self.` attributes they are stored in."""
    found: set[str] = set()
    view = tree.view
    functions = view.functions()
    constructors = _constructors(view)
    roots = {name.split(".")[0] for name in names}
    for call, callee, _ in view.call_names():
        # A call hands on one of `names` only with an argument that starts from one.
        if not any(root_name(arg.value) in roots for arg in call.args):
            continue
        called = _called_function(callee, functions, constructors)
        if called is None:
            continue
        func, params = called
        short = (callee or "").rsplit(".", 1)[-1]
        received = set()
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for index, arg in enumerate(positional):
            if dotted(arg.value) in names and index < len(params):
                received.add(params[index])
        for arg in call.args:
            if arg.keyword is not None and dotted(arg.value) in names:
                received.add(arg.keyword.value)
        found |= received
        if short in constructors and received:
            found |= _stored_as(view, func, received)
    return found


def wrapper_receivers(tree: Tree, wrappers: set[str]) -> dict[str, set[str]]:
    """Function name -> its parameters that a call hands one of `wrappers` (names that
    hold a DDP wrapper once migrated), as the wrapper: not a call made before the wrap in
    the same function (`self.model = convert_model(self.model)` ahead of `self.model =
    DataParallel(self.model)` converts the plain module). By function, unlike
    `propagate`: a parameter `module` of one helper says nothing of another helper's
    `module` (a forward hook's)."""
    return _handed_in(tree, wrappers)[0]


def mixed_receivers(tree: Tree, wrappers: set[str]) -> dict[str, set[str]]:
    """Of `wrapper_receivers`' parameters, those another call fills with something else
    (`save_weights(ema.model, path)` beside `save_weights(model, path)`): `.module` exists
    on some calls only, so the helper must reach the model as `getattr(p, "module", p)`."""
    wrapped, other = _handed_in(tree, wrappers)
    return {
        function: params & other[function]
        for function, params in wrapped.items()
        if params & other.get(function, set())
    }


def _handed_in(tree: Tree, wrappers: set[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Function name -> the parameters calls fill with a wrapper, and -> those calls fill
    with anything else."""
    view = tree.view
    functions = view.functions()
    constructors = _constructors(view)
    wraps = [
        (bound_target(tree, call), view.statement(call))
        for call in view.calls_to(DDP, DATA_PARALLEL)
    ]
    wrapped: dict[str, set[str]] = {}
    spellings: dict[str, set[str | None]] = {}  # how the calls handing a wrapper name it
    others = []
    for call, callee, _ in view.call_names():
        called = _called_function(callee, functions, constructors)
        if called is None:
            continue
        func, params = called
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for arg in call.args:
            if arg.keyword is not None:
                param = arg.keyword.value
            elif arg in positional and positional.index(arg) < len(params):
                param = params[positional.index(arg)]
            else:
                continue
            name = dotted(arg.value)
            if name in wrappers and not _before_its_wrap(view, call, name, wraps):
                wrapped.setdefault(func.name.value, set()).add(param)
                spellings.setdefault(func.name.value, set()).add(_callee_key(view, call))
            else:
                others.append((call, func.name.value, param))
    other: dict[str, set[str]] = {}
    for call, function, param in others:
        # Matched by last name: `torch.save(state, path)` is not the project's `save`.
        key = _callee_key(view, call)
        if view.qualify(call.func) is None or key in spellings.get(function, ()):
            other.setdefault(function, set()).add(param)
    return wrapped, other


def _callee_key(view, call: cst.Call) -> str | None:
    return view.qualify(call.func) or dotted(call.func)


def _called_function(callee: str | None, functions, constructors):
    """The project function (or class `__init__`) a call of `callee` (the dotted callee)
    runs, by its last name, and the parameters the call's arguments fill (`self` dropped
    for a method or a constructor)."""
    if callee is None:
        return None
    short = callee.rsplit(".", 1)[-1]
    func = functions.get(short) or constructors.get(short)
    if func is None:
        return None
    params = [p.name.value for p in func.params.params]
    if params and params[0] in ("self", "cls") and ("." in callee or short in constructors):
        params = params[1:]
    return func, params


def _before_its_wrap(view, call: cst.Call, name: str, wraps) -> bool:
    """Whether `call` comes before a statement of its own function that wraps `name`."""
    scope = view.scope(call)
    statement = view.statement(call)
    owner = view.owner(call)
    for target, wrap in wraps:
        if target != name or wrap is None or view.scope(wrap) is not scope:
            continue
        if owner is not None and owner.owns(wrap) and owner.after(wrap, statement):
            return True
    return False


def _constructors(view) -> dict[str, cst.FunctionDef]:
    """Class name -> its `__init__`, for the classes of the script (or project)."""
    found = {}
    for cls in view.find(cst.ClassDef):
        for statement in cls.body.body:
            if isinstance(statement, cst.FunctionDef) and statement.name.value == "__init__":
                found.setdefault(cls.name.value, statement)
    return found


def _stored_as(view, init: cst.FunctionDef, params: set[str]) -> set[str]:
    """`self.model` for `self.model = model` in `init`, with `model` one of `params`."""
    found = set()
    for assign in view.within(init, cst.Assign):
        if isinstance(assign.value, cst.Name) and assign.value.value in params:
            found |= {dotted(t.target) for t in assign.targets} - {None}
    return found  # type: ignore[return-value]


def backward_calls(tree: Tree) -> list[cst.Call]:
    """The backward calls of this module (`project_backward_calls` for all modules)."""
    return _backward_calls(tree)


def project_backward_calls(tree: Tree) -> list[cst.Call]:
    return _backward_calls(tree.view)


def _backward_calls(view) -> list[cst.Call]:
    return view.find(cst.Call, lambda c: method_name(c) == "backward" and _project_code(view, c))


def training_functions(tree: Tree) -> frozenset[str]:
    """Names of the project's functions and methods whose call may run a training step:
    those that call backward, and those that call one of them (`trainer.run_epoch(...)`
    in a `print`): such a call must run on every rank."""
    view = tree.view
    return view_cached(view, "training_functions", lambda: _reaching(view, _backward_calls(view)))


def forward_functions(tree: Tree) -> frozenset[str]:
    """Names of the project's functions and methods whose call may run a model's forward
    (`self.evaluate()` over `self.model(x)`), directly or through another one."""

    def compute() -> frozenset[str]:
        models = model_names(tree)
        return _reaching(tree.view, tree.view.find(cst.Call, lambda c: dotted(c.func) in models))

    return view_cached(tree.view, "forward_functions", compute)


def _reaching(view, calls: list[cst.Call]) -> frozenset[str]:
    """The functions that hold one of `calls`, and those that call one of them, by name."""
    found = {func.name.value for func in map(view.function, calls) if func is not None}
    callers = _callers_by_name(view)
    todo = list(found)
    while todo:  # up the call graph: each name once, not every function per round
        for caller in callers.get(todo.pop(), ()):
            if caller not in found:
                found.add(caller)
                todo.append(caller)
    return frozenset(found)


def _callers_by_name(view) -> dict[str, set[str]]:
    """Callee name (`_callee`) -> the names of the functions whose code holds a call to
    it, nested functions' calls included (as `view.within(func, cst.Call)` finds them)."""

    def compute() -> dict[str, set[str]]:
        callers: dict[str, set[str]] = {}
        for func in view.find(cst.FunctionDef):
            name = func.name.value
            for call in view.within(func, cst.Call):
                callee = _callee(call)
                if callee is not None:
                    callers.setdefault(callee, set()).add(name)
        return callers

    return view_cached(view, "callers_by_name", compute)


def _callee(call: cst.Call) -> str | None:
    name = dotted(call.func)
    return name.rsplit(".", 1)[-1] if name else None


def calls_training(tree: Tree, node: cst.CSTNode) -> cst.Call | None:
    """The first call in `node` of a function that may run a training step, if any."""
    return _first_call_into(tree, node, training_functions(tree))


def calls_forward(tree: Tree, node: cst.CSTNode) -> cst.Call | None:
    """The first call in `node` of a function that may run a model's forward, if any."""
    return _first_call_into(tree, node, forward_functions(tree))


def runs_model(tree: Tree, node: cst.CSTNode) -> cst.Call | None:
    """The first call in `node` that runs a model's forward: the model called (`net(x)`),
    or a function that may call it. Under DDP that forward is a collective (the buffers
    are broadcast), so every rank must run it."""
    models = model_names(tree)
    direct = (c for c in tree.within(node, cst.Call) if dotted(c.func) in models)
    return next(direct, None) or calls_forward(tree, node)


def _first_call_into(tree: Tree, node: cst.CSTNode, names: frozenset[str]) -> cst.Call | None:
    return next((c for c in tree.within(node, cst.Call) if _callee(c) in names), None)


def training_loops(tree: Tree) -> list[cst.For | cst.While]:
    """The loops of this module that run the backward pass (`for`, or a `while` step loop
    not inside a `for` over the data), also through a step helper they call (defined in
    any module of the project)."""
    return [loop for loop in _training_loops(tree.view) if tree.owns(loop)]


def _training_loops(view) -> list[cst.For | cst.While]:
    return view_cached(view, "training_loops", lambda: _find_training_loops(view))


def backward_units(
    tree: Tree, backwards: list[cst.Call] | None = None
) -> list[cst.For | cst.While | cst.FunctionDef]:
    """The innermost loop or function around each backward call of this module, once
    each, in the order of the calls: the body that runs one training step (a loop body,
    or a `train_step` function called once per micro-step). `backwards`: the module's
    `.backward()` calls when the caller has them already (the lint engine indexes them)."""
    view = tree.view
    if backwards is not None and view is tree:
        return _find_backward_units(view, backwards)
    units = view_cached(
        view, "backward_units", lambda: _find_backward_units(view, _backward_calls(view))
    )
    if view is tree:  # one module: all its own (no `order` map built to say so)
        return list(units)
    return [unit for unit in units if tree.owns(unit)]


def _find_backward_units(view, backwards) -> list[cst.For | cst.While | cst.FunctionDef]:
    found: list[cst.For | cst.While | cst.FunctionDef] = []
    for call in backwards:
        unit = _innermost_unit(view, call)
        if unit is not None and all(unit is not known for known in found):
            found.append(unit)
    return found


def _innermost_unit(view, node: cst.CSTNode) -> cst.For | cst.While | cst.FunctionDef | None:
    current = view.parent.get(node)
    while current is not None and not isinstance(current, (*LOOPS, cst.FunctionDef)):
        current = view.parent.get(current)
    return current


def _find_training_loops(view) -> list[cst.For | cst.While]:
    loops: list[cst.For | cst.While] = []
    pending = [(call, 0) for call in _backward_calls(view)]
    while pending:
        node, depth = pending.pop(0)
        current = _innermost_unit(view, node)
        if isinstance(current, cst.While):
            current = _loop_over_data(view, current)
        if isinstance(current, LOOPS):
            if current not in loops:
                loops.append(current)
        elif isinstance(current, cst.FunctionDef) and depth < 3:
            pending += [(call, depth + 1) for call in _calls_of(view, current)]
    return loops


def _loop_over_data(view, loop: cst.While) -> cst.For | cst.While:
    """The loop that feeds the step around a `while` loop: a `for` over the data that
    encloses it (`for x, y in loader: while not done: ...`), else the `while` itself
    (`while step < max_iters: x, y = next(batches)`, `while (b := next(it, None)) ...`)."""
    current = view.parent.get(loop)
    while current is not None and not isinstance(current, cst.FunctionDef):
        if isinstance(current, cst.For) and iterated_name(current, view) is not None:
            return current
        current = view.parent.get(current)
    return loop


def _calls_of(view, func: cst.FunctionDef) -> list[cst.Call]:
    def calls_func(call: cst.Call) -> bool:
        callee = dotted(call.func)
        if callee is None or callee.rsplit(".", 1)[-1] != func.name.value:
            return False
        # `scheduler.step()`, `self.optimizer.step()`: an LR scheduler's or optimizer's own
        # `step`, never a training-step helper that happens to share the name.
        owner = callee.rsplit(".", 1)[0].rsplit(".", 1)[-1] if "." in callee else ""
        return not _SCHEDULER_OR_OPTIMIZER.search(owner)

    return [call for call in view.find(cst.Call, calls_func) if not view.inside(call, func)]


def iterated_name(loop: cst.For | cst.While, tree: Tree | None = None) -> str | None:
    """`loader` in `for x in tqdm(enumerate(loader), ...)`; with the tree, also through a
    progress bar kept in a variable (`pbar = tqdm(loader)`; `for x in pbar`). None for a
    `while` loop, which iterates nothing (its batches come from `next()`)."""
    if not isinstance(loop, cst.For):
        return None
    name = _unwrapped(loop.iter)
    bindings = _bindings(tree) if tree is not None else {}
    for _ in range(3):  # `bar = tqdm(enumerate(loader))`, at most a few hops
        values = bindings.get(name or "", [])
        if len(values) != 1 or not _is_iter_wrapper(values[0]):
            break
        name = _unwrapped(values[0])
    return name


def zipped_names(loop: cst.For | cst.While) -> list[str]:
    """The iterables a loop draws from together with the one `iterated_name` gives:
    `source` and `target` in `for (a, _), (b, _) in enumerate(zip(source, target))`
    (each through its own enumerate() or tqdm()); [] when the loop zips nothing."""
    expr = loop.iter if isinstance(loop, cst.For) else None
    while expr is not None and _is_iter_wrapper(expr):
        callee = dotted(expr.func)  # type: ignore[attr-defined]
        if callee is not None and callee.rsplit(".", 1)[-1] == "zip":
            names = [_unwrapped(arg.value) for arg in expr.args if not arg.star]  # type: ignore[attr-defined]
            return [name for name in names if name is not None]
        expr = expr.args[0].value  # type: ignore[attr-defined]
    return []


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
    """The DataLoaders the training loops iterate (built in any module of the project:
    `Loader.call` may lie in another module than `tree`'s), and the training loops of this
    module that iterate something that is not a DataLoader."""
    view = tree.view
    loaders, unresolved = view_cached(view, "train_loaders", lambda: _train_loaders(view))
    return list(loaders), [loop for loop in unresolved if tree.owns(loop)]


def _train_loaders(tree) -> tuple[list[Loader], list[cst.For]]:
    loops = _training_loops(tree)
    loader_names: set[str] = set()
    unresolved = []
    for loop in loops:
        name = iterated_name(loop, tree)
        if name is None:
            unresolved.append(loop)
            continue
        loader_names |= {name} | _arguments_for(tree, loop, name)
        for other in zipped_names(loop):  # drawn together: each is a training loader
            loader_names |= {other} | _arguments_for(tree, loop, other)
    loaders = []
    for call in tree.calls_to(DATA_LOADER):
        names = _names_of_loader(tree, call)
        matched = _names_outside_helper(tree, call, loops, names)
        if matched & loader_names and not _local_loader_unused_by(tree, call, loops):
            names -= _evaluation_results(tree, call, loader_names)
            loaders.append(Loader(call, names | _aliases_in_loops(tree, loops, names)))
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
    still = _held_by_holders(tree, loaders, still)
    return _loaders_fed_by_next(tree, loaders, still)


def _local_loader_unused_by(tree, call: cst.Call, loops: list) -> bool:
    """A loader bound to a plain local name of a function that neither returns it nor
    hands it to any call, and that no training loop of that function iterates: the name
    only coincides with the training loop's (`loader` in an `evaluate(model, data)` helper
    beside `for x, y in loader:` in the script), so it is not the training loader."""
    func = tree.function(call)
    target = bound_target(tree, call)
    if func is None or target is None or "." in target:
        return False
    if _returned_position(tree, func, target) is not None or _declared_outer(tree, func, target):
        return False
    if any(tree.inside(loop, func) and iterated_name(loop, tree) == target for loop in loops):
        return False
    for other in tree.within(func, cst.Call):
        if other is not call and any(dotted(arg.value) == target for arg in other.args):
            return False  # handed on: the callee's loop may train on it
    return True


def _names_outside_helper(tree, call: cst.Call, loops: list, names: set[str]) -> set[str]:
    """`names` (where the loader lands), less the helper's own local when the loader is
    `dataloader = DataLoader(...); return dataloader` in a helper every call of which keeps
    its result (`validation_dataloader = create_validation_loader(...)`): that local is the
    helper's, and a training loop elsewhere iterating a `dataloader` of its own never reads
    it, so only the names the callers keep it under tell whether it trains. Unchanged where
    a training loop inside the helper iterates the local."""
    func = tree.function(call)
    target = bound_target(tree, call)
    if func is None or target is None or "." in target or _declared_outer(tree, func, target):
        return names
    position = _returned_position(tree, func, target)
    if position is None or not _every_call_kept(tree, func):
        return names
    if any(tree.inside(loop, func) and iterated_name(loop, tree) == target for loop in loops):
        return names
    kept = {
        name
        for site, name in helper_results(tree, call)
        if _kept_may_train(tree, site, name, loops)
    }
    return (names - {target}) | kept


def _kept_may_train(tree, site: cst.Call, name: str, loops: list) -> bool:
    """Whether the loader a helper returns, kept as `name = helper(...)` at `site`, may
    reach a training loop: where `name` is a plain local of a function, only when a
    training loop there iterates it, or the function returns it, or hands it to a call that
    is not one of the project's functions without a training loop (test.py's `dataloader
    = _create_validation_data_loader(...)` handed to `_evaluate(model, dataloader)`)."""
    func = tree.function(site)
    if func is None or "." in name or _declared_outer(tree, func, name):
        return True  # a module-level name or an attribute: read anywhere
    if any(tree.inside(loop, func) and iterated_name(loop, tree) == name for loop in loops):
        return True
    if _returned_position(tree, func, name) is not None:
        return True
    training = {tree.function(loop).name.value for loop in loops if tree.function(loop)}
    functions = {f.name.value for f in tree.find(cst.FunctionDef)}
    for other in tree.within(func, cst.Call):
        if other is site or not any(dotted(arg.value) == name for arg in other.args):
            continue
        callee = (dotted(other.func) or "").rsplit(".", 1)[-1]
        if callee not in functions or callee in training:
            return True  # handed to code whose loops are not known, or that trains
    return False


def _every_call_kept(tree, func: cst.FunctionDef) -> bool:
    """Whether `func` is called somewhere, by name, and each call is the whole value of an
    assignment (`x = func(...)`, `a, x = func(...)`): where its result goes is known."""
    calls = [
        call
        for call in tree.find(cst.Call)
        if (dotted(call.func) or "").rsplit(".", 1)[-1] == func.name.value
    ]
    for call in calls:
        statement = tree.statement(call)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not isinstance(small, cst.Assign) or small.value is not call:
            return False
    return bool(calls)


def _declared_outer(tree, func: cst.FunctionDef, name: str) -> bool:
    """`global name` / `nonlocal name` in `func`: the binding is not local."""
    return any(
        name in {n.name.value for n in decl.names}
        for decl in tree.within(func, (cst.Global, cst.Nonlocal))
    )


def _held_by_holders(tree, loaders: list[Loader], loops: list) -> list:
    """`for data in dataset` over an instance of a class that holds a DataLoader and hands
    out its batches (analysis/loader_holders.py): the held loader trains, under the name
    its class keeps it by (`self.dataloader`). The loops still unresolved."""
    from ddpify.analysis.loader_holders import held_loader_of

    still = []
    for loop in loops:
        held = held_loader_of(tree, loop)
        if held is None:
            still.append(loop)
        elif all(held[1].call is not known.call for known in loaders):
            loaders.append(Loader(held[1].call, {held[1].attribute}))
    return still


def _evaluation_results(tree, call: cst.Call, trained: set[str]) -> set[str]:
    """The names a loader helper's other results land in, when one of them feeds a
    training loop (`self.train_loader = build_loader(...)`) and these feed none
    (`self.dev_loader = build_loader(...)`, iterated under `no_grad` to evaluate): one
    DataLoader call builds both, but only the first trains, so only it is the training
    loader's name (its set_epoch, its dataset's name). Only a name shown to evaluate
    counts: one a loop that does not train iterates, or one that reads as evaluation
    data (`val_loader`); another may still reach the step under a name not followed."""
    results = {name for _, name in helper_results(tree, call)}
    if not results & trained:
        return set()  # no call site keeps the training loader: nothing to tell apart
    evaluated = _evaluation_loop_sources(tree)
    return {name for name in results - trained if name in evaluated or looks_like_eval(name)}


def _evaluation_loop_sources(tree) -> set[str]:
    """The names the loops that do not train iterate, and what their callers pass for
    them (`vali(vali_data, test_loader, criterion)` looping over `vali_loader`)."""

    def compute() -> frozenset[str]:
        training = {id(loop) for loop in _training_loops(tree.view)}
        found: set[str] = set()
        for loop in tree.view.find(cst.For, lambda node: id(node) not in training):
            name = iterated_name(loop, tree.view)
            if name is not None:
                found |= {name} | _arguments_for(tree.view, loop, name)
        return frozenset(found)

    return set(view_cached(tree.view, "evaluation_loop_sources", compute))


def _aliases_in_loops(tree, loops: list[cst.For], names: set[str]) -> set[str]:
    """The names training loops iterate the loader under (`self.loader` in a Trainer that
    was handed `loader`)."""
    found = set()
    for loop in loops:
        name = iterated_name(loop, tree)
        if name is not None and name not in names and _arguments_for(tree, loop, name) & names:
            found.add(name)
    return found


def stored_models(tree: Tree) -> list[tuple[str, cst.BaseStatement]]:
    """Attributes of this module's classes that hold a model handed to the constructor
    (`self.model = model` in `Trainer.__init__`, built with `Trainer(model, ...)` in any
    module): (`self.model`, the assignment statement)."""
    models = model_names(tree)
    found = []
    constructors = _constructors(tree)
    for call in tree.view.find(cst.Call):
        callee = dotted(call.func)
        init = constructors.get(callee.rsplit(".", 1)[-1]) if callee else None
        if init is None:
            continue
        params = [p.name.value for p in init.params.params][1:]
        positional = [a for a in call.args if a.keyword is None and not a.star]
        received = {
            params[i]
            for i, a in enumerate(positional)
            if i < len(params) and dotted(a.value) in models
        }
        received |= {
            a.keyword.value
            for a in call.args
            if a.keyword is not None and dotted(a.value) in models
        }
        for assign in tree.within(init, cst.Assign):
            if isinstance(assign.value, cst.Name) and assign.value.value in received:
                for target in assign.targets:
                    name = dotted(target.target)
                    if name and name.startswith("self.") and all(name != f for f, _ in found):
                        found.append((name, tree.statement(assign)))
    return found


def returned_into_trained(tree: Tree, statement: cst.BaseStatement, names: set) -> set[str]:
    """`model = DataParallel(model)` in a builder that returns `model` (or `return
    DataParallel(...)` itself), where a caller keeps the result as the trained model
    (`self.model = self._build_model().to(dev)`): the names the callers keep it in."""
    func = tree.function(statement)
    if func is None:
        return set()
    named = names - {None}
    returns = [r for r in tree.within(func, cst.Return) if r.value is not None]
    if not any(r is _small(statement) or dotted(r.value) in named for r in returns):
        return set()
    trained = trained_model_names(tree)
    names = returning_builders(tree.view, func.name.value)
    kept = set()
    for call in tree.view.find(cst.Call):
        if (dotted(call.func) or "").rsplit(".", 1)[-1] in names:
            target = bound_target(tree, call)
            if target in trained and _holds_trained(tree, call, target):
                kept.add(target)
    return kept


# How many builders a net passes through on its way out (`define_G` returns
# `init_net(net, ...)`, which returns the net it wrapped).
MAX_BUILDER_HOPS = 3


def returning_builders(view, name: str) -> set[str]:
    """`name` and the project's functions that return what a call of it returns
    (`def define_G(...): ... return init_net(net, gpu_ids)`), up to MAX_BUILDER_HOPS
    deep: a caller of any of them keeps what `name` built."""
    found = {name}
    for _ in range(MAX_BUILDER_HOPS):
        more = {
            function.name.value
            for function in view.find(cst.FunctionDef)
            for returned in view.within(function, cst.Return)
            if isinstance(returned.value, cst.Call)
            and (dotted(returned.value.func) or "").rsplit(".", 1)[-1] in found
        } - found
        if not more:
            break
        found |= more
    return found


def _small(statement: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        return statement.body[0]
    return None


def _holds_trained(tree: Tree, call: cst.Call, target: str) -> bool:
    """`self.model = self.load_model()` holds the trained model only in a class that trains
    it or is handed it (`Trainer(model)`), not in an evaluator whose own `self.model` is a
    frozen feature extractor that happens to share the name."""
    view = tree.view
    cls = class_of(view, call) if target.startswith("self.") else None
    if cls is None:
        return True
    family = _class_family(view, cls)
    for optimizer in _optimizer_calls(view):
        around = class_of(view, optimizer)
        if around in family and target in trained_owners(view, optimizer):
            return True
    return any(
        name == target and view.inside(statement, cls)
        for name, statement in stored_models(view.owner(call) or tree)
    )


def _class_family(view, cls: cst.ClassDef) -> list[cst.ClassDef]:
    """`cls`, the project's classes it derives from, and those that derive from it (by
    name: `class Exp_Forecast(Exp_Basic)`), where `self.` means the same object."""
    classes = view.find(cst.ClassDef)

    def bases(c: cst.ClassDef) -> set[str]:
        return {(dotted(b.value) or "").rsplit(".", 1)[-1] for b in c.bases}

    family = [cls]
    grew = True
    while grew:
        grew = False
        names = {c.name.value for c in family}
        ancestors = set().union(*(bases(c) for c in family))
        for c in classes:
            if c not in family and (bases(c) & names or c.name.value in ancestors):
                family.append(c)
                grew = True
    return family


def data_parallel_of_trained(tree: Tree, call: cst.Call, entry: bool) -> bool:
    """Whether `DataParallel(...)` wraps a model that trains: in the entry script always;
    in an imported module when it wraps a trained name or a builder returns it into one
    (a frozen feature extractor under DataParallel in a metrics module does not)."""
    if entry or not call.args:
        return True
    inner = tree.view.code(call.args[0].value)
    target = bound_target(tree, call)
    if {inner, target} & trained_model_names(tree):
        return True
    statement = tree.view.statement(call)
    return statement is not None and bool(returned_into_trained(tree, statement, {inner, target}))


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
    sources = {"next", "iter", "__next__", "__iter__"} | set(tree.view.functions())
    sources |= {cls.name.value for cls in tree.view.find(cst.ClassDef)}
    still = []
    for loop in unresolved:
        feeding = set()
        values = [batch.value for batch in batch_assignments(loop, models)]
        values += [walrus.value for walrus in _walrus_batches(loop)]
        for value in values:
            read = _read_through(names_read(value), bindings, sources)
            feeding |= {id(loader.call) for loader in every if loader.names & read}
        if not feeding:
            fetched = _fetched_by_step(tree, loop, bindings)
            feeding |= {id(loader.call) for loader in every if loader.names & fetched}
        if not feeding:
            still.append(loop)
        for loader in every:
            if id(loader.call) in feeding and all(loader.call is not t.call for t in loaders):
                loaders.append(_without_bundled_evaluation(tree, loader))
    return loaders, still


def _without_bundled_evaluation(tree, loader: Loader) -> Loader:
    """`loader` without the bundle names that read as evaluation data (`loaders.val`, from
    the helper that also builds `loaders.train`): one DataLoader call, two loaders."""
    evaluation = {name for _, name in bundled_results(tree, loader.call) if looks_like_eval(name)}
    kept = loader.names - evaluation
    return Loader(loader.call, kept) if kept else loader


def _fetched_by_step(tree, loop: cst.For | cst.While, bindings) -> set[str]:
    """The loaders a fetcher object pulled from in the step hands out (`inputs =
    next(fetcher)`, `fetcher = InputFetcher(loaders.src, loaders.ref)`): analysis/fetchers.py."""
    found: set[str] = set()
    for node in body_nodes(loop):
        if isinstance(node, cst.Call):
            found |= fetched_loaders(tree.view, node, bindings)
    return found


def _read_through(read: set[str], bindings, sources: set[str]) -> set[str]:
    """`read` and what its names were bound from: one assignment back for any name (as
    `x, y = data_gen.__next__()` reads `data_gen = inf_generator(loader)`), then further back
    only through assignments that pull from a source (`sources`: `next`, `iter`, the
    project's own generators and fetcher classes): `x = batch["x"]` <- `batch = next(fetcher)`
    <- `fetcher = Fetcher(loader)`, never through `n = len(loader)`."""
    found = set(read)
    for name in read:
        for value in bindings.get(name, []):
            found |= names_read(value)
    for _ in range(3):
        values = [v for known in found for v in bindings.get(known, []) if _pulls(v, sources)]
        more = {name for value in values for name in names_read(value)}
        if more <= found:
            break
        found |= more
    return found


def _pulls(value: cst.BaseExpression, sources: set[str]) -> bool:
    """`next(it)`, `iter(loader)`, `it.__next__()`, `Fetcher(loader)`, `gen(loader)`, or a
    part of what one of those gave (`batch["x"]`, `batch.x`)."""
    while isinstance(value, (cst.Subscript, cst.Attribute)):
        value = value.value
    if not isinstance(value, cst.Call):
        return isinstance(value, cst.Name)
    callee = dotted(value.func)
    return callee is not None and callee.rsplit(".", 1)[-1] in sources


def _walrus_batches(loop: cst.For | cst.While) -> list[cst.NamedExpr]:
    """`(batch := next(it, None))` in a `while` loop's test: the batch enters the step there."""
    if not isinstance(loop, cst.While):
        return []
    found = []
    stack = [loop.test]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.NamedExpr):
            found.append(node)
        stack.extend(children(node))
    return found


def hand_made_batches(tree: Tree) -> list[BatchAssignment]:
    """Where the batches of this module's loops that use no DataLoader enter the step."""
    _, unresolved = train_loaders(tree)
    models = model_names(tree)
    # A step that keeps its batch whole (one example, carried state) is not split: it runs
    # whole on every rank (analysis/unsplittable.py, migrate/replicate.py).
    return [
        batch
        for loop in unresolved
        if unsplittable_step(tree, loop, models) is None
        for batch in batch_assignments(loop, models)
    ]


def project_has_hand_made_batches(tree: Tree) -> bool:
    """Whether any module of the project shards hand-made batches or the batches of a
    batch stream (the global batch then stays the original's, and so does the learning
    rate, in every module)."""
    trees = tree.trees
    return any(hand_made_batches(t) or stream_batches(t) for t in trees)


# -- batch streams: loops over an iterable of the project that yields whole batches --------


@dataclass
class StreamBatch:
    """`for i, x in enumerate(tqdm(stream))` over a batch stream: the batch enters the step
    at the loop target (`x`), where a migration splits it by rank."""

    loop: cst.For
    names: list[str]  # the names the loop target binds to one batch (`x`; `x, y`)
    maker: str  # the class or generator function of the project that makes the stream


def stream_batches(tree: Tree) -> list[StreamBatch]:
    """The loops of this module, fed by no DataLoader, that iterate a batch stream."""
    _, unresolved = train_loaders(tree)
    found = [stream_batch(tree, loop) for loop in unresolved]
    return [batch for batch in found if batch is not None]


def stream_batch(tree: Tree, loop: cst.For | cst.While) -> StreamBatch | None:
    """The batch stream `loop` iterates, directly (`for x in batches(data, bs)`) or through
    the name it iterates (`self.trainloader`, handed to the class as `trainloader =
    DataStreamer(...)` in another module); None when it is not one, or is ambiguous."""
    if not isinstance(loop, cst.For) or already_distributed(tree, loop):
        return None
    view = tree.view
    bindings = _bindings(tree)
    stream = unwrap(loop.iter, _loop_bindings(view, loop, bindings))
    names = item_names(loop.target, stream.enumerates) if stream is not None else None
    if stream is None or not names or _split_at_target(loop, names):
        return None
    makers = view_cached(view, "stream_makers", lambda: frozenset(_stream_makers(view)))
    maker = maker_of(stream.source, makers)
    if maker is None:
        name = dotted(stream.source)
        if name is None:
            return None
        sources = {name} | _arguments_for(view, loop, name)
        values = [value for source in sources for value in bindings.get(source, [])]
        func = view.function(loop)
        if func is not None:  # `trainer.fit(chunks(x, 8))`: the stream made at the call
            values += _parameter_arguments(view, func, name)
        if any(view.qualify(v.func) == DATA_LOADER for v in values if isinstance(v, cst.Call)):
            return None
        found = {maker_of(value, makers) for value in values} - {None}
        if len(found) != 1:
            return None
        maker = found.pop()  # type: ignore[assignment]
    return StreamBatch(loop, names, maker)  # type: ignore[arg-type]


def _loop_bindings(view, loop: cst.For, bindings) -> dict[str, list[cst.BaseExpression]]:
    """`bindings`, with a plain name bound in the loop's own function only by the values
    bound there (`t` in `with tqdm(self.loader) as t`, which other methods bind too)."""
    func = view.function(loop)
    if func is None:
        return bindings
    local: dict[str, list[cst.BaseExpression]] = {}
    for node in view.within(func, (cst.Assign, cst.WithItem)):
        if isinstance(node, cst.Assign):
            pairs = [(dotted(t.target), node.value) for t in node.targets]
        else:
            asname = node.asname.name if node.asname is not None else None
            pairs = [(dotted(asname) if asname is not None else None, node.item)]
        for name, value in pairs:
            if name and "." not in name:
                local.setdefault(name, []).append(value)
    return {**bindings, **local}


def _stream_makers(view) -> set[str]:
    return batch_stream_makers(view.find(cst.ClassDef), view.find(cst.FunctionDef))


def _split_at_target(loop: cst.For, names: list[str]) -> bool:
    """The loop already splits its batch by the world size (`x = x[... WORLD_SIZE ...]`)."""
    for statement in loop.body.body:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if (
                    isinstance(small, cst.Assign)
                    and any(dotted(t.target) in names for t in small.targets)
                    and "WORLD_SIZE" in names_read(small.value)
                ):
                    return True
    return False


def distributed_sampler_value(
    tree: Tree, expr: cst.BaseExpression | None, depth: int = 0
) -> cst.BaseExpression | None:
    """What makes the DistributedSampler a loader's `sampler=` value holds: the call
    (`DistributedSampler(ds)`), or a conditional with it on a branch
    (`DistributedSampler(ds) if distributed else None`: the sampler may be None), written
    there or bound to the name passed (`sampler=train_sampler`), a few names deep. None
    when no DistributedSampler is behind it."""
    if expr is None or depth > 3:
        return None
    if isinstance(expr, cst.IfExp):
        branches = (expr.body, expr.orelse)
        found = any(distributed_sampler_value(tree, b, depth) is not None for b in branches)
        return expr if found else None
    call = unwrap_call_chain(expr)  # `DistributedSampler(...)` of `...(...).method()`
    if call is not None:
        return call if tree.view.qualify(call.func) == DIST_SAMPLER else None
    name = dotted(expr)
    for value in _bindings(tree).get(name or "", []):
        if value is not expr and dotted(value) != name:
            found = distributed_sampler_value(tree, value, depth + 1)
            if found is not None:
                return found
    return None


def already_distributed(tree: Tree, loop: cst.For | cst.While) -> bool:
    """The function that runs the loop deals with a DistributedSampler itself
    (`if isinstance(self.sampler, DistributedSampler): self.sampler.set_epoch(e)`): its
    data are sharded by whoever built its loader, and the loop is left as it is."""
    view = tree.view
    owner = view.function(loop) or loop
    for node in view.within(owner, cst.Name):
        if view.qualify(node) == DIST_SAMPLER:
            return True
    return False


def _arguments_for(tree: Tree, loop: cst.For, name: str) -> set[str]:
    """What the callers pass for `name` when it is a parameter of the loop's function,
    or (`self.loader`) an attribute the class stores a constructor parameter in."""
    func = tree.function(loop)
    if func is None:
        return set()
    if name.startswith("self."):
        return _attribute_sources(tree, func, name)
    return _parameter_sources(tree, func, name, _training_flags(tree, func, loop))


def _parameter_sources(
    tree, func: cst.FunctionDef, name: str, flags: dict[str, bool] | None = None
) -> set[str]:
    found = {dotted(value) for value in _parameter_arguments(tree, func, name, flags)}
    return found - {None}  # type: ignore[return-value]


def _parameter_arguments(
    tree, func: cst.FunctionDef, name: str, flags: dict[str, bool] | None = None
) -> list[cst.BaseExpression]:
    """What the callers of `func` pass for its parameter `name`, as written; with `flags`
    (`_training_flags`), only the calls that train: `run_epoch(dev_loader,
    train_mode=False)` passes an evaluation loader."""
    params = [p.name.value for p in func.params.params]
    if name not in params:
        return []
    index = params.index(name)
    offset = 1 if params and params[0] in ("self", "cls") else 0
    called = func.name.value
    if called == "__init__":
        cls = class_of(tree, func)
        called = cls.name.value if cls is not None else called
    found = []
    for call in tree.find(cst.Call):
        callee = dotted(call.func)
        if callee is None or callee.rsplit(".", 1)[-1] != called:
            continue
        if flags and not _call_trains(func, call, flags, offset):
            continue
        arg = find_arg(call, name, index - offset)
        if arg is not None:
            found.append(arg.value)
    return found


def _training_flags(tree, func: cst.FunctionDef, loop: cst.For) -> dict[str, bool]:
    """Parameters of `func` that switch the step in `loop` on, and the value that does:
    `{"train_mode": True}` when every backward of the loop is under `if train_mode:`
    (`False` for `if not evaluate:`). One loop that trains or evaluates, as its caller
    says (`run_epoch(loader, train_mode=False)` evaluates)."""
    params = {p.name.value for p in func.params.params}
    backwards = [c for c in tree.within(loop, cst.Call) if method_name(c) == "backward"]
    flags: dict[str, bool] | None = None
    for call in backwards:
        here = {}
        node = tree.parent.get(call)
        while node is not None and node is not loop:
            if isinstance(node, cst.If):
                test, value = node.test, True
                if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                    test, value = test.expression, False
                if isinstance(test, cst.Name) and test.value in params:
                    here[test.value] = value
            node = tree.parent.get(node)
        flags = here if flags is None else {k: v for k, v in flags.items() if here.get(k) == v}
    return flags or {}


def _call_trains(
    func: cst.FunctionDef, call: cst.Call, flags: dict[str, bool], offset: int
) -> bool:
    """Whether `call` of `func` passes (or leaves at its default) the value of every flag
    that trains; a flag given as anything but a True/False literal may train."""
    params = list(func.params.params)
    for name, trains in flags.items():
        index = next(i for i, p in enumerate(params) if p.name.value == name)
        arg = find_arg(call, name, index - offset)
        value = arg.value if arg is not None else params[index].default
        if isinstance(value, cst.Name) and value.value in ("True", "False"):
            if (value.value == "True") != trains:
                return False
    return True


def _attribute_sources(tree, func: cst.FunctionDef, name: str) -> set[str]:
    """`self.loader = loader` in a method of the class: what its callers pass."""
    cls = class_of(tree, func)
    if cls is None:
        return set()
    found = _stored_from(tree, [cls], name)
    # Else from a base class (`BaseTrainer.__init__` stores what `Trainer` loops over).
    return found or _stored_from(tree, _class_family(tree.view, cls)[1:], name)


def _stored_from(tree, classes: list[cst.ClassDef], name: str) -> set[str]:
    found = set()
    for cls in classes:
        for assign in tree.view.within(cls, cst.Assign):
            if not isinstance(assign.value, cst.Name):
                continue
            if any(dotted(t.target) == name for t in assign.targets):
                method = tree.view.function(assign)
                found.add(assign.value.value)
                if method is not None:
                    found |= _parameter_sources(tree, method, assign.value.value)
    return found


def class_of(tree, node: cst.CSTNode) -> cst.ClassDef | None:
    """The class a node is defined in (a method's class), if any."""
    current = tree.parent.get(node)
    while current is not None and not isinstance(current, cst.ClassDef):
        current = tree.parent.get(current)
    return current


def _names_of_loader(tree: Tree, call: cst.Call) -> set[str]:
    """Where a DataLoader(...) ends up: `x = DataLoader(..)`, or returned by a helper whose
    result is bound (`train, val = make_loaders()`), also through helpers that return the
    helper's result in turn (`_get_data(flag)` around `data_provider(args, flag)`)."""
    return (
        _names_of_loader_here(tree, call)
        | {name for _, name in helper_results(tree, call)}
        | {name for _, name in bundled_results(tree, call)}
    )


# Attribute bundles: `loaders = Munch(src=get_loader(...), val=...)` keeps a loader as
# `loaders.src`.
BUNDLES = frozenset({"Munch", "EasyDict", "edict", "SimpleNamespace", "AttrDict", "DotMap"})


def bundled_results(tree: Tree, loader: cst.Call) -> list[tuple[cst.Call, str]]:
    """(the call, `loaders.src`) where the loader `loader` builds (the call itself, or the
    call of a helper that returns it: `return DataLoader(...)`) is a keyword of an attribute
    bundle bound to `loaders`, and that bundle is handed to a function that trains
    (`solver.train(loaders)`): a bundle of the same name handed only to
    `solver.sample(loaders)` keeps its loaders out."""
    view = tree.view
    made = [loader]
    func = view.function(loader)
    if func is not None and isinstance(view.parent.get(loader), cst.Return):
        made += [c for c in view.find(cst.Call) if _callee(c) == func.name.value]
    found = []
    for call in made:
        arg = view.parent.get(call)
        bundle = view.parent.get(arg) if isinstance(arg, cst.Arg) and arg.keyword else None
        if not isinstance(bundle, cst.Call) or _callee(bundle) not in BUNDLES:
            continue
        name = bound_target(tree, bundle)
        if name is not None and _handed_to_training(tree, view.statement(bundle), name):
            found.append((call, f"{name}.{arg.keyword.value}"))  # type: ignore[union-attr]
    return found


def method_or_name(call: cst.Call) -> str | None:
    """`train` for `train(x)`, `solver.train(x)` and `Solver(args).train(x)` alike."""
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return call.func.value if isinstance(call.func, cst.Name) else None


def _handed_to_training(tree: Tree, statement: cst.BaseStatement, name: str) -> bool:
    """Whether a statement after `statement`, in its block, calls a function that trains
    with `name` as an argument."""
    view = tree.view
    block = view.parent.get(statement)
    body = list(getattr(block, "body", []))
    if statement not in body:
        return False
    trains = training_functions(tree)
    for later in body[body.index(statement) + 1 :]:
        for call in view.within(later, cst.Call):
            if method_or_name(call) in trains and any(dotted(a.value) == name for a in call.args):
                return True
    return False


def training_loop_sources(tree: Tree) -> set[str]:
    """The names the training loops iterate, and the names their callers pass for them."""
    view = tree.view
    found: set[str] = set()
    for loop in _training_loops(view):
        name = iterated_name(loop, view)
        if name is not None:
            found |= {name} | _arguments_for(view, loop, name)
    return found


def _names_of_loader_here(tree: Tree, call: cst.Call) -> set[str]:
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


# Bases of an iterable (streaming) dataset: torch's, DataPipes, Hugging Face's.
ITERABLE_BASES = frozenset(
    {
        "torch.utils.data.IterableDataset",
        "torch.utils.data.dataset.IterableDataset",
        "torch.utils.data.IterDataPipe",
        "torch.utils.data.datapipes.datapipe.IterDataPipe",
        "torchdata.datapipes.iter.IterDataPipe",
        "datasets.IterableDataset",
    }
)
_ITERABLE_NAMES = frozenset({"IterableDataset", "IterDataPipe"})


def iterable_dataset_classes(tree: Tree) -> set[str]:
    """The classes of the script (or project) that are iterable datasets, also through
    a subclass of one (`class Subset(TokenDataset)`, `TokenDataset(IterableDataset)`):
    what DDP020/DDP024 and the migration's stream pass both ask."""
    view = tree.view
    return set(view_cached(view, "iterable_classes", lambda: _iterable_classes(view)))


def _iterable_classes(view) -> frozenset[str]:
    names: set[str] = set()
    classes = view.find(cst.ClassDef)
    grew = True
    while grew:
        grew = False
        for cls in classes:
            if cls.name.value in names:
                continue
            if any(_is_iterable_base(view, base.value, names) for base in cls.bases):
                names.add(cls.name.value)
                grew = True
    return frozenset(names)


def _is_iterable_base(view, base: cst.BaseExpression, known: set[str]) -> bool:
    """torch's IterableDataset (or another of ITERABLE_BASES), a base so named whatever
    it is imported from, or a class already known to be one."""
    qualified = view.qualify(base) or dotted(base) or ""
    last = qualified.rsplit(".", 1)[-1]
    return qualified in ITERABLE_BASES or last in _ITERABLE_NAMES or last in known


def _bindings(tree) -> dict[str, list[cst.BaseExpression]]:
    """Name -> the values assigned to it (`x = value`, and `with value as x`), in any
    module of the view: made once per view (a rule asks it for every loop of a file)."""
    return view_cached(tree.view, "bindings", lambda: _find_bindings(tree.view))


def _find_bindings(view) -> dict[str, list[cst.BaseExpression]]:
    found: dict[str, list[cst.BaseExpression]] = {}
    for assign in view.find(cst.Assign):
        for target in assign.targets:
            for bound, value in _paired(target.target, assign.value):
                name = dotted(bound)
                if name:
                    found.setdefault(name, []).append(value)
    for item in view.find(cst.WithItem):
        name = dotted(item.asname.name) if item.asname is not None else None
        if name:
            found.setdefault(name, []).append(item.item)
    return found


def _paired(
    target: cst.BaseExpression, value: cst.BaseExpression
) -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """`(target, value)`, or each element with its own value when both sides are tuples
    of the same length (`loss, total, bar = 0.0, 0, tqdm(loader)`)."""
    sequences = (cst.Tuple, cst.List)
    if not (isinstance(target, sequences) and isinstance(value, sequences)):
        return [(target, value)]
    targets, values = target.elements, value.elements
    starred = any(isinstance(e, cst.StarredElement) for e in (*targets, *values))
    if starred or len(targets) != len(values):
        return [(target, value)]
    return [(t.value, v.value) for t, v in zip(targets, values)]


# -- what an unresolved loop iterates, for its refusal ------------------------------------


@dataclass
class IteratedSource:
    """What a training loop iterates, once unwrapped: `self.train_loader`, and where its
    value was made (`get_instance(dataloaders, 'train_loader', config)`)."""

    name: str
    made_by: cst.Call | None
    class_chosen_at_run_time: (
        bool  # `getattr(module, config["type"])(...)`, directly or in a helper
    )


def iterated_source(tree: Tree, loop: cst.For) -> IteratedSource | None:
    """What `loop` iterates (through tqdm, enumerate, progress bars) when it is a name, and
    the call that made it (in any module); None for `range(...)` and other calls."""
    view = tree.view
    bindings = _bindings(tree)
    stream = unwrap(loop.iter, _loop_bindings(view, loop, bindings))
    name = dotted(stream.source) if stream is not None else None
    if name is None:
        return None
    sources = [name, *sorted(_arguments_for(view, loop, name))]
    calls = [v for s in sources for v in bindings.get(s, []) if isinstance(v, cst.Call)]
    # Not a wrapper around another of those names (`DataPrefetcher(train_loader)` on GPUs):
    # the call that made the loader in the first place.
    origins = [c for c in calls if not any(dotted(a.value) in sources for a in c.args)]
    made_by = (origins or calls or [None])[0]
    return IteratedSource(name, made_by, made_by is not None and _class_at_run_time(view, made_by))


def _class_at_run_time(view, call: cst.Call) -> bool:
    """`getattr(module, name)(...)`, `REGISTRY[name](...)`, or a helper of the project that
    returns one of those (`get_instance(module, "train_loader", config)`)."""
    if isinstance(call.func, (cst.Call, cst.Subscript)):
        return True
    callee = dotted(call.func)
    func = view.functions().get(callee.rsplit(".", 1)[-1]) if callee else None
    if func is None:
        return False
    returns = [r.value for r in view.within(func, cst.Return) if r.value is not None]
    return bool(returns) and all(
        isinstance(value, cst.Call) and isinstance(value.func, (cst.Call, cst.Subscript))
        for value in returns
    )


def data_parallel_subclasses(tree: Tree) -> frozenset[str]:
    """The project's classes that derive from DataParallel, directly or through another
    of them (`class DataParallelWithCallback(DataParallel)`, a sync-BatchNorm package's
    replica hooks)."""

    def compute() -> frozenset[str]:
        view = tree.view
        found: set[str] = set()
        grew = True
        while grew:
            grew = False
            for cls in view.find(cst.ClassDef, lambda c: c.name.value not in found):
                for base in cls.bases:
                    short = (dotted(base.value) or "").rsplit(".", 1)[-1]
                    if view.qualify(base.value) == DATA_PARALLEL or short in found:
                        found.add(cls.name.value)
                        grew = True
                        break
        return frozenset(found)

    return view_cached(tree.view, "data_parallel_subclasses", compute)


def dataloader_subclasses(tree: Tree) -> dict[str, list[str]]:
    """The project's classes that derive from DataLoader directly, each with the classes
    that derive from it in turn (`BaseDataLoader` -> `VOC`, `COCO`), in source order."""
    view = tree.view
    classes = view.find(cst.ClassDef)
    root_of: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for cls in classes:
            if cls.name.value in root_of:
                continue
            for base in cls.bases:
                short = (dotted(base.value) or "").rsplit(".", 1)[-1]
                if view.qualify(base.value) == DATA_LOADER:
                    root_of[cls.name.value] = cls.name.value
                elif short in root_of:
                    root_of[cls.name.value] = root_of[short]
                else:
                    continue
                grew = True
                break
    found: dict[str, list[str]] = {}
    for cls in classes:
        root = root_of.get(cls.name.value)
        if root is not None:
            found.setdefault(root, [])
            if root != cls.name.value:
                found[root].append(cls.name.value)
    return found


def loader_holding_classes(tree: Tree) -> list[tuple[str, cst.Call]]:
    """The project's classes that build a DataLoader into an attribute of their own
    (`self.dataloader = DataLoader(...)`) and hand out its batches from `__iter__`
    (`for data in self.dataloader: yield data`): (class name, the DataLoader call). An
    instance of such a class is the loader a training loop iterates."""
    view = tree.view
    found = []
    for cls in view.find(cst.ClassDef):
        loaders = {
            target: call
            for call in view.within(cls, cst.Call)
            if view.qualify(call.func) == DATA_LOADER
            and (target := bound_target(view.owner(call) or tree, call)) is not None
            and target.startswith("self.")
        }
        iterates = _iterated_attributes(view, cls)
        found += [(cls.name.value, call) for name, call in loaders.items() if name in iterates]
    return found


def _iterated_attributes(view, cls: cst.ClassDef) -> set[str]:
    """The `self.` attributes `cls.__iter__` loops over, yields from or hands to `iter()`."""
    method = class_methods(cls).get("__iter__")
    if method is None:
        return set()
    names = set()
    for loop in view.within(method, cst.For):
        iterated = loop.iter
        if isinstance(iterated, cst.Call) and iterated.args:  # enumerate(self.loader), tqdm(...)
            iterated = iterated.args[0].value
        names.add(dotted(iterated))
    for node in view.within(method, cst.Yield):
        if isinstance(node.value, cst.From):
            names.add(dotted(node.value.item))
    for call in view.within(method, cst.Call):
        if dotted(call.func) == "iter" and call.args:
            names.add(dotted(call.args[0].value))
    return {name for name in names if name and name.startswith("self.")}


@dataclass
class LazilyBuilt:
    """A model whose optimizer is made only after a forward pass, in a method other than
    the one that builds it: the forward may create its layers (a data-dependent
    initialisation, `netF` of a patch-sampling head), so its parameters are known only
    then."""

    model: str  # `self.netF`
    optimizer: cst.Call  # the optimizer made after the forward
    forward: cst.Call  # the forward before it
    method: str  # the method both are in (`data_dependent_initialize`)


def lazily_built_models(tree: Tree) -> list[LazilyBuilt]:
    """The project's models trained by an optimizer that a method makes after running a
    forward (`self.forward()` or a call of a `self.` model), when the model itself is
    built in another method (`__init__`)."""
    view = tree.view
    found: list[LazilyBuilt] = []
    if not _builds_layers_late(view):
        return found
    for optimizer in _optimizer_calls(view):
        method = view.function(optimizer)
        if method is None or method.name.value == "__init__":
            continue
        before = [c for c in view.within(method, cst.Call) if statement_before(view, c, optimizer)]
        forward = next((c for c in before if _is_forward(view, c)), None)
        if forward is None:
            continue
        for model in trained_owners(view, optimizer):
            if model.startswith("self.") and not _assigned_in(view, method, model):
                found.append(LazilyBuilt(model, optimizer, forward, method.name.value))
    return found


def _builds_layers_late(view) -> bool:
    """Whether a class of the project stores a `torch.nn` layer on itself in a method
    other than `__init__` (`self.proj = nn.Linear(...)`, `setattr(self, name, mlp)` after
    `mlp = nn.Sequential(...)`): a layer that exists only once that method ran."""
    for cls in view.find(cst.ClassDef):
        for method in view.within(cls, cst.FunctionDef):
            if method.name.value != "__init__" and _stores_layer_on_self(view, method):
                return True
    return False


def _stores_layer_on_self(view, method: cst.FunctionDef) -> bool:
    layers = {
        dotted(target.target)
        for assign in view.within(method, cst.Assign)
        if _makes_layer(view, assign.value)
        for target in assign.targets
    }
    if any((name or "").startswith("self.") for name in layers):
        return True
    return any(
        dotted(call.func) == "setattr"
        and len(call.args) == 3
        and dotted(call.args[0].value) == "self"
        and (dotted(call.args[2].value) in layers or _makes_layer(view, call.args[2].value))
        for call in view.within(method, cst.Call)
    )


def _makes_layer(view, value: cst.BaseExpression) -> bool:
    """`nn.Linear(...)`, also moved: `nn.Linear(...).to(x.device)`."""
    while (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and isinstance(value.func.value, cst.Call)
    ):
        value = value.func.value
    if not isinstance(value, cst.Call):
        return False
    qualified = view.qualify(value.func) or ""
    module, _, name = qualified.rpartition(".")
    return module == "torch.nn" and name[:1].isupper()


def statement_before(view, node: cst.CSTNode, other: cst.CSTNode) -> bool:
    """Whether the statement holding `node` comes before the one holding `other`, in one
    module (`view`: a project view, or the module's own tree)."""
    first, second = view.statement(node), view.statement(other)
    tree = view.owner(node)
    if tree is None or first is None or second is None or first is second:
        return False
    return tree.order.get(first, 0) < tree.order.get(second, 0)


def _is_forward(view, call: cst.Call) -> bool:
    """`self.forward()`, or a `self.` model called (`self.netG(x)`): a forward pass."""
    name = dotted(call.func) or ""
    return name == "self.forward" or name in _trained_modules(view)


def _assigned_in(view, method: cst.FunctionDef, name: str) -> bool:
    return any(
        any(dotted(target.target) == name for target in assign.targets)
        for assign in view.within(method, cst.Assign)
    )


def replicated_steps(tree: Tree) -> list:
    """The training loops of this module that run whole on every rank (steps that keep
    their batch whole, analysis/unsplittable.py; migrate/replicate.py marks them): their
    global batch is the original's, whatever the world size."""
    _, unresolved = train_loaders(tree)
    models = model_names(tree)
    found = []
    for loop in unresolved:
        if stream_batch(tree, loop) is None:
            step = unsplittable_step(tree, loop, models)
            if step is not None:
                found.append(step)
    return found
