"""Pass 5, data: shard the training data, reshuffle per epoch, batch size and LR, loads.

The training loader gets `sampler=DistributedSampler(dataset, shuffle=<its shuffle>)`,
and `loader.sampler.set_epoch(epoch)` opens each epoch. With `--batch-policy per-rank`
the global batch grows with WORLD_SIZE and the learning rate is scaled on a visible,
commented line; with `global` each process takes batch // WORLD_SIZE and the learning
rate stays. `torch.load` gets `map_location="cpu"`.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.batch_coupling import (
    batch_comparisons,
    masked_mean_losses,
    setting_sized_tensors,
)
from ddpify.analysis.endless import PassRestart, pass_restarts
from ddpify.analysis.epochs import epoch_loops, names_an_epoch_reads
from ddpify.analysis.fetchers import fetcher_restarts
from ddpify.analysis.loader_classes import chosen_training_loaders
from ddpify.analysis.loader_helpers import helper_results
from ddpify.analysis.loaders import LOADER_PARAMETERS
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.roles import (
    bundled_results,
    distributed_sampler_value,
    iterated_name,
    project_has_hand_made_batches,
    stream_batches,
    training_loop_sources,
    training_loops,
)
from ddpify.analysis.seeding import (
    ALIKE,
    CONDITIONAL,
    STREAM_ADVICE,
    drawn_streams,
    stream_seeding,
)
from ddpify.analysis.streams import training_stream
from ddpify.analysis.tree import Tree, names_in
from ddpify.arguments import replace_with_keyword
from ddpify.migrate import snippets
from ddpify.migrate.analyze import (
    DATA_LOADER,
    Loader,
    NotMigrated,
    Plan,
    Shape,
    bound_target,
    hand_made_batches,
    optimizer_calls,
    train_loaders,
)
from ddpify.migrate.args import append_arg, keyword, parenthesize
from ddpify.migrate.edits import Edits
from ddpify.migrate.held_loaders import reshuffle_held_loaders
from ddpify.migrate.loader_classes import shard_loader_classes
from ddpify.migrate.replicate import project_replicates, replicate
from ddpify.migrate.streams import shard_streams, stream_of, unsharded_stream_note
from ddpify.migrate.weighted import converted_sampler, shard_weighted, weighted_loader

NAME = "data"
ADAPTIVE = {
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "SparseAdam",
    "Adafactor",
}
SGD_LIKE = {"SGD", "ASGD"}
LR_RULES = {
    "linear": ("linear LR scaling (Goyal et al. 2017)", "{lr} * WORLD_SIZE"),
    "sqrt": ("square-root LR scaling (Malladi et al. 2022)", "{lr} * WORLD_SIZE**0.5"),
}
# Schedulers that set the learning rate to a value of their own, and its argument.
ABSOLUTE_LR_SCHEDULERS = {"OneCycleLR": "max_lr", "CyclicLR": "max_lr", "SWALR": "swa_lr"}
GLOBAL_NOTE = "# ddpify: batch policy global: batch_size // WORLD_SIZE per process, LR unchanged"


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    loaders, _ = train_loaders(tree)
    # In a project the loader may be built in another module: it is sharded there, and
    # this module's epoch loop calls set_epoch on it.
    built_here = [loader for loader in loaders if tree.owns(loader.call)]
    # A loader over an IterableDataset is sharded inside the dataset's class: no sampler,
    # so no set_epoch either.
    if plan.shape.converts:
        streams = shard_streams(tree, plan, edits, loaders)
    else:
        streams = {id(loader.call) for loader in loaders if training_stream(tree, loader)}
    for loader in built_here:
        if id(loader.call) not in streams:
            _shard(tree, plan, edits, loader)
    if plan.shape.converts:
        # A loader whose class the configuration chooses: sharded in the project's base.
        shard_loader_classes(tree, plan, edits)
    if plan.shape.converts:
        _note_unsharded(tree, plan, loaders)
        _note_sharded_evaluation(tree, plan, loaders)
        hand_made = _shard_hand_made(tree, plan, edits) or _project_hand_made(tree, plan)
        # A step replicated on every rank keeps the original's global batch too.
        hand_made = replicate(tree, plan, edits) or project_replicates(tree) or hand_made
        if hand_made and not loaders:
            plan.lr_scaling = "none"  # the global batch is the original's: same LR
        else:
            _batch_and_lr(tree, plan, edits, built_here)
    # A class that holds the training DataLoader: set_epoch through it.
    held = reshuffle_held_loaders(tree, plan, edits) if plan.shape.converts else set()
    sampled = [loader for loader in loaders if id(loader.call) not in streams | held]
    placed = _set_epoch(tree, plan, edits, sampled)
    if plan.shape.converts:
        unplaced = [x for x in sampled if id(x.call) not in placed]
        per_pass = _set_epoch_per_pass(tree, plan, edits, unplaced)
        unplaced = [x for x in unplaced if tree.owns(x.call) and id(x.call) not in per_pass]
        _note_step_loop_order(tree, plan, unplaced)
    if plan.shape.converts:
        _note_adaptive_solvers(tree, plan)
        if not project_replicates(tree):
            _note_batch_comparisons(tree, plan)
            _note_masked_means(tree, plan)
    _map_location(tree, plan, edits)
    return edits


def _note_batch_comparisons(tree: Tree, plan: Plan) -> None:
    """A contrastive loss compares every sample of the batch with every other: split by
    rank, each rank compares only its own samples (analysis/batch_coupling.py)."""
    for node in batch_comparisons(tree):
        function = tree.function(node)
        plan.needs_human(
            f"`{tree.code(node)}` in `{function.name.value}` compares every row with every "
            "other: where those rows are the samples of the batch (a contrastive loss), each "
            "rank now compares only the samples of its own batch, not the whole batch; to "
            "compare across ranks, gather the features first (`torch.distributed.nn."
            "all_gather`, which keeps their gradients) and concatenate them",
            tree.code(tree.statement(node)),
        )


def _note_masked_means(tree: Tree, plan: Plan) -> None:
    """A mean over the targets not ignored: each rank now divides by its own count
    (analysis/batch_coupling.py)."""
    for call in masked_mean_losses(tree):
        plan.needs_human(
            f"`{tree.code(call.func)}(..., ignore_index=...)` averages over the targets it does "
            "not ignore: each rank now divides by its own count and DDP averages those means, "
            "so where the ranks count different numbers of targets the step differs from the "
            "original's mean over the whole batch; to match it, sum the loss "
            "(reduction='sum') and divide by the count all-reduced across ranks",
            tree.code(tree.statement(call)),
        )


ODE_SOLVERS = ("torchdiffeq.odeint", "torchdiffeq.odeint_adjoint")
FIXED_STEP_METHODS = {"euler", "midpoint", "rk4", "explicit_adams", "implicit_adams"}


def _note_adaptive_solvers(tree: Tree, plan: Plan) -> None:
    """An adaptive ODE solver sizes its steps from an error norm over the whole batch it
    is given: with the batch split across ranks each rank takes its own steps."""
    for call in tree.calls_to(*ODE_SOLVERS):
        method = find_arg(call, "method")
        if method is not None and isinstance(method.value, cst.SimpleString):
            if method.value.evaluated_value in FIXED_STEP_METHODS:
                continue
        plan.needs_human(
            "an adaptive-step ODE solver chooses its step sizes from an error norm over the "
            "batch it is given: each rank now integrates its own part of the batch with "
            "its own steps, so results agree with the original's only within the solver "
            "tolerance (rtol/atol); a fixed-step method (method='rk4') matches exactly",
            tree.code(tree.statement(call)),
        )


# -- samplers ---------------------------------------------------------------------------


def _shard(tree: Tree, plan: Plan, edits: Edits, loader: Loader) -> None:
    call = loader.call
    sampler = find_arg(call, "sampler", 3)
    batch_sampler = find_arg(call, "batch_sampler")
    if sampler is not None or batch_sampler is not None:
        given = sampler or batch_sampler
        if sampler is not None and _shard_none_sampler(tree, plan, edits, call, sampler):
            return
        if sampler is not None and converted_sampler(tree, sampler.value):
            return  # migrated before: the weighted draw is shared out by rank
        weighted = weighted_loader(tree, loader) if plan.shape.converts else None
        if weighted is not None:
            shard_weighted(tree, plan, edits, weighted)
            return
        if distributed_sampler_value(tree, given.value) is None:  # type: ignore[union-attr]
            if plan.shape.converts:
                raise NotMigrated(
                    Shape.UNKNOWN,
                    f"the training loader uses its own sampler `{tree.code(given.value)}`; "  # type: ignore[union-attr]
                    "shard it by rank (or wrap it in a DistributedSampler) first",
                )
            plan.needs_human(
                "custom sampler: make sure it shards the data by rank", tree.code(call)
            )
        return
    dataset = find_arg(call, "dataset", 0)
    if dataset is None:
        return
    shuffle = find_arg(call, "shuffle", 2)
    if (
        shuffle is not None
        and replace_with_keyword(call, shuffle, shuffle, LOADER_PARAMETERS) is None
    ):
        # `*args` after a positional shuffle: its slots cannot be given by keyword.
        plan.needs_human("add a DistributedSampler to this loader", tree.code(call))
        return
    statement = tree.statement(call)
    data_code = tree.code(dataset.value)
    if dotted(dataset.value) is None:
        data_code = _hoist_dataset(tree, plan, edits, loader, dataset, statement)
    shuffle_code = tree.code(shuffle.value) if shuffle is not None else "False"
    plan.needs.add("sampler")
    new_arg = keyword(
        "sampler", snippets.expression(f"{plan.sampler}({data_code}, shuffle={shuffle_code})")
    )

    def add_sampler(updated: cst.Call) -> cst.Call:
        old = find_arg(updated, "shuffle", 2)
        if old is not None:
            return replace_with_keyword(updated, old, new_arg, LOADER_PARAMETERS) or updated
        return append_arg(updated, new_arg)

    edits.replace(call, add_sampler)
    moved = " (its shuffle moved into the sampler)" if shuffle is not None else ""
    plan.change(
        NAME,
        f"the training loader draws its shard through a DistributedSampler{moved}",
        f"sampler={plan.sampler}(",
        "DDP020",
    )


def _shard_none_sampler(tree: Tree, plan: Plan, edits: Edits, call: cst.Call, sampler) -> bool:
    """`train_sampler = None` then `DataLoader(ds, shuffle=(train_sampler is None),
    sampler=train_sampler)`: the slot a distributed script fills with a DistributedSampler;
    fill it (the shuffle test then turns the loader's own shuffle off)."""
    name = dotted(sampler.value)
    dataset = find_arg(call, "dataset", 0)
    data = dotted(dataset.value) if dataset is not None else None
    if name is None or "." in name or data is None:
        return False
    bindings = [
        a for a in tree.find(cst.Assign) if any(dotted(t.target) == name for t in a.targets)
    ]
    if len(bindings) != 1 or not _is_none(bindings[0].value):
        return False
    binding = bindings[0]
    if tree.scope(binding) is not tree.scope(call) or tree.after(binding, call):
        return False
    shuffle = find_arg(call, "shuffle", 2)
    if shuffle is not None and _none_test_of(shuffle.value) != name:
        return False  # `shuffle=True` next to a sampler would raise: leave it to a human
    plan.needs.add("sampler")
    new = snippets.expression(f"{plan.sampler}({data}, shuffle=True)")
    edits.replace(binding.value, new)
    plan.change(
        NAME,
        f"the training loader's empty sampler slot `{name}` gets a DistributedSampler "
        "(shuffling, as the loader did without one)",
        f"{name} = {plan.sampler}(",
        "DDP020",
    )
    return True


def _is_none(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "None"


def _none_test_of(expr: cst.BaseExpression) -> str | None:
    """`x` in `(x is None)`."""
    if (
        isinstance(expr, cst.Comparison)
        and len(expr.comparisons) == 1
        and isinstance(expr.comparisons[0].operator, cst.Is)
        and _is_none(expr.comparisons[0].comparator)
    ):
        return dotted(expr.left)
    return None


def _hoist_dataset(tree, plan, edits, loader, dataset, statement) -> str:
    """`DataLoader(TensorDataset(x, y), ...)`: the sampler needs the same dataset object."""
    name = _dataset_name(tree, loader)
    edits.before[statement].append(snippets.statement(f"{name} = {tree.code(dataset.value)}"))
    edits.replace(dataset.value, snippets.expression(name))
    plan.change(NAME, "named the training dataset so the sampler and loader share it", f"{name} = ")
    return name


def _dataset_name(tree: Tree, loader: Loader) -> str:
    """A name for the loader's dataset where the loader is built: `train_dataset` beside
    `train_loader = DataLoader(...)` (`self.train_dataset` beside `self.train_loader`). A
    helper that returns the loader (`return DataLoader(...)`, kept by its callers in
    `self.train_loader`) gets a local name, never a caller's `self.` attribute, which the
    helper cannot reach, nor a name the helper already uses; `dataset` when it builds the
    evaluation loaders too."""
    bound = bound_target(tree, loader.call)
    target = bound or next(iter(sorted(loader.names)), "train")
    prefix = target.rsplit(".", 1)[-1].replace("loader", "").replace("dl", "")
    if prefix.rstrip("_").endswith(("dataset", "data")) and not _uses_name(tree, "train_dataset"):
        prefix = "train_"  # a loader kept as `dataset` (`dataset = create_dataset(opt)`)
    name = f"{prefix}dataset" if prefix.endswith("_") else f"{prefix or 'train_'}dataset"
    if bound is not None:
        return f"{target.rsplit('.', 1)[0]}.{name}" if "." in target else name
    func = tree.view.function(loader.call)
    taken = names_in(func) if func is not None else set()
    if any(kept not in loader.names for _, kept in helper_results(tree, loader.call)):
        taken.add(name)  # the helper builds evaluation loaders too: not `train_dataset`
    return next(n for n in (name, "dataset", "loader_dataset") if n not in taken)


def _uses_name(tree: Tree, name: str) -> bool:
    """Whether the module already names `name` anywhere (a new binding must not clash)."""
    return any(node.value == name for node in tree.find(cst.Name))


def _note_unsharded(tree: Tree, plan: Plan, loaders: list[Loader]) -> None:
    train = {id(loader.call) for loader in loaders}
    for call in tree.calls_to(DATA_LOADER):
        if id(call) in train or find_arg(call, "sampler", 3) is not None:
            continue
        stream = stream_of(tree, call)
        if stream is not None:
            plan.needs_human(unsharded_stream_note(stream), tree.code(tree.statement(call)))
            continue
        plan.needs_human(
            "this loader is not sharded: every rank runs all of it (right metrics, N-fold "
            "work); to split it, add DistributedSampler(..., shuffle=False) and all-reduce the "
            "metrics, minding the padding it adds (DDP025, DDP054)",
            tree.code(tree.statement(call)),
        )


def _note_sharded_evaluation(tree: Tree, plan: Plan, loaders: list[Loader]) -> None:
    """A loader helper (`data_provider(args, flag)`) that builds the training loader builds
    the evaluation loaders too: the sampler added inside it shards those as well. Say so
    where this module keeps such a loader."""
    trained = training_loop_sources(tree)
    for loader in loaders:
        if not _gets_a_sampler(tree, loader.call):
            continue
        sites = helper_results(tree, loader.call)
        # `loaders = Munch(train=get_loader(..), val=get_loader(..))`: the bundle's names.
        sites += bundled_results(tree, loader.call)
        trained |= loader.names
        if not any(name in trained for _, name in sites):
            continue  # no call site keeps the training loader: the helper is not understood
        helper = tree.view.function(loader.call).name.value  # type: ignore[union-attr]
        for site, name in sites:
            if name in trained or not tree.owns(site):
                continue
            plan.needs_human(
                f"`{name}` comes from `{helper}`, which also builds the training loader: the "
                "DistributedSampler added there shards this loader too, so where it evaluates, "
                "each rank sees only its share of the data (padded with repeats) and its "
                "metrics, early stopping and saved results are that rank's alone; build it "
                "without the sampler, or all-reduce the metrics (DDP025, DDP054)",
                tree.code(tree.statement(site)),
            )


def _gets_a_sampler(tree: Tree, call: cst.Call) -> bool:
    """Whether `_shard` adds a DistributedSampler to this DataLoader: it has no sampler of
    its own (none, or the empty `sampler=None` slot)."""
    if find_arg(call, "batch_sampler") is not None:
        return False
    sampler = find_arg(call, "sampler", 3)
    if sampler is None:
        return True
    name = dotted(sampler.value)
    return name is not None and any(
        _is_none(assign.value)
        for assign in tree.view.within(tree.view.function(call) or call, cst.Assign)
        if any(dotted(t.target) == name for t in assign.targets)
    )


# -- hand-made batches -----------------------------------------------------------------

HAND_MADE_NOTE = "# ddpify: batch policy global: each rank its rows of the batch, LR unchanged"


def _block(name: str, rank: str) -> str:
    return f"{name}[{rank} * len({name}) // WORLD_SIZE : ({rank} + 1) * len({name}) // WORLD_SIZE]"


def _hand_made_here(tree: Tree, plan: Plan) -> list:
    """This module's hand-made batches, but for those of loops over a loader whose class
    the configuration chooses (`data, target = data.to(device)`): that loader is sharded
    in its base class (migrate/loader_classes.py), so its batches are each rank's already."""
    chosen = chosen_training_loaders(tree, plan.options.loader_modules)
    return [
        batch
        for batch in hand_made_batches(tree)
        if not any(tree.view.inside(batch.statement, c.loop) for c in chosen)
    ]


def _project_hand_made(tree: Tree, plan: Plan) -> bool:
    """`project_has_hand_made_batches`, without the batches of loops over a loader whose
    class the configuration chooses (see `_hand_made_here`)."""
    if not plan.options.loader_modules:
        return project_has_hand_made_batches(tree)
    trees = tree.trees
    return any(_hand_made_here(t, plan) or stream_batches(t) for t in trees)


def _shard_hand_made(tree: Tree, plan: Plan, edits: Edits) -> bool:
    """Split each hand-made batch by rank right where it enters the step, so the ranks
    together train on exactly the original's batch (same global batch, same LR)."""
    batches = _hand_made_here(tree, plan)
    for batch in batches:
        # Contiguous blocks, not `x[RANK::WORLD_SIZE]`: a strided slice is not contiguous,
        # and scripts call `.view()` on their batches.
        lines = [snippets.statement(f"{n} = {_block(n, plan.rank)}\n") for n in batch.names]
        lines[0] = snippets.with_comment(lines[0], HAND_MADE_NOTE)
        edits.after[batch.statement].extend(lines)
        first = f"{batch.names[0]} = {_block(batch.names[0], plan.rank)}"
        plan.change(NAME, f"hand-made batch split by rank: {', '.join(batch.names)}", first)
    streams = stream_batches(tree)
    for stream in streams:
        # The batch enters the step at the loop target: split it first thing in the body.
        lines = [snippets.statement(f"{n} = {_block(n, plan.rank)}\n") for n in stream.names]
        lines[0] = snippets.with_comment(lines[0], HAND_MADE_NOTE)
        edits.prepend[stream.loop].extend(lines)
        first = f"{stream.names[0]} = {_block(stream.names[0], plan.rank)}"
        plan.change(
            NAME,
            f"each batch of the `{stream.maker}` stream split by rank where the loop takes it: "
            f"{', '.join(stream.names)}",
            first,
        )
    if batches or streams:
        _note_unseeded_draws(tree, plan, first)
        plan.hand_made = (
            "hand-made batches are split across ranks (each rank one contiguous block of rows of "
            "each batch): the global batch and the learning rate are the original's; the step "
            "is the same when the batch size divides by the number of processes and the ranks "
            "draw the same batch (same seed); when it does not divide, the blocks differ by one "
            "row and DDP's plain average of the ranks' gradients weighs the rows of the smaller "
            "blocks a little more, and a batch smaller than the number of processes leaves some "
            "rank an empty block"
        )
    return bool(batches or streams)


def _note_unseeded_draws(tree: Tree, plan: Plan, split: str) -> None:
    """Each rank takes its block of the batch it draws itself: the blocks make up the
    original's batch only when every rank draws the same one, from torch seeded alike."""
    # The streams the script draws from by name (`np.random.choice`); torch when none is
    # seen (a `torch.randperm` in a helper module, a library's own draw).
    streams = drawn_streams(tree.view) or ["torch"]
    unseeded = [(s, stream_seeding(tree.view, s)) for s in streams]
    unseeded = [(s, seeding) for s, seeding in unseeded if seeding.kind != ALIKE]
    if not unseeded:
        return
    never = [stream for stream, seeding in unseeded if seeding.kind != CONDITIONAL]
    reasons = [
        f"{stream} is seeded only when `{seeding.condition}` holds"
        for stream, seeding in unseeded
        if seeding.kind == CONDITIONAL
    ]
    if never:
        reasons.insert(0, f"the script does not seed {' or '.join(never)}")
    why = " and ".join(reasons)
    names = " and ".join(stream for stream, _ in unseeded)
    calls = ", ".join(f"`{STREAM_ADVICE[stream]}`" for stream, _ in unseeded)
    plan.needs_human(
        f"each rank keeps its block of the batch it draws, which is the original's batch only "
        f"when every rank draws the same one, and {why}: without a seed each rank draws its "
        "own batch, so the step trains on blocks of different random batches (the same "
        f"number of rows, not the original's batch); seed {names} alike on every rank before "
        f"the batches are drawn ({calls}) to keep the step exact",
        split,
    )


# -- batch size and learning rate -------------------------------------------------------


def _batch_and_lr(tree: Tree, plan: Plan, edits: Edits, loaders: list[Loader]) -> None:
    if plan.options.batch_policy == "global":
        for loader in loaders:
            size = find_arg(loader.call, "batch_size", 1)
            if size is None:
                continue
            new = snippets.expression(f"{tree.code(parenthesize(size.value))} // WORLD_SIZE")
            edits.replace(size.value, new)
            statement = tree.statement(loader.call)
            edits.replace(statement, lambda updated: snippets.with_comment(updated, GLOBAL_NOTE))
            plan.change(
                NAME,
                "per-process batch = the original batch // WORLD_SIZE (--batch-policy global)",
                "// WORLD_SIZE",
                "DDP026",
            )
        _per_process_sizes(tree, plan, edits)
        plan.lr_scaling = "none"
        return
    if plan.shape not in (Shape.SINGLE, Shape.DATA_PARALLEL):
        return  # already DDP: the batch was per process before
    for call in optimizer_calls(tree):
        _scale_lr(tree, plan, edits, call)
    if plan.lr_scaling in LR_RULES:
        _scale_hand_set_lr(tree, plan, edits)
    for call in tree.find(cst.Call):
        name = tree.qualify(call.func) or ""
        short = name.rsplit(".", 1)[-1]
        if short in ABSOLUTE_LR_SCHEDULERS and plan.lr_scaling != "none":
            plan.needs_human(
                f"{short} sets the learning rate itself; scale its "
                f"{ABSOLUTE_LR_SCHEDULERS[short]} like the optimizer's",
                tree.code(tree.statement(call)),
            )


def _per_process_sizes(tree: Tree, plan: Plan, edits: Edits) -> None:
    """Under the global policy the loader yields `setting // WORLD_SIZE` rows, but a step
    that sizes tensors by the setting itself (`torch.eye(2 * args.batch_size)`, `view(bs,
    -1)`) still sizes them for the whole global batch: it crashes, or, where the shapes
    happen to fit, silently regroups the rows. The step works on its process's rows, so
    those reads take the per-process batch, the one its loader yields."""
    by_statement: dict[cst.CSTNode, list[cst.BaseExpression]] = {}
    for read in setting_sized_tensors(tree):
        by_statement.setdefault(tree.statement(read), []).append(read)
    for statement, reads in by_statement.items():
        first_line = _first_code_line(tree.code(statement))
        for read in reads:
            edits.replace(read, snippets.expression(f"({tree.code(read)} // WORLD_SIZE)"))
        # The report finds the line by its new text: each setting once, whole names only.
        for setting in {tree.code(read) for read in reads}:
            pattern = rf"(?<![\w.]){re.escape(setting)}(?!\w)"
            per_process = f"({setting} // WORLD_SIZE)"
            first_line = re.sub(pattern, lambda _, new=per_process: new, first_line)
        plan.change(
            NAME,
            f"`{_first_code_line(tree.code(statement))}` sizes a tensor by the batch-size "
            "setting: it takes the per-process batch, as the loader does (--batch-policy global)",
            first_line,
            "DDP026",
        )


def _first_code_line(code: str) -> str:
    lines = [line.strip() for line in code.splitlines()]
    return next((line for line in lines if line and not line.startswith("#")), "")


def _scale_hand_set_lr(tree: Tree, plan: Plan, edits: Edits) -> None:
    """`param_group["lr"] = ...` overrides the scaled LR the optimizer was built with: the
    value set by hand gets the same scaling."""
    label, template = LR_RULES[plan.lr_scaling]
    comment = f"# ddpify: {label}: the learning rate set by hand, scaled like the optimizer's"
    for subscript in tree.find(cst.Subscript):
        index = subscript.slice[0].slice if len(subscript.slice) == 1 else None
        value = index.value if isinstance(index, cst.Index) else None
        if not (isinstance(value, cst.SimpleString) and value.evaluated_value == "lr"):
            continue
        statement = tree.statement(subscript)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not (isinstance(small, cst.Assign) and small.targets[0].target is subscript):
            continue
        lr = tree.code(parenthesize(small.value))
        new = snippets.expression(template.format(lr=lr))
        edits.replace(small.value, new)
        edits.replace(statement, lambda updated: snippets.with_comment(updated, comment))
        plan.change(
            NAME,
            f"learning rate set by hand scaled: {label}",
            tree.module.code_for_node(new),
            "DDP041",
        )


def _lr_rule(plan: Plan, optimizer: str) -> str:
    if plan.options.lr_scaling is not None:
        return plan.options.lr_scaling
    if optimizer in ADAPTIVE:
        return "sqrt"
    if optimizer in SGD_LIKE:
        return "linear"
    return "none"


def _scale_lr(tree: Tree, plan: Plan, edits: Edits, call: cst.Call) -> None:
    optimizer = (tree.qualify(call.func) or "").rsplit(".", 1)[-1]
    if not optimizer.isidentifier():  # `get_instance(torch.optim, "optimizer", config, ...)`
        optimizer = "the optimizer class the configuration chooses"
    rule = _lr_rule(plan, optimizer)
    statement = tree.statement(call)
    if rule == "none":
        if plan.options.lr_scaling is None and optimizer != "LBFGS":
            plan.needs_human(
                f"{optimizer}: no LR scaling rule known; the global batch is now "
                "WORLD_SIZE times larger",
                tree.code(statement),
            )
        return
    lr = find_arg(call, "lr", 1)
    if lr is None:
        plan.needs_human(
            f"{optimizer} uses its default learning rate; scale it for the "
            "WORLD_SIZE-fold global batch (DDP041)",
            tree.code(statement),
        )
        return
    label, template = LR_RULES[rule]
    new = snippets.expression(template.format(lr=tree.code(parenthesize(lr.value))))
    edits.replace(lr.value, new)
    comment = f"# ddpify: {label}: each process keeps the batch size"
    edits.replace(statement, lambda updated: snippets.with_comment(updated, comment))
    plan.lr_scaling, plan.lr_rule = rule, label
    plan.change(
        NAME, f"{optimizer} learning rate scaled: {label}", tree.module.code_for_node(new), "DDP041"
    )


# -- set_epoch --------------------------------------------------------------------------


def _epoch_loops(tree: Tree) -> list[cst.For]:
    """The outermost `for` loops over epochs (analysis/epochs.py decides which are)."""
    loops: list[cst.For] = []
    for loop in epoch_loops(tree):
        if isinstance(loop, cst.For) and not any(tree.inside(loop, o) for o in loops):
            loops.append(loop)
    return loops


def _set_epoch(tree: Tree, plan: Plan, edits: Edits, loaders: list[Loader]) -> set[int]:
    """Place set_epoch in the epoch loops; the ids of the loader calls an epoch loop
    reshuffles (it already calls set_epoch, or now does)."""
    names = {name: loader for loader in loaders for name in loader.names}
    placed: set[int] = set()
    if not names:
        return placed
    for loop in _epoch_loops(tree):
        found = _loaders_in(tree, loop, names)
        placed |= {id(names[name].call) for name in found}
        if any(method_name(c) == "set_epoch" for c in tree.within(loop, cst.Call)):
            continue
        if not found:
            continue
        if not isinstance(loop.target, cst.Name):
            plan.needs_human(
                "add sampler.set_epoch(epoch) at the top of this epoch loop", tree.code(loop)
            )
            continue
        for name in found:  # each loader the epoch draws from (`zip(source, target)`)
            _place_set_epoch(tree, plan, edits, loop, name, names[name])
    return placed


def _place_set_epoch(
    tree: Tree, plan: Plan, edits: Edits, loop: cst.For, name: str, loader: Loader
) -> None:
    epoch = loop.target.value  # type: ignore[attr-defined]
    code = _set_epoch_code(tree, loop, name, loader, epoch)
    binding = _binding_in(tree, loop, loader)
    if binding is not None:  # the loader is built each epoch: reshuffle the new one
        edits.after[binding].append(snippets.statement(code))
    else:
        edits.prepend[loop].append(snippets.statement(code))
    plan.change(
        NAME,
        "set_epoch at the top of each epoch, so each epoch reshuffles",
        code.splitlines()[0],
        "DDP022",
    )


def _binding_in(tree: Tree, loop: cst.For, loader: Loader) -> cst.BaseStatement | None:
    """The statement in `loop` that builds the loader (`loader = DataLoader(...)` inside
    the epoch loop): set_epoch must come after it, not before the loader exists."""
    if not tree.owns(loader.call) or not tree.inside(loader.call, loop):
        return None
    statement = tree.statement(loader.call)
    small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
    if isinstance(small, cst.Assign) and small.value is loader.call:
        return statement
    return None


PER_PASS_COMMENT = "# ddpify: a new pass over the loader: its DistributedSampler reshuffles"


def _set_epoch_per_pass(tree: Tree, plan: Plan, edits: Edits, loaders: list[Loader]) -> set[int]:
    """A shuffled loader that an endless generator feeds the step loop (`def
    sample_data(loader): while True: yield from loader`): where a new pass begins, the
    sampler's epoch moves on by one, the same on every rank, so each pass reshuffles as
    the original's did. The ids of the loaders handled so."""
    if any(method_name(c) == "set_epoch" for c in tree.view.find(cst.Call)):
        return set()
    covered: set[int] = set()
    done: set[int] = set()
    for loader in loaders:
        shuffle = find_arg(loader.call, "shuffle", 2)
        if shuffle is None or dotted(shuffle.value) == "False":
            continue
        restarts = pass_restarts(tree.view, loader.names) + _fetcher_passes(tree, loader)
        if restarts:
            covered.add(id(loader.call))
        for restart in restarts:
            if not tree.owns(restart.statement) or id(restart.statement) in done:
                continue
            done.add(id(restart.statement))
            sampler = f"{restart.parameter}.sampler"
            code = (
                f"if isinstance({sampler}, {plan.sampler}):\n"
                f"    {sampler}.set_epoch({sampler}.epoch + 1)\n"
            )
            new = snippets.statements(code, PER_PASS_COMMENT)[0]
            (edits.after if restart.after else edits.before)[restart.statement].append(new)
            plan.needs.add("sampler")
            plan.change(
                NAME,
                f"set_epoch on each new pass `{restart.function.name.value}` starts over "
                f"`{restart.parameter}`, so each pass reshuffles",
                f"{sampler}.set_epoch(",
                "DDP022",
            )
    return covered


def _fetcher_passes(tree: Tree, loader: Loader) -> list[PassRestart]:
    """Where a fetcher object built from `loader` makes its iterator over it again
    (`self.iter = iter(self.loader)`): a new pass begins there, as in an endless generator."""
    found = []
    for restart in fetcher_restarts(tree.view, loader.names):
        method = tree.view.function(restart.statement)
        if method is not None:
            found.append(PassRestart(method, restart.attribute, restart.statement, after=False))
    return found


def _note_step_loop_order(tree: Tree, plan: Plan, loaders: list[Loader]) -> None:
    """A shuffled loader that a step loop draws from with next() (`iter(loader)`, an
    endless generator, a fetcher object), with no epoch loop to call set_epoch: the
    DistributedSampler then repeats the first pass's order on every pass, where the
    original reshuffled. Where the iterator restarts is the user's code: say so."""
    if any(method_name(c) == "set_epoch" for c in tree.view.find(cst.Call)):
        return
    loops = training_loops(tree.view)
    for loader in loaders:
        shuffle = find_arg(loader.call, "shuffle", 2)
        if shuffle is None or dotted(shuffle.value) == "False":
            continue
        if any(iterated_name(loop, tree.view) in loader.names for loop in loops):
            continue  # a `for` over the loader: one pass per loop, as in the original
        name = sorted(loader.names, key=_most_qualified)[-1]
        plan.needs_human(
            f"the step loop draws from `{name}` with next() and nothing calls set_epoch: "
            "every pass over the data now repeats one shuffled order (the original "
            f"reshuffled); call `{name}.sampler.set_epoch(k)`, k counting the passes (the "
            "same on every rank), where the iterator restarts",
            tree.code(tree.statement(loader.call)),
        )


def _loaders_in(tree: Tree, loop: cst.For, names: dict[str, Loader]) -> list[str]:
    """The names through which the epoch loop reads its training loaders, one per loader
    (several when it draws from them together: `zip(source_loader, target_loader)`)."""
    inside = names_an_epoch_reads(tree, loop)
    # `self.loader` before `loader`: names_in also lists the attribute's own name.
    found: dict[int, str] = {}
    for name in sorted(inside & set(names), key=_most_qualified):
        found.setdefault(id(names[name].call), name)
    if found:
        return list(found.values())
    single = _loader_in_methods(tree, loop, names, inside)
    return [single] if single is not None else []


def _loader_in_methods(
    tree: Tree, loop: cst.For, names: dict[str, Loader], inside: set[str]
) -> str | None:
    """The training loader a method of the loop's class reads (`self.train_epoch()`)."""
    cls = tree.parent.get(tree.function(loop)) if tree.function(loop) else None
    cls = tree.parent.get(cls) if isinstance(cls, cst.IndentedBlock) else None
    if isinstance(cls, cst.ClassDef):
        methods = {f.name.value: f for f in tree.within(cls, cst.FunctionDef)}
        for name in inside:
            if name.startswith("self.") and name[5:] in methods:
                used = names_in(methods[name[5:]]) & set(names)
                if used:
                    return sorted(used, key=_most_qualified)[0]
    return None


def _most_qualified(name: str) -> tuple[int, str]:
    return -name.count("."), name


def _set_epoch_code(tree: Tree, loop: cst.For, name: str, loader: Loader, epoch: str) -> str:
    given = find_arg(loader.call, "sampler", 3)
    if given is not None:
        sampler = dotted(given.value)
        bound = distributed_sampler_value(tree, given.value)
        if sampler and isinstance(bound, cst.IfExp):
            return f"if {sampler} is not None:\n    {sampler}.set_epoch({epoch})\n"
        if (
            sampler
            and tree.owns(loader.call)
            and tree.scope(tree.statement(loader.call)) is tree.scope(loop)
        ):
            return f"{sampler}.set_epoch({epoch})\n"
    return f"{name}.sampler.set_epoch({epoch})\n"


# -- loads ------------------------------------------------------------------------------


def _map_location(tree: Tree, plan: Plan, edits: Edits) -> None:
    for call in tree.calls_to("torch.load"):
        if find_arg(call, "map_location", 1) is not None:
            continue
        edits.replace(
            call,
            lambda updated: append_arg(
                updated, keyword("map_location", snippets.expression('"cpu"'))
            ),
        )
        plan.change(
            NAME,
            'torch.load(..., map_location="cpu"): no rank restores onto GPU 0',
            'map_location="cpu"',
            "DDP012",
        )
