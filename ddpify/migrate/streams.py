"""Part of pass 5, data: shard a training stream (an IterableDataset of the project) by rank.

A DataLoader over an IterableDataset takes no sampler, so the class that yields the
items shards them: its `__iter__` gets a decorator that, on a dataset switched on with
`dataset.shard_by_rank = True`, yields every WORLD_SIZE-th item from RANK and drops a
last round of fewer than WORLD_SIZE items, so every rank takes as many steps (uneven
shards would leave a rank waiting in DDP's all-reduce). `__len__` then counts the rank's
share. The switch is set on the training loader's dataset only: an evaluation loader
over the same class keeps reading all of it. Each rank keeps the per-process batch, so
the global batch is WORLD_SIZE times the original's, made of interleaved items.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.streams import (
    ITER_DECORATOR,
    LEN_DECORATOR,
    SWITCH,
    Stream,
    is_sharded,
    stream_random_draws,
    switched_on,
    training_stream,
)
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Loader, Plan
from ddpify.migrate.edits import Edits

NAME = "data"
HELPERS = '''\


def {iter}(method):
    """ddpify: on a dataset whose `{switch}` is set, `__iter__` yields every
    WORLD_SIZE-th item of the stream, starting at RANK. A last round of fewer than
    WORLD_SIZE items is dropped, so every rank yields as many items (and takes as many
    steps: uneven shards would leave a rank waiting in DDP's all-reduce)."""

    def items(self, *args, **kwargs):
        stream = method(self, *args, **kwargs)
        if not getattr(self, "{switch}", False):
            yield from stream
            return
        round_ = []
        for item in stream:
            round_.append(item)
            if len(round_) == WORLD_SIZE:
                yield round_[RANK]
                round_ = []

    return items


def {len}(method):
    """ddpify: the length of a dataset sharded by `{iter}`: this rank's share."""

    def length(self):
        total = method(self)
        return total // WORLD_SIZE if getattr(self, "{switch}", False) else total

    return length
'''


def shard_streams(tree: Tree, plan: Plan, edits: Edits, loaders: list[Loader]) -> set[int]:
    """Shard the training streams of `loaders` where this module holds their parts; the
    ids of the loader calls that read a stream (they get no sampler and no set_epoch)."""
    streams = [s for s in (training_stream(tree, loader) for loader in loaders) if s]
    decorated: set[int] = set()
    helpers_at: list[cst.CSTNode] = []
    for stream in streams:
        if stream.evaluation:
            _note_evaluation(tree, plan, stream)
            continue
        if _sharded_by_user(stream):
            _note_sharded_by_user(tree, plan, stream)
            continue
        if tree.owns(stream.loader.call) and not switched_on(tree.view, stream):
            _switch_on(tree, plan, edits, stream)
        for method in (stream.iter_method, stream.len_method):
            if method is not None and tree.owns(method) and id(method) not in decorated:
                decorated.add(id(method))
                if not _decorated(method):
                    _decorate(tree, plan, edits, stream, method)
                    helpers_at.append(_top_level(tree, method))
        _note_random_draws(tree, plan, stream)
    if helpers_at and ITER_DECORATOR not in tree.functions():
        first = min(helpers_at, key=lambda s: tree.module.body.index(s))
        helpers = HELPERS.format(iter=ITER_DECORATOR, len=LEN_DECORATOR, switch=SWITCH)
        edits.before[first].extend(snippets.statements(helpers))
    return {id(stream.loader.call) for stream in streams}


def _sharded_by_user(stream: Stream) -> bool:
    """The classes split the stream by rank themselves (not through ddpify's decorator)."""
    return is_sharded(stream) and not any(
        _decorated(m) for m in (stream.iter_method, stream.len_method) if m is not None
    )


def _decorated(method: cst.FunctionDef) -> bool:
    names = {d.decorator.value for d in method.decorators if isinstance(d.decorator, cst.Name)}
    return bool(names & {ITER_DECORATOR, LEN_DECORATOR})


def _top_level(tree: Tree, node: cst.CSTNode) -> cst.CSTNode:
    """The module-level statement that holds `node`."""
    for ancestor in reversed(tree.ancestors(node)):
        if ancestor in tree.module.body:
            return ancestor
    return node


def _switch_on(tree: Tree, plan: Plan, edits: Edits, stream: Stream) -> None:
    statement = tree.statement(stream.loader.call)
    line = f"{stream.dataset}.{SWITCH} = True"
    comment = (
        f"# ddpify: each rank reads every WORLD_SIZE-th item of this stream (see {stream.created})"
    )
    edits.before[statement].append(snippets.statements(line + "\n", comment)[0])
    plan.change(
        NAME,
        f"the training stream `{stream.dataset}` ({stream.created}, an IterableDataset, "
        "which takes no sampler) is sharded by rank: each rank reads every WORLD_SIZE-th "
        "item from RANK, the last incomplete round dropped so every rank takes as many "
        "steps; the per-process batch is the original's, so the global batch is "
        "WORLD_SIZE times larger",
        line,
        "DDP024",
    )


def _decorate(tree: Tree, plan: Plan, edits: Edits, stream: Stream, method) -> None:
    name = ITER_DECORATOR if method is stream.iter_method else LEN_DECORATOR
    decorator = cst.Decorator(decorator=cst.Name(name))
    edits.replace(
        method, lambda updated: updated.with_changes(decorators=[decorator, *updated.decorators])
    )
    owner = _class_of(stream, method)
    what = (
        "yields every WORLD_SIZE-th item from RANK"
        if name == ITER_DECORATOR
        else "counts this rank's share"
    )
    plan.change(
        NAME,
        f"`{owner}.{method.name.value}` {what} on a dataset switched on with "
        f"`{SWITCH} = True` (the training loader's)",
        f"@{name}",
    )


def _class_of(stream: Stream, method: cst.FunctionDef) -> str:
    for cls in stream.classes:
        if any(s is method for s in cls.body.body):
            return cls.name.value
    return stream.created


def _note_sharded_by_user(tree: Tree, plan: Plan, stream: Stream) -> None:
    """The classes mention a rank or a world size: taken as splitting the stream
    themselves, which ddpify cannot check; a human can."""
    if tree.owns(stream.loader.call):
        plan.needs_human(
            f"the training stream `{stream.dataset or stream.created}` is an IterableDataset "
            f"whose classes mention a rank or world size, so ddpify leaves its sharding to "
            "them: check that each rank reads its own items, as many as the others",
            tree.code(tree.statement(stream.loader.call)),
        )


def _note_evaluation(tree: Tree, plan: Plan, stream: Stream) -> None:
    if tree.owns(stream.loader.call):
        plan.needs_human(
            unsharded_stream_note(stream), tree.code(tree.statement(stream.loader.call))
        )


def stream_of(tree: Tree, call: cst.Call) -> Stream | None:
    """The stream a DataLoader call that is not a training loader reads, if any."""
    return training_stream(tree, Loader(call, set()))


def unsharded_stream_note(stream: Stream) -> str:
    name = f"`{stream.dataset}`" if stream.dataset else "this loader's dataset"
    how = (
        f"set `{stream.dataset}.{SWITCH} = True` before the loader, as for the training stream, "
        if stream.dataset and stream.iter_method is not None
        else "shard it by rank in `__iter__` "
    )
    return (
        f"{name} is an evaluation stream (an IterableDataset, {stream.created}) and is not "
        f"sharded: every rank evaluates all of it (right metrics, N-fold work); to split it, "
        f"{how}and all-reduce the metrics (DDP054)"
    )


def _note_random_draws(tree: Tree, plan: Plan, stream: Stream) -> None:
    for call in stream_random_draws(tree.view, stream):
        if not tree.owns(call):
            continue
        plan.needs_human(
            f"`{tree.code(call.func)}(...)` draws random numbers while the training stream "
            f"{stream.created} is built or read: each rank draws its own, so the ranks read "
            "different random items (a random subset drawn per rank may overlap another "
            "rank's) and the run does not replay the original's stream (verify is "
            "inconclusive); seed this generator the same on every rank (e.g. with the "
            "epoch) for disjoint shards of one draw",
            tree.code(tree.statement(call)),
        )
