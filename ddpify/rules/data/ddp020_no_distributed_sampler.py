import re

import libcst as cst

from ddpify.analysis.loaders import LOADER_PARAMETERS, LoaderCall, LoaderFacts, names_in
from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.names import dotted
from ddpify.arguments import insert_keyword_after, keyword_arg, replace_with_keyword
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.data._common import (
    LoaderRule,
    is_distributed,
    is_eval_dataset_call,
    is_none,
    looks_like_eval,
    sampler_spelling,
)

# A dataset built with these already yields a per-rank shard.
_SHARD_WORD = re.compile(r"rank|world|replica|shard|num_parts|part_id", re.I)
# An enclosing `if` on these may well be the single-process branch.
_DIST_WORD = re.compile(r"dist|ddp|world|rank|initiali[sz]ed|parallel|multi_?gpu|ngpu", re.I)
_MAX_NAME = 40


class NoDistributedSampler(LoaderRule):
    """A distributed script's DataLoader over a map-style dataset has no sampler."""

    CODE = "DDP020"
    NAME = "no-distributed-sampler"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "this DataLoader has no sampler, so every rank iterates over the whole dataset; "
        "pass `sampler=DistributedSampler(dataset)`"
    )
    FIX = FixAvailability.SOMETIMES

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not is_distributed(model):
            return
        facts = self.facts
        for loader in facts.loaders:
            severity = _severity(loader, facts)
            if severity is not None:
                self.report(
                    loader.call.func,
                    _message(loader, severity),
                    severity=severity,
                    fix=self._fix(loader),
                )

    def _fix(self, loader: LoaderCall) -> NodeFix | None:
        dataset_arg, shuffle = loader.arg("dataset"), loader.arg("shuffle")
        spelling = sampler_spelling(self.context.imports)
        positional = [arg for arg in loader.call.args if arg.keyword is None]
        if (
            spelling is None
            or dataset_arg is None
            or type(dataset_arg.value) is not cst.Name
            or loader.arg("sampler") is not None
            or len(positional) > 2  # shuffle, or what follows it, given by position
        ):
            return None
        old_shuffle = self.context.code(shuffle.value) if shuffle is not None else "False"
        sampler = cst.parse_expression(
            f"{spelling}({dataset_arg.value.value}, shuffle={old_shuffle})"
        )
        new_arg = keyword_arg("sampler", sampler)
        if shuffle is not None:
            new_call = replace_with_keyword(loader.call, shuffle, new_arg, LOADER_PARAMETERS)
        else:
            new_call = insert_keyword_after(loader.call, dataset_arg, new_arg)
        if new_call is None:
            return None
        return NodeFix(
            f"Pass `sampler={spelling}(...)` (call its `set_epoch` every epoch)",
            ((loader.call, new_call),),
            Applicability.UNSAFE,
        )


def _severity(loader: LoaderCall, facts: LoaderFacts) -> Severity | None:
    """ERROR for a loader that plainly reads all the data on every rank, INFO when the
    dataset comes in as a parameter, None when the loader may well be right."""
    dataset = loader.dataset
    if dataset is None or loader.has_star_args or loader.where.rank_zero:
        return None
    if _has_sampler(loader):
        return None
    if _is_evaluation(loader, facts) or facts.is_streaming(dataset):
        return None
    if any("sampler" in param for param in loader.where.parameter_names()):
        return None  # a helper that is handed its sampler
    if any(_DIST_WORD.search(name) for test in loader.where.conditions for name in names_in(test)):
        return None  # `if not args.distributed: loader = DataLoader(...)`
    if _already_sharded(dataset, facts) or _has_sharded_twin(loader, facts):
        return None
    if dotted(dataset) in loader.where.parameter_names():
        return Severity.INFO
    return Severity.ERROR


def _has_sampler(loader: LoaderCall) -> bool:
    for key in ("sampler", "batch_sampler"):
        arg = loader.arg(key)
        if arg is not None and not is_none(arg.value):
            return True
    return False


def _is_evaluation(loader: LoaderCall, facts: LoaderFacts) -> bool:
    function = loader.where.function
    names = [loader.target, dotted(loader.dataset), function.name.value if function else None]
    if looks_like_eval(*names):
        return True
    for source in facts.dataset_sources(loader.dataset):
        call = unwrap_call_chain(source)
        if call is not None and is_eval_dataset_call(call):
            return True
    return False


def _already_sharded(dataset: cst.BaseExpression, facts: LoaderFacts) -> bool:
    """`MyDataset(..., rank=rank)`, `Subset(ds, idx[rank::world_size])`."""
    return any(
        _SHARD_WORD.search(name)
        for source in facts.dataset_sources(dataset)
        for name in names_in(source)
    )


def _has_sharded_twin(loader: LoaderCall, facts: LoaderFacts) -> bool:
    """Another loader of the same name or dataset has a sampler: the two are branches."""
    dataset = dotted(loader.dataset)
    for other in facts.loaders:
        if other is loader or not _has_sampler(other):
            continue
        if loader.target is not None and other.target == loader.target:
            return True
        if dataset is not None and dotted(other.dataset) == dataset:
            return True
    return False


def _short(code: str) -> bool:
    return len(code) <= _MAX_NAME and "\n" not in code


def _message(loader: LoaderCall, severity: Severity) -> str:
    subject = f"`{loader.target}`" if loader.target else "this DataLoader"
    dataset = dotted(loader.dataset)
    shown = dataset if dataset and _short(dataset) else None
    data = f"`{shown}`" if shown else "its dataset"
    sampler = f"`sampler=DistributedSampler({shown or 'dataset'})`"
    move = " and move `shuffle` into it" if loader.arg("shuffle") is not None else ""
    if severity is Severity.INFO:
        return (
            f"{subject} has no sampler; if {data} is a map-style training dataset, every rank "
            f"iterates over all of it: pass {sampler}{move}"
        )
    return (
        f"{subject} has no sampler, so every rank iterates over all of {data}; pass {sampler}{move}"
    )
