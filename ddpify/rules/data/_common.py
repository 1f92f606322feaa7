"""What the data rules share: the file's loader facts, "is this script distributed",
evaluation-loader names, and replacements that render right inside indented code."""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Callable

import libcst as cst

from ddpify.analysis.evaluation import looks_like_eval  # noqa: F401 - the data rules import it from here
from ddpify.analysis.loaders import DISTRIBUTED_SAMPLER, LoaderFacts
from ddpify.analysis.model import ScriptModel
from ddpify.analysis.names import ImportMap, find_arg
from ddpify.rules.base import Rule

if TYPE_CHECKING:
    from ddpify.engine import Context

# Calls that only a multi-process script makes.
DISTRIBUTED_CALLS = (
    "torch.distributed.init_process_group",
    "torch.distributed.device_mesh.init_device_mesh",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
)

_EVAL_SPLIT = re.compile(r"^(val|valid|validation|test|eval|evaluation|dev|holdout)$", re.I)


def is_distributed(model: ScriptModel) -> bool:
    """Whether the script initialises a process group or wraps a model for multi-process
    training (DDP, FSDP)."""
    return model.calls_any(*DISTRIBUTED_CALLS)


def is_eval_dataset_call(call: cst.Call) -> bool:
    """`MNIST(root, train=False)`, `load_dataset(..., split="validation")`."""
    for keyword in ("train", "is_train", "training"):
        arg = find_arg(call, keyword)
        if arg is not None and type(arg.value) is cst.Name and arg.value.value == "False":
            return True
    for keyword in ("split", "mode", "subset"):
        arg = find_arg(call, keyword)
        if arg is not None and type(arg.value) is cst.SimpleString:
            value = arg.value.evaluated_value
            if isinstance(value, str) and _EVAL_SPLIT.match(value):
                return True
    return False


def is_true_literal(expr: cst.BaseExpression) -> bool:
    if type(expr) is cst.Name:
        return expr.value == "True"
    if type(expr) is cst.Integer:
        return expr.evaluated_value != 0
    return False


def is_none(expr: cst.BaseExpression) -> bool:
    return type(expr) is cst.Name and expr.value == "None"


def sampler_spelling(imports: ImportMap) -> str | None:
    """How this file can name DistributedSampler without a new import, if it can."""
    for local in imports.aliases:
        if "." not in local and imports.qualify(cst.Name(local)) == DISTRIBUTED_SAMPLER:
            return local
    for local, full in imports.aliases.items():
        if full in {"torch.utils.data", "torch.utils.data.distributed"}:
            return f"{local}.DistributedSampler"
    if imports.aliases.get("torch") == "torch":
        return "torch.utils.data.DistributedSampler"
    return None


# -- sharing one LoaderFacts between the data rules -------------------------------------

_FACTS: weakref.WeakKeyDictionary[Context, LoaderFacts] = weakref.WeakKeyDictionary()
_FEEDERS: weakref.WeakKeyDictionary[Context, LoaderRule] = weakref.WeakKeyDictionary()
_FEEDING_HANDLERS = tuple(
    f"visit_{name}" for name in ("Call", "Attribute", "SimpleString", "For", "While", "ClassDef")
)


def facts_for(context: Context) -> LoaderFacts:
    facts = _FACTS.get(context)
    if facts is None:
        facts = _FACTS[context] = LoaderFacts(context.model, lambda: context.tree)
    return facts


class LoaderRule(Rule):
    """A rule that reads the file's LoaderFacts. Its handlers feed the one instance the
    data rules share (feeding a node twice is a no-op); subclasses decide in
    `leave_Module`, when the facts are complete.

    Only the first data rule of a file registers the feeding handlers: with eight data
    rules, dispatching every Call, Attribute and string to each of them would cost more
    than the facts themselves. (The engine calls the rules in the order they are built.)
    A subclass that overrides a handler keeps it and calls `super()` to feed.
    """

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.facts = facts_for(context)
        self.feeds = _FEEDERS.setdefault(context, self) is self

    def bound_handlers(self, prefix: str) -> dict[str, Callable[[cst.CSTNode], None]]:
        handlers = super().bound_handlers(prefix)
        if prefix == "visit_" and not self.feeds:
            for name in _FEEDING_HANDLERS:
                if getattr(type(self), name) is getattr(LoaderRule, name):
                    handlers.pop(name[len(prefix) :], None)
        return handlers

    def _feed(self, node: cst.CSTNode) -> None:
        self.facts.visit(node, self.context.ancestors)

    def visit_Call(self, node: cst.Call) -> None:
        self._feed(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._feed(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self._feed(node)

    def visit_For(self, node: cst.For) -> None:
        self._feed(node)

    def visit_While(self, node: cst.While) -> None:
        self._feed(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._feed(node)


def comments(node: cst.CSTNode) -> list[str]:
    found: list[str] = []

    class _Collect(cst.CSTVisitor):
        def visit_Comment(self, comment: cst.Comment) -> None:
            found.append(comment.value)

    node.visit(_Collect())
    return found
