"""The training loop iterates an instance of a class that holds a DataLoader and hands
out its batches (analysis/loader_holders.py: pix2pix's `CustomDatasetDataLoader`).

The held DataLoader is sharded where the class builds it, by the data pass's own
DistributedSampler (it is a training loader of `roles.train_loaders`); this pass makes
each epoch reshuffle it: through the class's own `set_epoch(epoch)` when it has one (the
loop calls it, or now does), else `<instance>.<attribute>.sampler.set_epoch(epoch)` at
the top of the epoch loop."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.epochs import epoch_loops
from ddpify.analysis.loader_holders import HeldLoader, early_stop, held_loader_of
from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.roles import training_loops
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan, _first_line
from ddpify.migrate.edits import Edits

NAME = "data"


def reshuffle_held_loaders(tree: Tree, plan: Plan, edits: Edits) -> set[int]:
    """set_epoch for every held training loader: in its holder's `set_epoch` (when this
    module defines it) and in the epoch loops (when this module has them). The ids of the
    held DataLoader calls, whose set_epoch this pass places."""
    view = tree.view
    held = [
        (loop, *found) for loop in training_loops(view) if (found := held_loader_of(view, loop))
    ]
    done: set[int] = set()
    for loop, name, loader in held:
        method = loader.set_epoch
        if method is not None and tree.owns(method) and id(method) not in done:
            done.add(id(method))
            _set_epoch_in_holder(tree, plan, edits, loader, method)
        stop = early_stop(view, loader)
        if stop is not None and tree.owns(stop) and id(stop) not in done:
            done.add(id(stop))
            _note_early_stop(tree, plan, loader, stop)
        if tree.owns(loop):
            _set_epoch_in_epoch_loop(tree, plan, edits, loop, name, loader)
    return {id(loader.call) for _, _, loader in held}


def _note_early_stop(tree: Tree, plan: Plan, loader: HeldLoader, stop: cst.If) -> None:
    """`if i * batch_size >= max_dataset_size: break` in the holder's `__iter__` counts
    this process's batches: with the data sharded, the cap now holds per rank."""
    plan.needs_human(
        f"`{loader.holder}.__iter__` ends a pass after a count of batches "
        f"(`{_first_line(tree.code(stop))}`): each rank now counts the batches of its "
        "own shard, so together the ranks take up to WORLD_SIZE times the original's "
        "share of the data when the cap binds; divide the cap by WORLD_SIZE to keep it",
        tree.code(tree.statement(loader.call)),
    )


def _set_epoch_in_holder(
    tree: Tree, plan: Plan, edits: Edits, loader: HeldLoader, method: cst.FunctionDef
) -> None:
    params = method.params.params
    if len(params) < 2 or not isinstance(method.body, cst.IndentedBlock):
        return
    sampler = f"{loader.attribute}.sampler"
    if any(dotted(c.func) == f"{sampler}.set_epoch" for c in tree.within(method, cst.Call)):
        return  # migrated before
    code = f"{sampler}.set_epoch({params[1].name.value})"
    edits.after[method.body.body[-1]].append(snippets.statement(code))
    plan.change(
        NAME,
        f"`{loader.holder}.set_epoch` reshuffles the DistributedSampler of the DataLoader it "
        "holds, each epoch",
        code,
        "DDP022",
    )


def _set_epoch_in_epoch_loop(
    tree: Tree, plan: Plan, edits: Edits, loop: cst.For, name: str, loader: HeldLoader
) -> None:
    epoch = next(
        (e for e in epoch_loops(tree) if isinstance(e, cst.For) and tree.inside(loop, e)), None
    )
    if epoch is None:
        plan.needs_human(
            f"`{name}` hands out the batches of a DataLoader sharded by a DistributedSampler: "
            "call its sampler's set_epoch(epoch) at the top of each epoch, or every epoch "
            "repeats one order",
            tree.code(tree.statement(loop)),
        )
        return
    if loader.set_epoch is not None:
        if any(dotted(c.func) == f"{name}.set_epoch" for c in tree.within(epoch, cst.Call)):
            return  # the loop calls the holder's set_epoch, which now reshuffles
        code = f"{name}.set_epoch({{epoch}})"
    elif any(method_name(c) == "set_epoch" for c in tree.within(epoch, cst.Call)):
        return
    else:
        code = f"{name}.{loader.attribute.removeprefix('self.')}.sampler.set_epoch({{epoch}})"
    if not isinstance(epoch.target, cst.Name):
        plan.needs_human("add set_epoch(epoch) at the top of this epoch loop", tree.code(epoch))
        return
    code = code.format(epoch=epoch.target.value)
    edits.prepend[epoch].append(snippets.statement(code))
    plan.change(
        NAME, "set_epoch at the top of each epoch, so each epoch reshuffles", code, "DDP022"
    )
