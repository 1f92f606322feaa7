"""DDP025: evaluation through a DistributedSampler counts padded repeats, or rank 0
evaluates only its own shard."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.loaders import SamplerCall
from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.names import dotted
from ddpify.analysis.roles import iterated_name
from ddpify.diagnostics import Severity
from ddpify.rules.data._common import (
    LoaderRule,
    is_distributed,
    is_eval_dataset_call,
    is_true_literal,
    looks_like_eval,
)
from ddpify.walk import children


@dataclass(frozen=True)
class _Use:
    """A loader iterated, or handed to a function of this file, on rank 0 only."""

    name: str
    node: cst.CSTNode


class EvalPaddingDuplicates(LoaderRule):
    """Metrics over a DistributedSampler's shards change with the world size."""

    CODE = "DDP025"
    NAME = "eval-padding-duplicates"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "the evaluation loader's DistributedSampler pads the data with repeated samples, so "
        "the metric changes with the world size"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.rank_zero_uses: list[_Use] = []
        self.bars: list[tuple[cst.For, tuple[cst.CSTNode, ...]]] = []

    def visit_For(self, node: cst.For) -> None:
        if self.feeds:
            self._feed(node)
        name = iterated_name(node)  # as written, through enumerate(), tqdm(), zip()
        if name is None:
            return
        if _loader_like(name):
            if self.context.rank_zero_scope():
                self.rank_zero_uses.append(_Use(name, node.iter))
        elif "." not in name:
            # `for x in pbar`: what the bar wraps is asked of the tree in leave_Module,
            # and only then whether the loop runs on rank 0 only.
            self.bars.append((node, tuple(self.context.ancestors)))

    def visit_Call(self, node: cst.Call) -> None:
        if self.feeds:
            self._feed(node)
        if not any(_loader_like(_last_identifier(arg.value)) for arg in node.args):
            return  # the common case, decided without building dotted names
        names = [d for d in (dotted(arg.value) for arg in node.args) if d and _loader_like(d)]
        if names and self.context.rank_zero_scope():
            callee = dotted(node.func)
            if callee is not None and self.facts.defines(callee):
                self.rank_zero_uses.extend(_Use(name, node) for name in names)

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not is_distributed(model):
            return
        for loop, ancestors in self.bars:
            name = iterated_name(loop, self.context.tree)
            if name is not None and _loader_like(name) and rank_zero_scope(ancestors):
                self.rank_zero_uses.append(_Use(name, loop.iter))
        reported = self._rank_zero_shards()
        trims = None
        for sampler in self.facts.samplers:
            if id(sampler) in reported or not self._is_evaluation(sampler):
                continue
            if trims is None:
                trims = _trims_to_dataset_length(node)
            if not trims:
                self.report(sampler.call.func, _padding_message(sampler))

    def _rank_zero_shards(self) -> set[int]:
        """Report sharded loaders read on rank 0 only; the ids of their samplers."""
        sharded = {}
        for loader in self.facts.loaders:
            sampler = self.facts.distributed_sampler_of(loader)
            if loader.target is not None and sampler is not None:
                sharded[loader.target] = sampler
        reported: set[int] = set()
        for use in self.rank_zero_uses:
            sampler = sharded.get(use.name)
            if sampler is not None:
                self.report(use.node, _rank_zero_message(use.name))
                reported.add(id(sampler))
        return reported

    def _is_evaluation(self, sampler: SamplerCall) -> bool:
        loaders = [sampler.loader] if sampler.loader else self.facts.loaders_drawing_from(sampler)
        dataset = sampler.call.args[0].value if sampler.call.args else None
        names = [sampler.target, *(loader.target for loader in loaders)]
        if dataset is not None:
            names.append(dotted(dataset))
        if looks_like_eval(*names):
            return True
        if dataset is None:
            return False
        for source in self.facts.dataset_sources(dataset):
            call = unwrap_call_chain(source)
            if call is not None and is_eval_dataset_call(call):
                return True
        return False


def _last_identifier(expr: cst.BaseExpression) -> str:
    if type(expr) is cst.Attribute:  # exact types: see ddpify.walk.is_kind
        return expr.attr.value
    return expr.value if type(expr) is cst.Name else ""


def _loader_like(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return "loader" in last or last.endswith("_dl") or last == "dl"


def _trims_to_dataset_length(module: cst.Module) -> bool:
    """Whether the script cuts gathered results back to the dataset's length
    (`preds[: len(val_ds)]`) or evaluates the remainder a padded-free way
    (`len(val_sampler) * world_size`): the padding is then handled."""
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if type(node) is cst.Slice and node.upper is not None and _calls_len(node.upper):
            return True
        if type(node) is cst.Call and dotted(node.func) == "len" and node.args:
            inner = dotted(node.args[0].value) or ""
            if "sampler" in inner.rsplit(".", 1)[-1].lower():
                return True
        stack.extend(children(node))
    return False


def _calls_len(expr: cst.CSTNode) -> bool:
    stack = [expr]
    while stack:
        node = stack.pop()
        if type(node) is cst.Call and dotted(node.func) == "len":
            return True
        stack.extend(children(node))
    return False


def _padding_message(sampler: SamplerCall) -> str:
    drop_last = sampler.drop_last
    if drop_last is not None and is_true_literal(drop_last.value):
        effect = "drops the samples that do not divide evenly by the world size"
    else:
        effect = "pads the data with repeated samples to a multiple of the world size"
    return (
        f"this evaluation DistributedSampler {effect}, so the metric changes with the number "
        "of processes; gather the results and trim them to `len(dataset)`, or evaluate the "
        "remainder separately"
    )


def _rank_zero_message(name: str) -> str:
    return (
        f"`{name}` is sharded by a DistributedSampler but read on rank 0 only, so the "
        "evaluation sees 1/world_size of the data; evaluate on every rank and all-reduce the "
        "metric, or give rank 0 a loader without the sampler"
    )
