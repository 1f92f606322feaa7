"""DDP042: a learning-rate schedule sized from `len(dataset)` while the data is sharded.

With a DistributedSampler each rank runs `len(dataset) / (batch * world_size)` steps per
epoch; a schedule built for `len(dataset) / batch` steps per epoch is N times too long,
so warmup and decay run N times too slowly. The rule follows the scheduler's arguments
through the assignments of the names they use (`total_steps = steps_per_epoch * epochs`,
`steps_per_epoch = len(train_ds) // bs`) to a `len(...)` of a sharded loader's dataset,
and stays quiet when the world size appears anywhere along the way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.training import (
    DATALOADER,
    ShardedLoader,
    names_of,
    sampled_datasets,
    sharded_loaders,
    walk_subtree,
)
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.training_loop._common import LoopRule

_HF_SCHEDULES = re.compile(r"^get_\w*(schedule|scheduler)\w*$")
_WORLD = re.compile(
    r"world|replicas|nprocs|num_processes|num_gpus|n_gpus?$|ngpus?$|^gpus$|device_count|"
    r"num_devices|num_nodes",
    re.I,
)
_MAX_DEPTH = 4  # assignments followed from a scheduler argument


@dataclass(frozen=True)
class _Placed:
    order: int  # visit order of the call, to tell "before" from "after"
    function: cst.CSTNode | None


class ScheduleStepsFromDataset(LoopRule):
    """The LR schedule counts the steps of one process reading the whole dataset."""

    CODE = "DDP042"
    NAME = "schedule-steps-from-dataset"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "the scheduler's step count comes from `len(dataset)`, but each rank sees 1/N of "
        "it per epoch; use `len(loader)`"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.schedulers: list[cst.Call] = []
        self.placed: dict[int, _Placed] = {}
        self.order = 0

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        func = node.func
        if type(func) is cst.Name and func.value == "len":
            self._place(node)
            return
        last = func.attr.value if type(func) is cst.Attribute else getattr(func, "value", "")
        if not (isinstance(last, str) and (last[:1].isupper() or last.startswith("get_"))):
            return  # loaders and schedulers are classes or `get_*` factories
        qualified = self.context.qualify(func)
        if qualified == DATALOADER:
            self._place(node)
        elif _is_scheduler(qualified, func):
            self.schedulers.append(node)

    def _place(self, node: cst.Call) -> None:
        self.placed[id(node)] = _Placed(self.order, self.context.enclosing(cst.FunctionDef))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.schedulers or not self.applies():
            return
        model = self.context.model
        loaders = sharded_loaders(model, self.context.tree)
        if not loaders:
            return
        datasets = {loader.dataset for loader in loaders if loader.dataset}
        datasets |= sampled_datasets(model)
        datasets |= {f"{loader.target}.dataset" for loader in loaders if loader.target}
        reported: set[int] = set()
        for scheduler in self.schedulers:
            expressions = self._sources(scheduler)
            if any(_mentions_world(expr) for expr in expressions):
                continue
            for length in _dataset_lengths(expressions, datasets):
                if id(length) not in reported:
                    reported.add(id(length))
                    self._report(length, scheduler, expressions, loaders)

    def _sources(self, scheduler: cst.Call) -> list[cst.CSTNode]:
        """The scheduler's arguments and, transitively, the values of the names in them."""
        bindings = self.context.model.bindings
        # Not the optimizer (the first argument): its LR may scale with the world size,
        # which says nothing about the step count.
        found: list[cst.CSTNode] = [
            arg.value
            for index, arg in enumerate(scheduler.args)
            if not (index == 0 and arg.keyword is None)
            and not (arg.keyword is not None and arg.keyword.value == "optimizer")
        ]
        seen: set[str] = set()
        frontier = list(found)
        for _ in range(_MAX_DEPTH):
            following = []
            for expr in frontier:
                for name in names_of(expr) - seen:
                    seen.add(name)
                    following.extend(bindings.get(name, ()))
            found.extend(following)
            frontier = following
        return found

    def _report(
        self,
        length: cst.Call,
        scheduler: cst.Call,
        expressions: list[cst.CSTNode],
        loaders: list[ShardedLoader],
    ) -> None:
        dataset = self.context.code(length.args[0].value)
        loader = _loader_over(loaders, dotted(length.args[0].value))
        loader_name = loader.target if loader is not None and loader.target else "loader"
        schedule = dotted(scheduler.func) or "the scheduler"
        message = (
            f"`{schedule}` is sized from `len({dataset})`, but with a DistributedSampler each "
            f"rank runs only 1/N of it per epoch, so the schedule is N times too long (warmup "
            f"and decay N times too slow); count steps with `len({loader_name})`"
        )
        self.report(length, message, fix=self._fix(length, expressions, loader))

    def _fix(
        self, length: cst.Call, expressions: list[cst.CSTNode], loader: ShardedLoader | None
    ) -> NodeFix | None:
        """`len(ds) // bs` -> `len(loader)` when `bs` is the loader's batch size and the
        loader is built before, in the same function (or at module level)."""
        if loader is None or loader.target is None or loader.batch_size is None:
            return None
        division = _division_of(length, expressions)
        if division is None:
            return None
        batch = self.context.code(loader.batch_size).strip()
        if self.context.code(division.right).strip() != batch:
            return None
        here, built = self.placed.get(id(length)), self.placed.get(id(loader.call))
        if here is None or built is None or built.order > here.order:
            return None
        if built.function is not None and built.function is not here.function:
            return None
        replaced: cst.BaseExpression = _rounding_of(division, expressions) or division
        replacement = cst.parse_expression(f"len({loader.target})")
        replacement = replacement.with_changes(lpar=replaced.lpar, rpar=replaced.rpar)
        return NodeFix(
            f"Count the steps with `len({loader.target})` (rounding may differ by one step "
            "when the loader keeps its last partial batch)",
            ((replaced, replacement),),
            Applicability.UNSAFE,
        )


def _is_scheduler(qualified: str | None, func: cst.BaseExpression) -> bool:
    if qualified is not None:
        if qualified.startswith(("torch.optim.lr_scheduler.", "timm.scheduler.")):
            return qualified.rsplit(".", 1)[-1][:1].isupper()
        return bool(_HF_SCHEDULES.match(qualified.rsplit(".", 1)[-1]))
    return False


def _mentions_world(expr: cst.CSTNode) -> bool:
    for node in walk_subtree(expr):
        if type(node) is cst.Name and _WORLD.search(node.value):
            return True
        if type(node) is cst.SimpleString and "WORLD_SIZE" in node.value:
            return True
    return False


def _dataset_lengths(expressions: list[cst.CSTNode], datasets: set[str]) -> list[cst.Call]:
    found = []
    for expr in expressions:
        for node in walk_subtree(expr):
            if (
                type(node) is cst.Call
                and type(node.func) is cst.Name
                and node.func.value == "len"
                and len(node.args) == 1
                and dotted(node.args[0].value) in datasets
            ):
                found.append(node)
    return found


def _loader_over(loaders: list[ShardedLoader], dataset: str | None) -> ShardedLoader | None:
    for loader in loaders:
        if dataset in (loader.dataset, f"{loader.target}.dataset"):
            return loader
    return None


def _division_of(length: cst.Call, expressions: list[cst.CSTNode]) -> cst.BinaryOperation | None:
    """The `len(ds) // bs` (or `/`) whose left side is `length`."""
    for expr in expressions:
        for node in walk_subtree(expr):
            if (
                type(node) is cst.BinaryOperation
                and node.left is length
                and type(node.operator) in (cst.FloorDivide, cst.Divide)
            ):
                return node
    return None


def _rounding_of(division: cst.BinaryOperation, expressions: list[cst.CSTNode]) -> cst.Call | None:
    """`math.ceil(<division>)` or `int(<division>)`: replaced whole by the fix."""
    for expr in expressions:
        for node in walk_subtree(expr):
            if (
                type(node) is cst.Call
                and len(node.args) == 1
                and node.args[0].value is division
                and (dotted(node.func) or "").rsplit(".", 1)[-1] in {"ceil", "floor", "int"}
            ):
                return node
    return None
