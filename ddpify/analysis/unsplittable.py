"""Training steps that no split of the batch across ranks computes the same way.

Three shapes of hand-made training steps keep their batch whole:

- full batch: the model sees only tensors built before the loop (`output = model(features,
  adj)` every epoch, a graph network over its whole graph);
- one example per step: `x, y = Xtr[[i]], Ytr[[i]]`, a batch of one;
- carried state: truncated backpropagation through time, the hidden state the model
  returns is fed back at the next step (`outputs, states = model(inputs, states)`), sized
  by the rows of the batch.

Such a step can be replicated: every rank computes the whole step, DDP averages N equal
gradients, and the result is the original's (with no speed-up). That is sound only where
the analysis proves the step draws nothing from a loader or a stream: no DataLoader in
the project, no `next(...)` in the step, no batch stream. A loop that pulls its batch
each step (`inputs = next(fetcher)`) is never full-batch: `pulled_batch` names the pull.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.batches import (
    BatchAssignment,
    batch_assignments,
    body_nodes,
    carried_state,
    model_calls,
    single_example,
)
from ddpify.analysis.names import dotted

DATA_LOADER = "torch.utils.data.DataLoader"
FULL_BATCH = "full batch"
ONE_EXAMPLE = "one example per step"
CARRIED_STATE = "carried state"
# Calls that take the next batch from an iterator (`next(fetcher)`, `it.__next__()`).
PULLS = frozenset({"next", "__next__", "iter"})


@dataclass
class UnsplittableStep:
    """A training loop whose step keeps its batch whole, and why."""

    loop: cst.For | cst.While
    kind: str  # FULL_BATCH, ONE_EXAMPLE or CARRIED_STATE
    statement: cst.CSTNode  # the line to change to share the work (see `speed_up`)
    detail: str  # the carried name, or the names the model reads


@dataclass
class PulledBatch:
    """`inputs = next(fetcher)` in a training loop: the batch comes from an iterator."""

    statement: cst.CSTNode
    source: str | None  # what is pulled from (`fetcher`), when it is a name


def unsplittable_step(tree, loop: cst.For | cst.While, models: set[str]) -> UnsplittableStep | None:
    """Why `loop`'s step cannot be split by rank, when the analysis can prove it draws from
    no loader or stream (else None: the loop is not replicated)."""
    if replication_blocker(tree, loop) is not None:
        return None
    return step_shape(tree, loop, models)


def replication_blocker(tree, loop: cst.For | cst.While) -> cst.CSTNode | None:
    """What stops the proof that the step draws from no loader: a DataLoader built anywhere
    in the project, or a pull from an iterator in the step (None: nothing)."""
    loaders = tree.view.calls_to(DATA_LOADER)
    if loaders:
        return loaders[0]
    pulled = pulled_batch(tree, loop)
    return pulled.statement if pulled is not None else None


def step_shape(tree, loop: cst.For | cst.While, models: set[str]) -> UnsplittableStep | None:
    """The step's shape when it keeps its batch whole, whatever it may draw from."""
    batches = batch_assignments(loop, models)
    if batches:
        return _kept_whole(loop, batches, models)
    return _full_batch(tree, loop, models)


def _kept_whole(loop, batches: list[BatchAssignment], models: set[str]) -> UnsplittableStep | None:
    """A batch made in the loop that a split would change: one example, or rows that carry
    the model's state into the next step."""
    state = carried_state(loop, models)
    if state:
        return UnsplittableStep(loop, CARRIED_STATE, batches[0].statement, state[0])
    for batch in batches:
        if single_example(batch.value):
            return UnsplittableStep(loop, ONE_EXAMPLE, batch.statement, ", ".join(batch.names))
    return None


def _full_batch(tree, loop, models: set[str]) -> UnsplittableStep | None:
    """Every model call of the step (in the loop, or in a function of the module the loop
    calls) reads only names that neither the loop nor that function binds."""
    called = called_bodies(tree, loop)
    bodies = [loop, *called]
    calls = [call for body in bodies for call in model_calls(body, models)]
    if not calls:
        return None
    bound = set().union(*(_bound_names(body) for body in bodies))
    # `global X` in a function of the module: X may be rebound each step out of sight.
    owner = tree.view.owner(loop) or tree
    bound |= {n.name.value for g in owner.find(cst.Global) for n in g.names}
    handed = _handed_in(loop, called)
    read: list[str] = []
    for call in calls:
        for arg in call.args:
            name = dotted(arg.value)
            if name is None:
                return None
            root = name.split(".")[0]
            if root in bound:
                # `def train_iter(model, input)` called as `train_iter(gcn, (features, adj))`:
                # the parameter holds what the loop hands in, whole when the loop binds none
                # of the names it is made of.
                passed = handed.get(root)
                if passed is None or passed & _bound_names(loop):
                    return None
                read += sorted(passed)
                continue
            read.append(name)
    statement = tree.view.statement(calls[0]) or calls[0]
    return UnsplittableStep(loop, FULL_BATCH, statement, ", ".join(dict.fromkeys(read)))


def _handed_in(loop, called: list[cst.FunctionDef]) -> dict[str, set[str]]:
    """For the parameters of the functions `loop` calls that the function itself never
    rebinds: the names the loop's calls pass for them (`input` -> {features, adj} for
    `train_iter(epoch, (features, adj))`). A parameter some call leaves to its default,
    or fills with something other than plain names, is left out."""
    found: dict[str, set[str]] = {}
    missing: set[str] = set()
    for func in called:
        params = [p.name.value for p in func.params.params]
        rebound = _bound_names_inside(func)
        calls = [
            node
            for node in body_nodes(loop)
            if isinstance(node, cst.Call)
            and isinstance(node.func, cst.Name)
            and node.func.value == func.name.value
        ]
        for call in calls:
            if any(arg.star or arg.keyword is not None for arg in call.args):
                missing |= set(params)
                continue
            for index, param in enumerate(params):
                names = _plain_names(call.args[index].value) if index < len(call.args) else None
                if names is None or param in rebound:
                    missing.add(param)
                else:
                    found.setdefault(param, set()).update(names)
    return {name: names for name, names in found.items() if name not in missing}


def _bound_names_inside(func: cst.FunctionDef) -> set[str]:
    """Names the function's body binds (its parameters not counted)."""
    params = {p.name.value for p in _parameters(func.params)}
    return _bound_names(func.body) - (params - _bound_names(func.body))


def _plain_names(expr: cst.BaseExpression) -> set[str] | None:
    """The names of a name, an attribute chain or a tuple/list of them; None otherwise."""
    if isinstance(expr, (cst.Tuple, cst.List)):
        found: set[str] = set()
        for element in expr.elements:
            names = _plain_names(element.value)
            if names is None:
                return None
            found |= names
        return found
    name = dotted(expr)
    return {name.split(".")[0]} if name is not None else None


def pulled_batch(tree, loop: cst.For | cst.While) -> PulledBatch | None:
    """The first statement of the loop (or of a function of the module it calls) that
    takes something from an iterator: `inputs = next(fetcher)`, `x = it.__next__()`."""
    for body in [loop, *called_bodies(tree, loop)]:
        for node in body_nodes(body):
            if isinstance(node, cst.Call) and _is_pull(node):
                source = dotted(node.args[0].value) if node.args else None
                if source is None and isinstance(node.func, cst.Attribute):
                    source = dotted(node.func.value)
                return PulledBatch(tree.view.statement(node) or node, source)
    return None


def _is_pull(call: cst.Call) -> bool:
    name = dotted(call.func)
    return name is not None and name.rsplit(".", 1)[-1] in PULLS


def called_bodies(tree, loop) -> list[cst.FunctionDef]:
    """The functions of the loop's module that the loop calls by name (`train(epoch)`)."""
    functions = (tree.view.owner(loop) or tree).functions()
    found = []
    for node in body_nodes(loop):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            func = functions.get(node.func.value)
            if func is not None and func not in found:
                found.append(func)
    return found


def _bound_names(body: cst.CSTNode) -> set[str]:
    """Names `body` binds: assignment targets, loop targets, `with ... as` names."""
    found: set[str] = set()
    targets: list[cst.CSTNode] = []
    for node in body_nodes(body):
        if isinstance(node, cst.Assign):
            targets += [t.target for t in node.targets]
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor)):
            targets.append(node.target)
        elif isinstance(node, cst.AsName):
            targets.append(node.name)
        elif isinstance(node, cst.NamedExpr):
            targets.append(node.target)
    if isinstance(body, cst.For):
        targets.append(body.target)
    if isinstance(body, cst.FunctionDef):  # `def train(x)`: the caller hands the batch in
        found |= {param.name.value for param in _parameters(body.params)}
    for target in targets:
        for node in [target, *body_nodes(target)]:
            if isinstance(node, cst.Name):
                found.add(node.value)
    return found


def _parameters(params: cst.Parameters) -> list[cst.Param]:
    star = [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    return [*params.posonly_params, *params.params, *params.kwonly_params, *star]


# -- what a loop that pulls its batch draws from, for its refusal -------------------------

# Samplers whose draw a DistributedSampler would replace (it draws uniformly, without
# replacement): the class-balanced or subset draws of these would be lost.
CUSTOM_SAMPLERS = frozenset({"WeightedRandomSampler", "SubsetRandomSampler", "RandomSampler"})


@dataclass
class DrawingLoader:
    """A DataLoader of the project that draws its indices with a sampler of its own."""

    call: cst.Call  # `data.DataLoader(dataset=dataset, sampler=sampler, ...)`
    sampler: cst.Call  # `WeightedRandomSampler(weights, len(weights))`
    kind: str  # `WeightedRandomSampler`
    function: str | None  # the function that builds the loader (`get_train_loader`)


def drawing_loaders(tree) -> list[DrawingLoader]:
    """The project's DataLoaders built with `sampler=` a torch sampler that draws in its own
    way, found through the name the sampler is bound to and one helper that returns it
    (`sampler = _make_balanced_sampler(labels)`)."""
    view = tree.view
    samplers = [c for c in view.find(cst.Call) if _sampler_kind(view, c) is not None]
    makers = {}
    for sampler in samplers:
        func = view.function(sampler)
        returned = isinstance(view.parent.get(sampler), cst.Return)
        if func is not None and returned:
            makers[func.name.value] = sampler
    found = []
    for call in view.calls_to(DATA_LOADER):
        arg = next((a for a in call.args if a.keyword and a.keyword.value == "sampler"), None)
        if arg is None:
            continue
        sampler = _sampler_behind(view, call, arg.value, samplers, makers)
        if sampler is not None:
            func = view.function(call)
            name = func.name.value if func is not None else None
            found.append(DrawingLoader(call, sampler, _sampler_kind(view, sampler) or "", name))
    return found


def _sampler_kind(view, call: cst.Call) -> str | None:
    name = view.qualify(call.func) or ""
    last = name.rsplit(".", 1)[-1]
    return last if name.startswith("torch.utils.data") and last in CUSTOM_SAMPLERS else None


def _sampler_behind(view, loader: cst.Call, value, samplers, makers) -> cst.Call | None:
    """The sampler call behind `sampler=value`: the call itself, or what the name was bound
    to in the loader's function (directly or through a helper that returns a sampler)."""
    if isinstance(value, cst.Call):
        if value in samplers:
            return value
        return makers.get(dotted(value.func) or "")
    name = dotted(value)
    func = view.function(loader)
    if name is None or func is None:
        return None
    for assign in view.within(func, cst.Assign):
        if isinstance(assign.value, cst.Call) and any(
            dotted(t.target) == name for t in assign.targets
        ):
            found = _sampler_behind(view, loader, assign.value, samplers, makers)
            if found is not None:
                return found
    return None


# -- data that may differ by process ---------------------------------------------------------

# Calls that number or list a set's items in its iteration order.
ORDER_TAKERS = frozenset({"enumerate", "list", "tuple", "zip", "iter", "dict.fromkeys"})


def set_orders(tree) -> list[cst.Call]:
    """`set(labels)` calls of this module whose iteration order the code keeps (`for i, c
    in enumerate(set(labels))`, or through a name bound to the set): for strings that
    order depends on the process's hash seed, so processes may number the items apart."""
    found = []
    for call in tree.find(cst.Call):
        if not _is_builtin_set(tree, call) or len(call.args) != 1:
            continue
        if _order_kept(tree, call) or any(
            _order_kept(tree, use) for use in _uses_of_binding(tree, call)
        ):
            found.append(call)
    return found


def _is_builtin_set(tree, call: cst.Call) -> bool:
    """`set(...)`, the builtin: not a name the module imports or defines as `set`."""
    if not isinstance(call.func, cst.Name) or call.func.value != "set":
        return False
    shadowed = "set" in tree.functions()
    return tree.qualify(call.func) in (None, "set", "builtins.set") and not shadowed


def _order_kept(tree, node: cst.CSTNode) -> bool:
    if _under_sorted(tree, node):
        return False
    parent = tree.parent.get(node)
    if isinstance(parent, (cst.For, cst.CompFor)) and parent.iter is node:
        return True
    if isinstance(parent, cst.Arg):
        call = tree.parent.get(parent)
        return isinstance(call, cst.Call) and dotted(call.func) in ORDER_TAKERS
    return False


def _under_sorted(tree, node: cst.CSTNode) -> bool:
    """`sorted(list(set(labels)))`: the order is made again, the same in every process."""
    while node is not None and not isinstance(node, cst.BaseStatement):
        if isinstance(node, cst.Call) and dotted(node.func) == "sorted":
            return True
        node = tree.parent.get(node)
    return False


def _uses_of_binding(tree, value: cst.Call) -> list[cst.Name]:
    """The names read in the same function that `name = set(...)` binds."""
    assign = tree.parent.get(value)
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return []
    target = assign.targets[0].target
    if not isinstance(target, cst.Name):
        return []
    scope = tree.function(assign) or tree.module
    return [
        node
        for node in tree.within(scope, cst.Name)
        if node.value == target.value and node is not target
    ]
