"""Pass 1, analyze: the script's shape, the plan the passes share, and the refusals.

Which objects are the model, the optimizer and the training loader is the shared
analysis's answer (`ddpify/analysis/roles.py`), re-asked on each pass's tree, so that
every pass and every rule agree on it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.batches import carried_state, model_calls
from ddpify.analysis.lazy_modules import lazy_wrap_points
from ddpify.analysis.loader_classes import chosen_training_loaders
from ddpify.analysis.model import FRAMEWORKS
from ddpify.analysis.names import dotted
from ddpify.analysis.reachability import in_imported_main_block
from ddpify.analysis.roles import (  # noqa: F401 - the passes import the roles from here too
    DATA_LOADER,
    DATA_PARALLEL,
    DDP,
    DIST_SAMPLER,
    ITER_WRAPPERS,
    Loader,
    _bindings,
    already_distributed,
    backward_calls,
    batch_assignments,
    bound_target,
    data_parallel_of_trained,
    dataloader_subclasses,
    hand_made_batches,
    iterated_source,
    lazily_built_models,
    loader_holding_classes,
    local_rank_arguments,
    model_names,
    optimizer_calls,
    optimizer_names,
    project_backward_calls,
    propagate,
    stream_batch,
    train_loaders,
    training_loops,
)
from ddpify.analysis.streams import is_sharded, training_stream
from ddpify.analysis.tree import Tree
from ddpify.analysis.unsplittable import (
    PulledBatch,
    drawing_loaders,
    pulled_batch,
    replication_blocker,
    step_shape,
    unsplittable_step,
)
from ddpify.migrate.report import Change, HumanItem

INIT_PG = "torch.distributed.init_process_group"
DESTROY_PG = "torch.distributed.destroy_process_group"
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")
SETUP_FUNCTION = "init_distributed"


class Shape(str, enum.Enum):
    SINGLE = "single-GPU"
    DATA_PARALLEL = "DataParallel"
    SPAWN = "mp.spawn DDP"
    LAUNCH = "torch.distributed.launch DDP"
    TORCHRUN = "torchrun DDP"
    FRAMEWORK = "framework"
    UNKNOWN = "not understood"

    @property
    def converts(self) -> bool:
        """Whether the migration adds the torchrun entry point (all but already-torchrun)."""
        return self in (Shape.SINGLE, Shape.DATA_PARALLEL, Shape.SPAWN, Shape.LAUNCH)


class NotMigrated(Exception):
    def __init__(self, shape: Shape, reason: str) -> None:
        super().__init__(reason)
        self.shape = shape
        self.reason = reason


@dataclass
class Options:
    batch_policy: str = "per-rank"  # or "global"
    lr_scaling: str | None = None  # linear | sqrt | none; None: by optimizer
    amp: str = "auto"  # auto | bf16 | fp16 | off
    sync_bn: bool = True
    # Local modules whose every class is a DataLoader of one project base (analysis/
    # loader_classes.py): a loader `getattr(module, config[...])(...)` makes is sharded in
    # that base. Filled by migrate/project.py, which reads every module of the project.
    loader_modules: dict = field(default_factory=dict)


@dataclass
class Plan:
    """What the passes share: the shape, the options, the names to use, the record."""

    shape: Shape
    options: Options
    dist: str = "dist"
    ddp: str = "DDP"
    sampler: str = "DistributedSampler"
    rank: str = "RANK"
    spawn_rank_param: str | None = None  # the mp.spawn worker's first parameter
    spawn_function: str | None = None
    changes: list[Change] = field(default_factory=list)
    human: list[HumanItem] = field(default_factory=list)
    lr_scaling: str = "none"
    lr_rule: str | None = None
    amp_added: bool = False
    amp_existing: bool = False
    needs: set[str] = field(default_factory=set)  # imports the passes used: os, dist, ...
    hand_made: str | None = None  # how hand-made batches were sharded, for the report
    replicated: str | None = None  # why and how steps run whole on every rank, for the report
    entry: bool = True  # the script that starts the run (not a module it imports)
    # names whose uses a pass rewrote away (`WeightedRandomSampler`): the imports pass drops
    # their import once nothing uses them, never an import the user had left unused
    replaced_names: set[str] = field(default_factory=set)
    # (why, anchor) of each item in `human`: a repeated item is dropped in one lookup, not a
    # scan of every item so far (a large script asks thousands of times)
    _human_keys: set[tuple[str, str | None]] = field(default_factory=set, repr=False)

    def change(self, pass_name: str, description: str, anchor: str | None, code=None) -> None:
        self.changes.append(Change(pass_name, description, code, _first_line(anchor)))

    def needs_human(self, why: str, anchor: str | None) -> None:
        item = HumanItem(why, _first_line(anchor))
        if (item.why, item.anchor) in self._human_keys:
            return
        self._human_keys.add((item.why, item.anchor))
        self.human.append(item)


def _first_line(text: str | None) -> str | None:
    if text is None:
        return None
    for line in text.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    return None


# -- shape ------------------------------------------------------------------------------


def detect_shape(tree: Tree) -> tuple[Shape, str | None]:
    """The shape of a script, or of a project when `tree` is its entry (every module of
    the project counts: a Trainer module that calls mp.spawn makes a spawn project)."""
    trees = tree.trees
    for module, label in FRAMEWORKS.items():
        if any(t.imports.imports_any(module) for t in trees):
            return Shape.FRAMEWORK, (
                f"the script uses {label}, which launches processes, shards data and "
                "guards rank-0 I/O itself; launch it the way it documents"
            )
    if not any(t.imports.imports_any("torch") for t in trees):
        return Shape.UNKNOWN, "the script does not import torch"
    if tree.view.calls_to(*SPAWN):
        return Shape.SPAWN, None
    if any(local_rank_arguments(t) for t in trees):
        return Shape.LAUNCH, None
    if tree.view.calls_to(INIT_PG, DDP):
        return Shape.TORCHRUN, None
    if any(
        data_parallel_of_trained(t, call, t is tree)
        for t in trees
        for call in t.calls_to(DATA_PARALLEL)
        if not in_imported_main_block(tree.view, call)  # a demo the project never runs
    ):
        return Shape.DATA_PARALLEL, None
    return Shape.SINGLE, None


def aliases(tree: Tree, plan: Plan) -> None:
    plan.dist = tree.alias_for("torch.distributed") or "dist"
    plan.ddp = tree.alias_for(DDP) or "DDP"
    plan.sampler = tree.alias_for(DIST_SAMPLER) or "DistributedSampler"


# -- the analysis pass ------------------------------------------------------------------


def analyze(tree: Tree, options: Options) -> Plan:
    """The plan for one script; `analyze_project` for a project's modules."""
    return analyze_project([tree], options)[0]


def analyze_project(trees: list[Tree], options: Options) -> list[Plan]:
    """One plan per module (the entry script first), for the project as a whole: the
    training step, the model and the loaders may each live in another module."""
    entry = trees[0]
    shape, reason = detect_shape(entry)
    if reason is not None:
        raise NotMigrated(shape, reason)
    plans = []
    for index, tree in enumerate(trees):
        plan = Plan(shape, options, entry=index == 0)
        aliases(tree, plan)
        plans.append(plan)
    where = "in this file" if len(trees) == 1 else "in this script or the local modules it imports"
    if not project_backward_calls(entry):
        raise NotMigrated(
            Shape.UNKNOWN,
            f"no training step (`loss.backward()`) {where}" + (computed_imports(trees)),
        )
    if not model_names(entry):
        raise NotMigrated(
            Shape.UNKNOWN,
            "cannot tell which object is the model (no `optimizer(model.parameters())`)",
        )
    if shape.converts:
        _refuse_nested_torch_import(entry)
        _refuse_launcher_elsewhere(trees)
        _refuse_lazily_built(entry, shape)
        loaders, _ = train_loaders(entry)
        chosen = {id(c.loop) for c in chosen_training_loaders(entry, options.loader_modules)}
        unresolved = [
            loop for tree in trees for loop in train_loaders(tree)[1] if id(loop) not in chosen
        ]
        if not chosen or unresolved or loaders:  # else: sharded in the loaders' base class
            _refuse_unshardable(entry, loaders, unresolved)
    if shape is Shape.SPAWN:
        holder = next(index for index, tree in enumerate(trees) if tree.calls_to(*SPAWN))
        _spawn_worker(trees[holder], plans[holder])
    return plans


def computed_imports(trees: list[Tree], followed: Collection[str] = ()) -> str:
    """Where the project imports a module by a name computed at run time (a model chosen
    by an option: `importlib.import_module("models." + name + "_model")`): the step is
    probably in such a module, which ddpify does not follow (it never runs user code, and
    guessing which candidate the options select could migrate the wrong one). Those the
    project followed to its modules (their first lines in `followed`) are not named."""
    lines = []
    for tree in trees:
        for call in tree.calls_to("importlib.import_module", "builtins.__import__"):
            first = call.args[0].value if call.args else None
            written = _first_line(tree.code(tree.statement(call)))
            if first is not None and not isinstance(first, cst.SimpleString):
                if (written or "").strip() not in followed:
                    lines.append(f"`{written}`")
    if not lines:
        return ""
    return (
        f"; {' and '.join(lines)} import{'s' if len(lines) == 1 else ''} a module chosen at "
        "run time, which ddpify does not follow: import the module that trains explicitly "
        "(e.g. `from models.my_model import MyModel` in the entry script) and migrate again, "
        "or convert it by hand"
    )


def _refuse_lazily_built(tree: Tree, shape: Shape) -> None:
    """A model whose optimizer is made after a forward that may build its layers (a
    data-dependent initialisation, a dry run of lazy layers): DDP must wrap it after that
    forward, and the wrap pass puts it on a line of its own right before the optimizer's
    statement (analysis/lazy_modules.py). Where that statement leaves no such place (it
    shares its line with another), or where a DataParallel that becomes DDP wraps the
    model where it is built (the DataParallel shape: the wrap follows the DataParallel), a
    wrap there would leave the late layers out of DDP's gradient averaging: refuse, naming
    the line."""
    placed = shape is Shape.SINGLE
    lazy = [lazy for lazy, point in lazy_wrap_points(tree) if point is None or not placed]
    if not lazy:
        return  # each is wrapped right before its optimizer (wrap.py)
    first = lazy[0]
    view = tree.view
    optimizer = _first_line(view.code(view.statement(first.optimizer)))
    forward = view.code(first.forward)
    why = (
        f"`{optimizer}` shares its line with another statement"
        if placed
        else "the DataParallel that wraps it where it is built becomes DDP there"
    )
    raise NotMigrated(
        Shape.UNKNOWN,
        f"`{first.model}` gets its optimizer in `{first.method}` after a forward "
        f"(`{forward}`), which may build its layers, so DDP must wrap it after that forward, "
        f"just before the optimizer, and {why}: wrap it in DDP by hand in `{first.method}`, "
        f"after the forward and just before `{optimizer}` "
        f"(`{first.model} = DDP({first.model}, device_ids=[LOCAL_RANK] if "
        "torch.cuda.is_available() else None)`), and keep the code that builds it from "
        "wrapping it in DataParallel",
    )


def _refuse_nested_torch_import(tree: Tree) -> None:
    """The entry script imports torch only inside a function: the set-up ddpify adds at
    module level (RANK, init_distributed, DDP) would use names that do not exist there."""
    imports = tree.find((cst.Import, cst.ImportFrom), lambda node: _imports_torch(node))
    if not imports or any(tree.function(node) is None for node in imports):
        return
    line = _first_line(tree.code(tree.statement(imports[0])))
    raise NotMigrated(
        Shape.UNKNOWN,
        f"torch is imported only inside a function (`{line}`), and the process-group "
        "set-up ddpify adds runs at module level: import torch at the top of the file and "
        "migrate again",
    )


def _imports_torch(node: cst.Import | cst.ImportFrom) -> bool:
    if isinstance(node, cst.ImportFrom):
        module = dotted(node.module) if node.module is not None and not node.relative else ""
        return (module or "").split(".")[0] == "torch"
    return any((dotted(alias.name) or "").split(".")[0] == "torch" for alias in node.names)


def _refuse_launcher_elsewhere(trees: list[Tree]) -> None:
    """Process-group set-up is rewritten in the entry script only; set-up in a helper
    module (`utils.init_distributed_mode(args)`) is left to a human."""
    for tree in trees[1:]:
        calls = tree.calls_to(INIT_PG, *SPAWN)
        if calls:
            line = _first_line(tree.code(tree.statement(calls[0])))
            raise NotMigrated(
                Shape.UNKNOWN,
                f"the process group is set up in an imported module (`{line}`); ddpify "
                "rewrites the set-up in the entry script only: move it there (or remove it "
                "and migrate again)",
            )


def _refuse_unshardable(tree: Tree, loaders: list[Loader], unresolved: list[cst.For]) -> None:
    if not loaders and not unresolved:
        raise NotMigrated(
            Shape.UNKNOWN,
            "cannot find the loop that feeds the training step; without it the data cannot be "
            "sharded, and every rank would train on the same batches",
        )
    # A loop whose own function handles a DistributedSampler (a library's DDP-aware trainer
    # that the project imports) is left as it is, but only beside a loop ddpify does shard:
    # alone, it may be the one that trains, on a loader built without that sampler.
    models = model_names(tree)
    fed = bool(loaders) or any(
        stream_batch(tree, loop) or batch_assignments(loop, models)
        for loop in unresolved
        if not already_distributed(tree, loop)
    )
    for loop in unresolved:
        if not (fed and already_distributed(tree, loop)):
            _refuse_unsplittable_batches(tree, loop)
    for loader in loaders:
        _refuse_unshardable_stream(tree, loader)


def _refuse_unshardable_stream(tree: Tree, loader: Loader) -> None:
    """A training loader over an IterableDataset of the project is sharded inside the
    class (migrate/streams.py) when the dataset has a name to switch on and a class of
    the project yields its items."""
    stream = training_stream(tree, loader)
    if stream is None or stream.evaluation or is_sharded(stream):
        return
    if not stream.dataset:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"the training loader `{_first_line(tree.view.code(loader.call))}` reads an "
            f"IterableDataset ({stream.created}), which takes no sampler; bind the dataset "
            "to a name first (`train_ds = ...`, then `DataLoader(train_ds, ...)`) and ddpify "
            "shards it by rank",
        )
    if stream.iter_method is None:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"the training data `{stream.dataset}` is an IterableDataset ({stream.created}) "
            "whose `__iter__` is not defined in this project; every rank would read the same "
            "stream; shard it by rank in `__iter__`",
        )


def _refuse_unsplittable_batches(tree: Tree, loop: cst.For) -> None:
    """A loop without a DataLoader is migrated when its batch enters the step at an
    assignment in the loop (sharded there by rank), or when the analysis proves its step
    keeps the batch whole and draws from no loader (full batch, one example, carried
    state: replicated on every rank, migrate/replicate.py); otherwise it is refused with
    what it takes its batch from."""
    line = tree.view.code(loop).strip().splitlines()[0]
    models = model_names(tree)
    if stream_batch(tree, loop) is not None:
        _refuse_carried_state(loop, models, line)
        return
    batches = batch_assignments(loop, models)
    calls = model_calls(loop, models)
    inline = [c for c in calls if any(isinstance(a.value, cst.Subscript) for a in c.args)]
    if not batches and inline:
        call = tree.view.code(inline[0])
        raise NotMigrated(
            Shape.UNKNOWN,
            f"hand-made batches sliced inside the call `{call}` (in `{line}`): bind the batch to "
            "a name in the loop first (`xb = x[i:i + bs]`, then `model(xb)`), and ddpify splits "
            "it by rank there",
        )
    if not batches and isinstance(loop, cst.For):
        _refuse_unknown_iterable(tree, loop, line)
    if unsplittable_step(tree, loop, models) is not None:
        return  # every rank computes the whole step (migrate/replicate.py)
    pulled = pulled_batch(tree, loop)
    if pulled is not None and not batches:
        _refuse_pulled_batch(tree, line, pulled)
    _refuse_unproven_replication(tree, loop, models, line)
    if not batches:
        forward = _first_line(tree.view.code(tree.view.statement(calls[0]))) if calls else None
        where = f"`{forward}` in the loop `{line}`" if forward else f"the loop `{line}`"
        raise NotMigrated(
            Shape.UNKNOWN,
            f"cannot tell where the batch enters the step of {where}: the model is not called "
            "there with a batch bound in the loop, nor only with tensors built before it; "
            "bind the batch to a name in the loop (`xb, yb = get_batch()`, then `model(xb)`) "
            "and ddpify splits it by rank there",
        )


def _refuse_unproven_replication(tree: Tree, loop: cst.For, models: set[str], line: str) -> None:
    """A step that keeps its batch whole would run whole on every rank, but only where
    nothing shows it may draw from a loader: here something does."""
    step = step_shape(tree, loop, models)
    blocker = replication_blocker(tree, loop)
    if step is None or blocker is None:
        return
    stmt = _first_line(tree.view.code(step.statement))
    what = _first_line(tree.view.code(tree.view.statement(blocker) or blocker))
    raise NotMigrated(
        Shape.UNKNOWN,
        f"the step of `{line}` keeps its batch whole ({step.kind}: `{stmt}`), which ddpify "
        f"runs whole on every rank only when the step provably draws from no loader, and "
        f"`{what}` may feed it; split the data by rank yourself where it is built, or feed "
        "the step from a DataLoader ddpify can shard",
    )


# `indices[RANK::WORLD_SIZE]` gives the first len(indices) % WORLD_SIZE ranks one item more.
UNEQUAL_SHARES = (
    "when the count does not divide by WORLD_SIZE, that gives the ranks unequal shares: DDP "
    "then averages the gradients of unequal batches (no longer the original's mean) and the "
    "ranks may take different numbers of steps, so one waits forever in an all-reduce the "
    "others never reach; drop the remainder first (`indices = indices[: len(indices) // "
    "WORLD_SIZE * WORLD_SIZE]`) or pad with repeats to a multiple of WORLD_SIZE, as "
    "DistributedSampler does"
)


def _refuse_pulled_batch(tree: Tree, line: str, pulled: PulledBatch) -> None:
    """`inputs = next(fetcher)` each step from something ddpify cannot trace to a
    DataLoader it can shard: name the pull, what made the iterator, and the project's
    loaders whose own sampler a DistributedSampler would replace."""
    stmt = _first_line(tree.view.code(pulled.statement))
    made = ""
    values = _bindings(tree).get(pulled.source or "", [])
    if len(values) == 1:
        made = f" (`{pulled.source} = {_first_line(tree.view.code(values[0]))}`)"
    where = "the code that builds the training loaders"
    drawing = drawing_loaders(tree)
    if drawing:
        first = drawing[0]
        builder = f" in `{first.function}`" if first.function else ""
        sampler = _first_line(tree.view.code(first.sampler))
        where = (
            f"the DataLoader{builder}, which draws with `{sampler}` ({first.kind}): a "
            "DistributedSampler would replace that draw, so keep it and give each rank its "
            "share (draw the indices with a generator seeded alike on every rank and the "
            f"epoch, then keep `indices[RANK::WORLD_SIZE]`; {UNEQUAL_SHARES})"
        )
    raise NotMigrated(
        Shape.UNKNOWN,
        f"the training loop `{line}` takes its batch each step with `{stmt}`{made}, which "
        "ddpify cannot trace to a DataLoader it can shard, so every rank would train on the "
        f"same batches; shard the data by rank in {where}, then run under torchrun",
    )


def _refuse_carried_state(loop: cst.CSTNode, models: set[str], line: str) -> None:
    state = carried_state(loop, models)
    if state:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"the loop `{line}` builds its batches by hand and carries `{state[0]}` from step to "
            "step (recurrent state sized by the batch); splitting the batch by rank would need "
            "the same split of that state; shard the data by rank where it is built "
            "(each rank its own rows) and size the state per rank",
        )


def _refuse_unknown_iterable(tree: Tree, loop: cst.For, line: str) -> None:
    """The loop takes its batches from what it iterates (the loop target), and that is
    neither a DataLoader ddpify can find nor a batch stream it can split."""
    source = iterated_source(tree, loop)
    if source is None:
        return  # `for step in range(n)`: the batches do not come from the loop target
    made = ""
    if source.made_by is not None:
        made = f", made by `{tree.view.code(source.made_by)}`"
        if source.class_chosen_at_run_time:
            made += " (its class is chosen at run time)"
    where = _where_to_shard(tree)
    raise NotMigrated(
        Shape.UNKNOWN,
        f"the training loop `{line}` iterates `{source.name}`{made}, which ddpify does not "
        "recognise as a DataLoader or as a stream of batches it can split, so every rank "
        f"would train on the same batches; shard it yourself: a DistributedSampler in {where}, "
        "`sampler.set_epoch(epoch)` at the top of each epoch, then run under torchrun",
    )


def _where_to_shard(tree: Tree) -> str:
    """The project's DataLoader subclasses, when it has some: their constructors hand a
    sampler to DataLoader, which is where a DistributedSampler goes."""
    holders = loader_holding_classes(tree)
    if holders:
        name, call = holders[0]
        built = _first_line(tree.view.code(tree.view.statement(call)))
        return (
            f"the DataLoader that `{name}` builds (`{built}`), whose batches its `__iter__` "
            "hands out (ddpify does not follow a loop through such a class yet)"
        )
    subclasses = dataloader_subclasses(tree)
    if not subclasses:
        return "the code that builds the loader"
    named = []
    for root, derived in subclasses.items():
        shown = ", ".join(f"`{name}`" for name in derived[:4])
        more = ", ..." if len(derived) > 4 else ""
        named.append(f"`{root}`" + (f" (the base of {shown}{more})" if derived else ""))
    plural = "es" if len(named) > 1 else ""
    return (
        f"the project's DataLoader subclass{plural} {' and '.join(named)}, where it hands "
        "its sampler to DataLoader (when none is set, and for the training loader only)"
    )


def _spawn_worker(tree: Tree, plan: Plan) -> None:
    call = tree.calls_to(*SPAWN)[0]
    worker = dotted(call.args[0].value) if call.args else None
    func = tree.functions().get(worker or "")
    if func is None or not func.params.params:
        raise NotMigrated(
            Shape.SPAWN, "mp.spawn starts a worker this script does not define; cannot rewrite it"
        )
    plan.spawn_function = func.name.value
    plan.spawn_rank_param = func.params.params[0].name.value
