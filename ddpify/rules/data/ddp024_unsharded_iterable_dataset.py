"""DDP024: an IterableDataset read by every rank in full."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.loaders import LoaderCall
from ddpify.analysis.names import dotted
from ddpify.diagnostics import Severity
from ddpify.rules.data._common import LoaderRule, is_distributed, looks_like_eval


class UnshardedIterableDataset(LoaderRule):
    """An IterableDataset takes no sampler, so it must shard itself by rank."""

    CODE = "DDP024"
    NAME = "unsharded-iterable-dataset"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "this DataLoader reads an IterableDataset that never looks at the rank, so every "
        "rank yields the same stream; shard it by rank"
    )

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not is_distributed(model):
            return
        facts = self.facts
        hf_split = facts.splits_streams_by_node()
        for loader in facts.loaders:
            dataset = loader.dataset
            if dataset is None or loader.where.rank_zero or _is_evaluation(loader):
                continue
            kind = facts.unsharded_stream(dataset, hf_split)
            if kind is not None:
                self.report(loader.call.func, _message(loader, kind))


def _is_evaluation(loader: LoaderCall) -> bool:
    function = loader.where.function
    return looks_like_eval(
        loader.target, dotted(loader.dataset), function.name.value if function else None
    )


def _message(loader: LoaderCall, kind: str) -> str:
    name = dotted(loader.dataset)
    subject = f"`{name}`" if name and len(name) <= 40 else "this dataset"
    if kind == "hf":
        how = "with `split_dataset_by_node(ds, rank=rank, world_size=world_size)`"
    else:
        how = "in `__iter__` (`itertools.islice(stream, rank, None, world_size)`)"
    return (
        f"{subject} is an IterableDataset that is never split by rank, and a DataLoader "
        f"cannot give it a sampler, so every rank yields the same stream; shard it by rank {how}"
    )
