"""The data pass, for loaders whose class the configuration chooses (analysis/loader_classes.py).

`train_loader = get_instance(dataloaders, "train_loader", config)` may make any class of
`dataloaders`, all subclasses of the project's `BaseDataLoader(DataLoader)`, which hands
its sampler to DataLoader in its `__init__`. The sharding goes there, for the training
instance only:

- the base module gets `ddpify_sharded(arguments)`, through which its `__init__` now hands
  its arguments to DataLoader: inside `with ddpify_training_loader():` (the training
  construction site) the sampler becomes a DistributedSampler: over the dataset, shuffling
  as the loader did, when the base set none; split-then-shard over a SubsetRandomSampler's
  indices (each rank its share of the training split) when it set one;
- the training construction site is put inside `with ddpify_training_loader():`. The
  same classes build the validation loaders elsewhere, outside that block: they stay
  whole on every rank, so every rank computes the same validation metric and early
  stopping decides alike on every rank. A keyword at the site would not reach the base:
  each subclass's `__init__` has its own fixed signature;
- `ddpify_set_epoch(epoch)` opens each epoch of the loop that runs the training loop.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.loader_classes import (
    ChosenTrainingLoader,
    chosen_training_loaders,
    module_chosen_from,
)
from ddpify.analysis.loaders import LOADER_PARAMETERS
from ddpify.analysis.names import dotted
from ddpify.analysis.roles import calls_training, project_optimizer_calls, trained_owners
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import NotMigrated, Plan, Shape
from ddpify.migrate.edits import Edits
from ddpify.migrate.entrypoint import after_imports

NAME = "data"
DATA_LOADER = "torch.utils.data.DataLoader"
DDP = "torch.nn.parallel.DistributedDataParallel"
SHARDED = "ddpify_sharded"
TRAINING = "ddpify_training_loader"
SET_EPOCH = "ddpify_set_epoch"
# Samplers the base may build that `ddpify_sharded` knows how to shard.
KNOWN_SAMPLERS = ("SubsetRandomSampler", "DistributedSampler")

HELPERS = '''
# ddpify: only the loader built inside `with ddpify_training_loader():` (the training
# loader) draws its shard through a DistributedSampler; the validation loaders of the same
# classes stay whole on every rank, so every rank computes the same validation metric.
_DDPIFY_SHARD = {{"training": False, "sampler": None}}


class ddpify_training_loader:
    """The {base} built inside this block is the training loader: it is sharded."""

    def __enter__(self):
        _DDPIFY_SHARD["training"] = True

    def __exit__(self, *exc):
        _DDPIFY_SHARD["training"] = False


def ddpify_set_epoch(epoch):
    """Reshuffle the training loader's shard for this epoch, alike on every rank."""
    if _DDPIFY_SHARD["sampler"] is not None:
        _DDPIFY_SHARD["sampler"].set_epoch(epoch)


class _DdpifySubsetShard({sampler}):
    """Split, then shard: the indices of the training split, in a permutation drawn alike
    on every rank (seeded with the epoch); each rank takes its share."""

    def __init__(self, indices):
        super().__init__(indices, shuffle=True)
        self.indices = list(indices)

    def __iter__(self):
        return (self.indices[i] for i in super().__iter__())


def ddpify_sharded(arguments):
    """DataLoader's arguments; for the training loader, with a DistributedSampler."""
    from torch.utils.data import SubsetRandomSampler

    if not _DDPIFY_SHARD["training"]:
        return arguments
    sampler = arguments.get("sampler")
    if sampler is None:
        sampler = {sampler}(arguments["dataset"], shuffle=bool(arguments.get("shuffle")))
    elif isinstance(sampler, SubsetRandomSampler):
        sampler = _DdpifySubsetShard(sampler.indices)
    elif not isinstance(sampler, {sampler}):
        raise TypeError(f"ddpify: cannot shard the training loader's sampler {{sampler!r}}")
    _DDPIFY_SHARD["sampler"] = sampler{per_process}
    return {{**arguments, "sampler": sampler, "shuffle": False}}
'''
# --batch-policy global: the configured batch is the global one, split across processes.
PER_PROCESS = """
    # ddpify: batch policy global: batch_size // WORLD_SIZE per process, LR unchanged
    from torch.distributed import get_world_size

    arguments = {**arguments, "batch_size": arguments.get("batch_size", 1) // get_world_size()}"""


def shard_loader_classes(tree: Tree, plan: Plan, edits: Edits) -> bool:
    """Shard the training loaders whose class the configuration chooses; True if the
    project has some (then this module's part is planned in `edits`)."""
    chosen = chosen_training_loaders(tree, plan.options.loader_modules)
    if not chosen:
        return False
    first = chosen[0]
    _refuse_unwrapped_model(tree, plan, first)
    base = _base_class(tree, first.base.name)
    if base is not None:
        _shard_in_base(tree, plan, edits, base, first)
    for loader in chosen:
        if tree.owns(loader.site):
            _mark_training_site(tree, plan, edits, loader)
    _set_epoch(tree, plan, edits, first)
    return True


def _refuse_unwrapped_model(tree: Tree, plan: Plan, loader: ChosenTrainingLoader) -> None:
    """Sharding the data without a DDP wrap (the wrap pass ran before this one) would
    have every rank train a model of its own on its own shard: refuse, naming why no
    model was wrapped."""
    view = tree.view
    calls = view.find(cst.Call)
    if any(_wraps_for_training(view, c, plan) for c in calls):
        return
    raise NotMigrated(
        Shape.UNKNOWN,
        f"the training loader (`{view.code(loader.site)}`) could be sharded in "
        f"`{loader.base.name}`, but ddpify wraps no trained model in DistributedDataParallel"
        f"{_why_no_model(tree, calls)}, so every rank would train a model of its own; build "
        "the optimizer over `model.parameters()` with a torch.optim class named in the "
        "code, or wrap the model in DistributedDataParallel yourself, then migrate again",
    )


def _why_no_model(tree: Tree, calls: list[cst.Call]) -> str:
    """Why no model was wrapped: the optimizers ddpify cannot read (their class chosen at
    run time from torch.optim), those whose model it cannot tell, and those it found only
    in a module's `__main__` demo."""
    view = tree.view
    optimizers = project_optimizer_calls(tree)
    demos = [c for c in optimizers if _in_demo(view, c)]
    unread = [c for c in optimizers if c not in demos and not trained_owners(view, c)]
    reasons = []
    chosen = [c for c in calls if module_chosen_from(tree, c) == "torch.optim"]
    if chosen:
        reasons.append(
            f"the optimizer `{view.code(chosen[0])}` has its class chosen at run time from "
            "torch.optim, which ddpify does not read as an optimizer"
        )
    if unread:
        reasons.append(f"ddpify cannot tell which model `{view.code(unread[0])}` trains")
    if demos:
        demo = f"`{view.code(demos[0])}`"
        if len(demos) == len(optimizers):
            demo = f"the only optimizer it reads, {demo},"
        reasons.append(f"{demo} is in the `__main__` demo of an imported module")
    return (": " + "; ".join(reasons)) if reasons else ""


def _in_demo(view, call: cst.Call) -> bool:
    """Whether `call` lies under the `__main__` guard of a module other than the entry."""
    owner = view.owner(call)
    trees = view.trees
    guard = owner.main_guard() if owner is not None else None
    return owner is not trees[0] and guard is not None and owner.inside(call, guard)


def _wraps_for_training(view, call: cst.Call, plan: Plan) -> bool:
    """A DDP wrap, but not one in the `__main__` demo of an imported module (never run)."""
    if dotted(call.func) != plan.ddp and view.qualify(call.func) != DDP:
        return False
    return not _in_demo(view, call)


def _base_class(tree: Tree, name: str) -> cst.ClassDef | None:
    for cls in tree.find(cst.ClassDef):
        if cls.name.value == name and any(tree.qualify(b.value) == DATA_LOADER for b in cls.bases):
            return cls
    return None


def _shard_in_base(
    tree: Tree, plan: Plan, edits: Edits, base: cst.ClassDef, loader: ChosenTrainingLoader
) -> None:
    if SHARDED in tree.functions():
        return  # migrated already
    name = base.name.value
    call = _super_init(tree, base)
    if call is None:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"the training loader's class is chosen at run time among the subclasses of "
            f"`{name}`, whose `__init__` does not call `super().__init__(...)` where ddpify "
            "could hand DataLoader a DistributedSampler; shard it there yourself",
        )
    for sampler in tree.within(base, cst.Call):
        called = (dotted(sampler.func) or "").rsplit(".", 1)[-1]
        if called.endswith("Sampler") and called not in KNOWN_SAMPLERS:
            raise NotMigrated(
                Shape.UNKNOWN,
                f"`{name}` (the base of the training loader's classes) draws with "
                f"`{tree.code(sampler)}`, which ddpify cannot shard by rank; give each rank "
                "its share of that draw yourself",
            )
    arguments = _as_keywords(tree, call)
    edits.replace(call, lambda updated: _through_sharded(updated, arguments))
    anchor = after_imports(tree)
    per_process = PER_PROCESS if plan.options.batch_policy == "global" else ""
    helpers = snippets.statements(
        HELPERS.format(base=name, sampler=plan.sampler, per_process=per_process)
    )
    helpers[0] = helpers[0].with_changes(leading_lines=[cst.EmptyLine(), *helpers[0].leading_lines])
    if anchor is not None:
        edits.after[anchor].extend(helpers)
    else:
        edits.before[base].extend(helpers)
    plan.needs.add("sampler")
    plan.change(
        NAME,
        f"`{name}` (the base of {', '.join(loader.base.members[:4])}) hands DataLoader a "
        "DistributedSampler for the training loader only (split-then-shard over its "
        "SubsetRandomSampler split); its validation loaders stay whole on every rank"
        + (
            "; the training loader takes batch_size // WORLD_SIZE per process"
            if per_process
            else ""
        ),
        f"{SHARDED}(",
        "DDP020",
    )


def _super_init(tree: Tree, base: cst.ClassDef) -> cst.Call | None:
    init = next((f for f in tree.within(base, cst.FunctionDef) if f.name.value == "__init__"), None)
    if init is None:
        return None
    for call in tree.within(init, cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "__init__"):
            continue
        owner = func.value
        if isinstance(owner, cst.Call) and dotted(owner.func) == "super":
            return call
    return None


def _as_keywords(tree: Tree, call: cst.Call) -> str:
    """The call's arguments as `dict(...)` arguments: positionals named by DataLoader's
    parameters (a `*args` cannot be named: refused)."""
    parts = []
    for index, arg in enumerate(call.args):
        code = tree.code(arg.value)
        if arg.star == "**" or arg.keyword is not None:
            parts.append(f"**{code}" if arg.star else f"{arg.keyword.value}={code}")  # type: ignore[union-attr]
        elif arg.star == "*" or index >= len(LOADER_PARAMETERS):
            raise NotMigrated(
                Shape.UNKNOWN,
                f"`{tree.code(call)}` passes DataLoader arguments ddpify cannot name; pass "
                "them by keyword, then migrate again",
            )
        else:
            parts.append(f"{LOADER_PARAMETERS[index]}={code}")
    return ", ".join(parts)


def _through_sharded(updated: cst.Call, arguments: str) -> cst.Call:
    value = snippets.expression(f"{SHARDED}(dict({arguments}))")
    return updated.with_changes(args=[cst.Arg(value=value, star="**")])


def _mark_training_site(tree: Tree, plan: Plan, edits: Edits, loader: ChosenTrainingLoader) -> None:
    statement = tree.statement(loader.site)
    if statement is None or _inside_training_block(tree, statement):
        return
    if not isinstance(statement, cst.SimpleStatementLine):
        raise NotMigrated(
            Shape.UNKNOWN,
            f"the training loader is made by `{tree.code(loader.site)}` inside a compound "
            f"statement; build it in its own statement inside `with {TRAINING}():`",
        )
    block = snippets.statement(f"with {TRAINING}():\n    pass\n")
    edits.group([statement], snippets.nested_under(block))  # type: ignore[arg-type]
    _import_from_base(tree, edits, loader, TRAINING)
    plan.change(
        NAME,
        f"the training loader is built inside `with {TRAINING}():`, so it alone is sharded",
        f"with {TRAINING}():",
        "DDP020",
    )


def _inside_training_block(tree: Tree, statement: cst.CSTNode) -> bool:
    parent = tree.parent.get(statement)
    while parent is not None:
        if isinstance(parent, cst.With) and TRAINING in tree.code(parent.items[0]):
            return True
        parent = tree.parent.get(parent)
    return False


def _set_epoch(tree: Tree, plan: Plan, edits: Edits, loader: ChosenTrainingLoader) -> None:
    """`ddpify_set_epoch(epoch)` at the top of the epoch loops of this module that run the
    training loop (directly, or through the method that holds it)."""
    from ddpify.migrate.data import _epoch_loops  # the data pass's choice of epoch loops

    for loop in _epoch_loops(tree):
        runs = tree.inside(loader.loop, loop) or calls_training(tree, loop) is not None
        if not runs or not isinstance(loop.target, cst.Name):
            continue
        if any(dotted(c.func) == SET_EPOCH for c in tree.within(loop, cst.Call)):
            continue
        edits.prepend[loop].append(snippets.statement(f"{SET_EPOCH}({loop.target.value})\n"))
        _import_from_base(tree, edits, loader, SET_EPOCH)
        plan.change(
            NAME,
            "set_epoch at the top of each epoch, so each epoch reshuffles the training shard",
            f"{SET_EPOCH}(",
            "DDP022",
        )


def _import_from_base(tree: Tree, edits: Edits, loader: ChosenTrainingLoader, name: str) -> None:
    if _base_class(tree, loader.base.name) is not None or name in tree.imports.aliases:
        return
    anchor = after_imports(tree)
    line = snippets.statement(f"from {loader.base.module} import {name}\n")
    if anchor is not None:
        edits.after[anchor].append(line)
    else:
        edits.before[tree.module.body[0]].append(line)
