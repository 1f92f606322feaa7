"""Training-loop facts: sharded loaders, collectives, optimizer steps,
gradient-accumulation conditions and rank-local exits.

The rules of the training loop and the metrics rule ask these questions; so can the
migration passes (`collect_loops` gives the loops of a module without the engine).
Whole-subtree questions (`collectives_in`, `calls_in`) walk only the subtree asked
about, so a file pays for them only where a rule found a candidate.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.model import ScriptModel, unwrap_call_chain
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.reachability import never_run
from ddpify.analysis.roles import backward_units, distributed_sampler_value, iterated_name
from ddpify.analysis.tree import Tree
from ddpify.analysis.values import mentions_world_size, per_process_source
from ddpify.walk import children, subtree, walk

Ancestors = tuple[cst.CSTNode, ...]

DDP = "torch.nn.parallel.DistributedDataParallel"
DATALOADER = "torch.utils.data.DataLoader"
DISTRIBUTED_SAMPLER = "torch.utils.data.DistributedSampler"
DIST = "torch.distributed"
COLLECTIVES = frozenset(
    f"{DIST}.{name}"
    for name in (
        "barrier",
        "monitored_barrier",
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
    )
)
# Helpers that, by their name, combine a value across ranks (`reduce_tensor`,
# `all_reduce_mean`, `gather_metrics`, `meter.synchronize_between_processes()`).
_REDUCING_HELPER = re.compile(r"reduce|gather|sync|broadcast|across_(ranks|processes)", re.I)
# What the accumulation condition divides the step by: `accum`, `args.grad_accum_steps`,
# `gradient_accumulation_steps`, `update_freq`, `iters_to_accumulate`.
_ACCUMULATION = re.compile(r"accum|update_freq|grad_acc|micro", re.I)
EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit"})


walk_subtree = subtree  # `root` and every node below it, in source (pre-)order


def own_nodes(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Nodes below `root` that belong to its own body: nested functions, lambdas and
    classes are skipped (they run at another time)."""
    stack = list(reversed(list(children(root))))
    while stack:
        node = stack.pop()
        yield node
        if type(node) not in (cst.FunctionDef, cst.ClassDef, cst.Lambda):
            stack.extend(reversed(list(children(node))))


def names_of(node: cst.CSTNode) -> set[str]:
    """Dotted names read in `node`: `loss`, `self.model`, `args.accum` (and their heads)."""
    found = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if type(current) in (cst.Name, cst.Attribute):
            name = dotted(current)
            if name is not None:
                found.add(name)
        if type(current) is cst.Attribute:
            stack.append(current.value)  # not `attr`: `self.model` does not read `model`
        else:
            stack.extend(children(current))
    return found


# -- sharded loaders (the DDP wrapper: ddpify/analysis/wrappers.py) ----------------------


@dataclass(frozen=True)
class ShardedLoader:
    call: cst.Call
    target: str | None
    dataset: str | None  # the dataset argument as written, if a dotted name
    batch_size: cst.BaseExpression | None


def sampled_datasets(model: ScriptModel) -> set[str]:
    """Datasets handed to a DistributedSampler, as written (`train_ds`, `self.dataset`)."""
    found = set()
    for call in model.calls.get(DISTRIBUTED_SAMPLER, []):
        arg = find_arg(call, "dataset", 0)
        name = dotted(arg.value) if arg is not None else None
        if name is not None:
            found.add(name)
    return found


SUBSET = "torch.utils.data.Subset"


def _is_rank_subset(model: ScriptModel, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """`Subset(ds, range(rank, len(ds), world))`, directly or by name: a shard by hand."""
    if type(expr) is cst.Call and model.imports.qualify(expr.func) == SUBSET:
        indices = find_arg(expr, "indices", 1)
        return indices is not None and (
            per_process_source(indices.value, model.imports, model.bindings) == "the rank"
        )
    name = dotted(expr)
    return (
        depth < 3
        and name is not None
        and any(_is_rank_subset(model, v, depth + 1) for v in model.bindings.get(name, []))
    )


def sharded_loaders(model: ScriptModel, tree: Tree) -> list[ShardedLoader]:
    """DataLoaders whose sampler is a DistributedSampler (inline, by name, on a branch of
    a conditional: `roles.distributed_sampler_value`, as migrate asks; or over the same
    dataset a DistributedSampler is built on), or over a Subset sharded by rank."""
    loaders = model.calls.get(DATALOADER, [])
    if not loaders or not (model.calls.get(DISTRIBUTED_SAMPLER) or model.calls.get(SUBSET)):
        return []
    targets: dict[int, str] = {}
    for target, values in model.bindings.items():
        for value in values:
            call = unwrap_call_chain(value)
            if call is not None:
                targets[id(call)] = target
    sampled = sampled_datasets(model)
    found = []
    for call in loaders:
        dataset_arg = find_arg(call, "dataset", 0)
        dataset = dotted(dataset_arg.value) if dataset_arg is not None else None
        sampler = find_arg(call, "sampler", 3)
        by_sampler = sampler is not None and bool(distributed_sampler_value(tree, sampler.value))
        by_subset = dataset_arg is not None and _is_rank_subset(model, dataset_arg.value)
        if by_sampler or by_subset or (dataset in sampled and sampler is not None):
            batch = find_arg(call, "batch_size", 1)
            found.append(
                ShardedLoader(call, targets.get(id(call)), dataset, batch.value if batch else None)
            )
    return found


# A hand-written loader's class name (`DistributedDataLoader`, `TokenStream`).
_STREAM_CLASS = re.compile(r"loader|stream|iterator", re.I)


def rank_sharded_streams(model: ScriptModel) -> set[str]:
    """Names bound to a loader class of the project's own that is given both the rank
    and the world size (`DistributedDataLoader(path, B, T, rank, world_size)`): each
    rank reads its own part of the data, as with a DistributedSampler."""
    found = set()
    for target, values in model.bindings.items():
        for value in values:
            call = unwrap_call_chain(value)
            name = dotted(call.func) if call is not None else None
            if name is None or not _STREAM_CLASS.search(name.rsplit(".", 1)[-1]):
                continue
            if (model.imports.qualify(call.func) or "").startswith("torch."):  # type: ignore[union-attr]
                continue  # torch's DataLoader is sharded by its sampler, if at all
            args = [arg.value for arg in call.args if not arg.star]  # type: ignore[union-attr]
            by_rank = any(
                per_process_source(arg, model.imports, model.bindings) == "the rank" for arg in args
            )
            if by_rank and any(mentions_world_size(arg) for arg in args):
                found.add(target)
    return found


# -- calls -----------------------------------------------------------------------------------


def is_collective(model: ScriptModel, call: cst.Call, wrappers: set[str]) -> bool:
    """A call every rank must make: a `torch.distributed` collective, the forward of a
    DDP wrapper, or a backward when the script has one (DDP all-reduces in it)."""
    if model.imports.qualify(call.func) in COLLECTIVES:
        return True
    if not wrappers:
        return False
    func = call.func
    if type(func) is cst.Attribute and func.attr.value == "forward":
        func = func.value
    if dotted(func) in wrappers:
        return True
    return method_name(call) == "backward"


def collectives_in(
    model: ScriptModel, root: cst.CSTNode, wrappers: set[str], depth: int = 2
) -> list[cst.Call]:
    """Collectives run by `root`, also inside the script's own functions it calls
    (`train_one_epoch(...)`, `self.evaluate()`), `depth` calls deep."""
    found = []
    for node in own_nodes(root):
        if type(node) is not cst.Call:
            continue
        if is_collective(model, node, wrappers):
            found.append(node)
        elif depth > 0:
            helper = _helper_called(model, node)
            if helper is not None and helper is not root:
                if collectives_in(model, helper, wrappers, depth - 1):
                    found.append(node)
    return found


def _helper_called(model: ScriptModel, call: cst.Call) -> cst.FunctionDef | None:
    """The function of this file that `call` runs (by name: `f(...)`, `self.f(...)`)."""
    func = call.func
    if type(func) is cst.Name:
        return model.functions.get(func.value)
    if type(func) is cst.Attribute and type(func.value) is cst.Name:
        if func.value.value in {"self", "cls"}:
            return model.functions.get(func.attr.value)
    return None


def parameter_index(function: cst.FunctionDef, name: str) -> tuple[int | None, bool]:
    """Position of parameter `name` (skipping `self`), and whether it is one at all."""
    params = [p.name.value for p in (*function.params.posonly_params, *function.params.params)]
    if params and params[0] in {"self", "cls"}:
        params = params[1:]
    if name in params:
        return params.index(name), True
    kwonly = {p.name.value for p in function.params.kwonly_params}
    return None, name in kwonly


class CallIndex:
    """Calls of a module by the last part of their name (`f` of `f()`, `self.f()`), and
    its assignments: built by one walk, for questions about a module's call sites."""

    def __init__(self, module: cst.Module) -> None:
        self.by_name: dict[str, list[cst.Call]] = {}
        self.assigns: list[cst.Assign] = []
        for node in walk_subtree(module):
            if type(node) is cst.Call:
                func = node.func
                name = func.attr.value if type(func) is cst.Attribute else dotted(func)
                if name is not None:
                    self.by_name.setdefault(name, []).append(node)
            elif type(node) is cst.Assign:
                self.assigns.append(node)


def arguments_for(
    index: CallIndex, function: cst.FunctionDef, name: str
) -> list[cst.BaseExpression]:
    """What the script's calls of `function` pass for its parameter `name`."""
    position, is_parameter = parameter_index(function, name)
    if not is_parameter:
        return []
    found = []
    for call in index.by_name.get(function.name.value, ()):
        arg = find_arg(call, name, position)
        if arg is not None:
            found.append(arg.value)
    return found


def is_reducing_call(model: ScriptModel, call: cst.Call) -> bool:
    """A collective, or a helper named for reducing across ranks."""
    if model.imports.qualify(call.func) in COLLECTIVES:
        return True
    name = dotted(call.func)
    return name is not None and bool(_REDUCING_HELPER.search(name.rsplit(".", 1)[-1]))


def reduced_names(model: ScriptModel, root: cst.CSTNode) -> set[str]:
    """Names handed to (or the receivers of) reducing calls anywhere below `root`."""
    found: set[str] = set()
    for node in walk_subtree(root):
        if type(node) is cst.Call and is_reducing_call(model, node):
            for arg in node.args:
                found |= names_of(arg.value)
            if type(node.func) is cst.Attribute:
                found |= names_of(node.func.value)
    return found


def is_exit_call(node: cst.CSTNode) -> bool:
    if type(node) is not cst.Call:
        return False
    func = node.func
    last = func.attr.value if type(func) is cst.Attribute else getattr(func, "value", None)
    return last in _EXIT_NAMES and dotted(func) in EXIT_CALLS  # cheap test first


_EXIT_NAMES = {"exit", "quit", "_exit"}


def is_optimizer_step(call: cst.Call, optimizers: Collection[str] = ()) -> bool:
    """`optimizer.step()`, `self.opt.step()`, `scaler.step(optimizer)`; not schedulers.

    `optimizers`: the names the analysis knows hold optimizers (`roles.optimizer_names`),
    so `g_solver.step()` counts; without them, or for other receivers, the name says."""
    if method_name(call) != "step":
        return False
    receiver = dotted(call.func.value) or ""  # type: ignore[attr-defined]
    if receiver in optimizers:
        return True
    receiver = receiver.lower()
    if "sched" in receiver or "lr" in receiver.rsplit(".", 1)[-1]:
        return False
    return "opt" in receiver or "scaler" in receiver


GRAD = "torch.autograd.grad"


def gradient_penalties(view) -> list[cst.Call]:
    """Gradients the step differentiates again: `torch.autograd.grad(..., create_graph=True)`
    (an R1 or WGAN-GP gradient penalty) or `loss.backward(create_graph=True)`, in code the
    project runs. A GradScaler scales only the loss it is given: such a penalty, taken on
    an fp16 graph, underflows or overflows unless its own gradients are scaled and
    unscaled by hand (the torch.amp "gradient penalty" recipe)."""
    found = []
    for call in view.find(cst.Call, _creates_graph):
        if method_name(call) == "backward" or view.qualify(call.func) == GRAD:
            if not never_run(view, call) and _function_is_called(view, call):
                found.append(call)
    return found


def _function_is_called(view, node: cst.CSTNode) -> bool:
    """Whether the function `node` lies in (if any) is called somewhere, by its name
    (`cal_gradient_penalty(...)`, `self.r1(...)`): a penalty helper nobody calls (an option
    of a shared network module this script never takes) computes nothing."""
    function = view.owner(node).function(node)
    if function is None:
        return True
    name = function.name.value

    def calls_it(call: cst.Call) -> bool:
        callee = dotted(call.func) or ""
        return callee.rsplit(".", 1)[-1] == name and not view.inside(call, function)

    return bool(view.find(cst.Call, calls_it))


def _creates_graph(call: cst.Call) -> bool:
    arg = find_arg(call, "create_graph")
    return arg is not None and not (
        isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None")
    )


def accumulation_test(test: cst.BaseExpression, model: ScriptModel | None = None) -> bool:
    """`(i + 1) % accum == 0`, `step % args.grad_accum_steps == 0 or last`: a test on a
    step counter modulo an accumulation count; with `model`, also a name assigned such a
    test (`sync = (i + 1) % accum == 0` ... `if sync:`)."""
    if model is not None:
        for name in names_of(test):
            if any(accumulation_test(value) for value in model.bindings.get(name, ())):
                return True
    for node in walk_subtree(test):
        if type(node) is cst.BinaryOperation and type(node.operator) is cst.Modulo:
            if any(_ACCUMULATION.search(name) for name in names_of(node.right)):
                return True
    return False


# -- loops -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """A node and its ancestry (module first, the node last)."""

    node: cst.CSTNode
    ancestors: Ancestors

    def function(self) -> cst.FunctionDef | None:
        for node in reversed(self.ancestors[:-1]):
            if type(node) is cst.FunctionDef:
                return node
        return None

    def scope(self) -> cst.CSTNode:
        """The class of a method, else the function, else the module, holding the node."""
        function = self.node if type(self.node) is cst.FunctionDef else self.function()
        if function is None:
            return self.ancestors[0]
        index = self.ancestors.index(function)
        if index > 1 and isinstance(self.ancestors[index - 2], cst.ClassDef):
            return self.ancestors[index - 2]
        return function


@dataclass
class LoopFacts:
    """Loops and exits of one file, recorded during the engine's visit."""

    loops: list[Located] = field(default_factory=list)
    functions: list[Located] = field(default_factory=list)
    exits: list[Located] = field(default_factory=list)  # break, return, sys.exit()
    # Mentions of `no_sync` / `require_backward_grad_sync`.
    no_sync: list[Located] = field(default_factory=list)
    _last: cst.CSTNode | None = None

    def visit(self, node: cst.CSTNode, ancestors: Sequence[cst.CSTNode]) -> None:
        """Record `node` (several rules may feed one instance: a repeat is a no-op)."""
        if node is self._last:
            return
        self._last = node
        kind = type(node)  # exact types: isinstance against libcst's ABCs is slow
        if kind is cst.For or kind is cst.While:
            self.loops.append(Located(node, tuple(ancestors)))
        elif kind is cst.FunctionDef:
            self.functions.append(Located(node, tuple(ancestors)))
        elif kind is cst.Call:
            if is_exit_call(node):
                self.exits.append(Located(node, tuple(ancestors)))
        elif kind is cst.Break or kind is cst.Return:
            self.exits.append(Located(node, tuple(ancestors)))
        elif kind is cst.Attribute and node.attr.value in _NO_SYNC:
            self.no_sync.append(Located(node, tuple(ancestors)))

    def units_with_backward(self, tree: Tree, backwards: list[cst.Call]) -> list[Located]:
        """The innermost loop or function around each of the file's backward calls, once
        each, as the roles analysis finds them (`roles.backward_units`), with their
        ancestry."""
        units = {id(u.node): u for u in (*self.loops, *self.functions)}
        found = backward_units(tree, backwards)
        return [units[id(unit)] for unit in found if id(unit) in units]

    def no_sync_near(self, loop: Located) -> bool:
        """Whether `no_sync` is mentioned in the loop's class (for a method), its function,
        or anywhere (for a loop at module level)."""
        scope = loop.scope()
        return any(scope in mention.ancestors for mention in self.no_sync)


_NO_SYNC = {"no_sync", "require_backward_grad_sync"}
_LOOP_FACTS: weakref.WeakKeyDictionary[object, LoopFacts] = weakref.WeakKeyDictionary()


def loop_facts_for(context: object) -> LoopFacts:
    """One shared record per linted file (keyed by the engine's context)."""
    found = _LOOP_FACTS.get(context)
    if found is None:
        found = _LOOP_FACTS[context] = LoopFacts()
    return found


def collect_loops(module: cst.Module) -> LoopFacts:
    """Loop facts of `module` from a traversal of its own (outside the lint engine)."""
    facts, ancestors = LoopFacts(), []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        facts.visit(node, ancestors)

    walk(module, enter, lambda node: ancestors.pop())
    return facts


def iterated_names(loop: cst.For, tree: Tree) -> set[str]:
    """What a `for` loop iterates: every name of its iterable as written (`loader` of
    `enumerate(tqdm(loader))`, both of `zip(a, b)`), and what a progress bar kept in a
    variable wraps (`pbar = tqdm(val_loader)`; `for x in pbar`), as the roles analysis
    that migrate reads resolves it (`roles.iterated_name`)."""
    found = names_of(loop.iter)
    through = iterated_name(loop, tree)
    if through is not None:
        found.add(through)
    return found
