"""DDP054: a metric summed over a sharded loader is logged without a reduction.

A value accumulated (`correct += ...`, `meter.update(...)`, `preds.append(...)`) in a
loop over a loader that a DistributedSampler shards, or in an evaluation loop drawing
batches by hand from a loader of the script's own given the rank and world size
(`for _ in range(n): x, y = val_loader.next_batch()`), or computed from such a value,
is this rank's share of the data. Logged (print, logger, writer, wandb) without
passing through a collective or a helper named for reducing (rank-0 printing helpers
such as `print0` count as logging), it is reported: a warning
for evaluation (the loop runs under `no_grad`/`inference_mode`, or its loader or
function reads as validation), info for a training loss, which many scripts log from
rank 0 on purpose. A value returned from the loop's function is followed to the callers
that log it. A log line that names the rank is per-rank on purpose and stays quiet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.training import (
    CallIndex,
    Located,
    arguments_for,
    iterated_names,
    loop_facts_for,
    names_of,
    own_nodes,
    rank_sharded_streams,
    reduced_names,
    sharded_loaders,
    walk_subtree,
)
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.rank_zero._common import mentions_rank
from ddpify.walk import children

_LOG_CALLS = {
    "print",
    "info",
    "warning",
    "debug",
    "log",
    "add_scalar",
    "add_scalars",
    "log_metric",
    "log_metrics",
    "log_dict",
}
_TRACKERS = {"add_scalar", "add_scalars", "log_metric", "log_metrics", "log_dict"}
_EVAL_WORD = re.compile(
    r"(^|_)(val|valid|validate|validation|test|eval|evaluate|evaluation|dev)($|_)"
)
_RANK_ZERO_LOG = re.compile(r"(print|log)_?(0|rank_?0|rank_?zero|master|main)$")
_NO_GRAD = {"no_grad", "inference_mode"}
_GATHERING = {"append", "extend", "update"}
_PROGRESS = re.compile(r"bar|progress|tqdm", re.I)  # `preds.append(...)`, `meter.update(...)`


@dataclass(frozen=True)
class _Metrics:
    """Names holding one loop's local values, and where they came from."""

    loop: Located
    loader: str
    accumulators: list[str]
    family: set[str]  # the accumulators and everything computed from them
    evaluation: bool


class UnreducedMetrics(Rule):
    """Each rank sees 1/N of a sharded loader; its sums are not the dataset's."""

    CODE = "DDP054"
    NAME = "unreduced-metrics"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "this metric covers this rank's shard of the data only; all-reduce it before "
        "logging it as the whole dataset's"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.loops = loop_facts_for(context)
        self.index: CallIndex | None = None

    def visit_For(self, node: cst.For) -> None:
        self.loops.visit(node, self.context.ancestors)

    def visit_While(self, node: cst.While) -> None:
        self.loops.visit(node, self.context.ancestors)

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not model.is_distributed or not self.loops.loops:
            return
        loaders = {
            loader.target for loader in sharded_loaders(model, self.context.tree) if loader.target
        }
        loaders |= rank_sharded_streams(model)
        if not loaders:
            return
        reduced: set[str] | None = None
        reported: set[int] = set()
        for loop in self.loops.loops:
            metrics = self._metrics(loop, loaders)
            if metrics is None:
                continue
            if reduced is None:
                reduced = reduced_names(model, node)
            if metrics.family & reduced:
                continue
            for call, names in self._logged(metrics, node, reduced):
                if id(call) not in reported:
                    reported.add(id(call))
                    self._report(call, names, metrics)

    # -- what the loop accumulates ----------------------------------------------------

    def _metrics(self, loop: Located, loaders: set[str]) -> _Metrics | None:
        if type(loop.node) is not cst.For:
            return None
        iterated = iterated_names(loop.node, self.context.tree)
        over = sorted(iterated & loaders)
        function = loop.function()
        losses_only = False
        if not over and not (function and iterated & _parameters(function)):
            # `for _ in range(n): x, y = val_loader.next_batch()`: batches drawn by hand.
            over = _drawn_from(loop.node, loaders)
            if not over:
                return None  # cheap tests first: most loops run over `range(epochs)`
            # A training loop's own sums are timings and counters too: only its losses.
            losses_only = not _is_evaluation(loop, over[0])
        accumulators = _accumulators(loop.node)
        if losses_only:
            accumulators = [name for name in accumulators if _adds_a_loss(loop.node, name)]
        if not accumulators:
            return None
        if not over:
            over = self._sharded_parameter(loop, loaders)
        if not over:
            return None
        scope = loop.function() or loop.ancestors[0]
        family = _derived(scope, set(accumulators))
        evaluation = _is_evaluation(loop, over[0])
        return _Metrics(loop, over[0], accumulators, family, evaluation)

    def _sharded_parameter(self, loop: Located, loaders: set[str]) -> list[str]:
        """`for x, y in loader:` over a parameter every call fills with a sharded loader."""
        function = loop.function()
        if function is None:
            return []
        for name in sorted(iterated_names(loop.node, self.context.tree)):
            passed = arguments_for(self._index(), function, name)
            if passed and all(dotted(value) in loaders for value in passed):
                return [dotted(passed[0])]  # type: ignore[list-item]
        return []

    # -- where it is logged ------------------------------------------------------------

    def _logged(
        self, metrics: _Metrics, module: cst.Module, reduced: set[str]
    ) -> list[tuple[cst.Call, set[str]]]:
        """Log calls of the loop's function that show the family, after the loop, and
        those of callers that log what the function returns."""
        scope = metrics.loop.function() or module
        after = _after(scope, metrics.loop.node)
        found = [
            (call, shown) for call, shown in _log_calls(scope, metrics.family) if id(call) in after
        ]
        function = metrics.loop.function()
        if function is not None and _returns(function, metrics.family):
            callers = self._returned_to(function.name.value, module)
            if callers and not callers & reduced:
                found += _log_calls(module, callers)
        return found

    def _index(self) -> CallIndex:
        if self.index is None:
            self.index = CallIndex(self.context.module)
        return self.index

    def _returned_to(self, function: str, module: cst.Module) -> set[str]:
        """Names assigned the result of `function(...)` / `self.function(...)`, also
        unpacked (`accuracy, loss = evaluate(...)`)."""
        targets: set[str] = set()
        for node in self._index().assigns:
            if type(node.value) is cst.Call and _last(node.value.func) == function:
                for target in node.targets:
                    targets.update(_target_names(target.target))
        return targets

    def _splitter(self, metrics: _Metrics) -> str:
        if metrics.loader in rank_sharded_streams(self.context.model):
            return "the loader, given the rank and world size, splits it"
        return "a DistributedSampler splits it"

    def _report(self, call: cst.Call, names: set[str], metrics: _Metrics) -> None:
        shown = ", ".join(f"`{name}`" for name in sorted(names)[:3])
        sums = ", ".join(f"`{name}`" for name in metrics.accumulators[:3])
        where = f"`{metrics.loader}`"
        if metrics.evaluation:
            message = (
                f"{shown} comes from this rank's shard of {where} ({self._splitter(metrics)}), "
                f"but is logged as the whole dataset's; all-reduce {sums} "
                "(`dist.all_reduce`) on every rank before computing it"
            )
            self.report(call, message)
            return
        message = (
            f"{shown} covers this rank's shard of {where} only; all-reduce {sums} if the "
            "logged value should cover all ranks"
        )
        self.report(call, message, severity=Severity.INFO)


def _last(expr: cst.BaseExpression) -> str:
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name else ""


def _drawn_from(loop: cst.For, loaders: set[str]) -> list[str]:
    """Loaders the loop body draws batches from by hand: `loader.next_batch()`,
    `next(loader)`."""
    found = set()
    for node in own_nodes(loop.body):
        if type(node) is not cst.Call:
            continue
        if type(node.func) is cst.Attribute:
            receiver = dotted(node.func.value)
        elif type(node.func) is cst.Name and node.func.value == "next" and node.args:
            receiver = dotted(node.args[0].value)
        else:
            continue
        if receiver in loaders:
            found.add(receiver)
    return sorted(found)


def _accumulators(loop: cst.For) -> list[str]:
    """`total += loss.item()`, `meter.update(acc)`, `preds.append(out)` in the loop body
    (not step counters: `step += 1`)."""
    found: list[str] = []
    for node in own_nodes(loop.body):
        name = None
        if type(node) is cst.AugAssign and type(node.operator) is cst.AddAssign:
            if type(node.value) not in (cst.Integer, cst.Float):
                name = _accumulated(node.target)
        elif type(node) is cst.Call and type(node.func) is cst.Attribute:
            if node.func.attr.value in _GATHERING and node.args:
                name = dotted(node.func.value)
                if name is not None and _PROGRESS.search(name.rsplit(".", 1)[-1]):
                    name = None  # `pbar.update(1)` counts batches, not a metric
        if name is not None and name not in found:
            found.append(name)
    return found


def _adds_a_loss(loop: cst.For, name: str) -> bool:
    """`lossf += loss.item()`: the loop adds a loss (a name that says so) to `name`."""
    for node in own_nodes(loop.body):
        if type(node) is cst.AugAssign and _accumulated(node.target) == name:
            if any("loss" in n.value.lower() for n in _names_in(node.value)):
                return True
    return False


def _names_in(expr: cst.CSTNode) -> list[cst.Name]:
    found, stack = [], [expr]
    while stack:
        node = stack.pop()
        if type(node) is cst.Name:
            found.append(node)
        stack.extend(children(node))
    return found


def _accumulated(target: cst.BaseExpression) -> str | None:
    """`total` of `total += x`, `counts` of `counts[0] += x`; not `state["step"] += x`,
    a dict of unrelated counters whose other entries are no metric."""
    if type(target) is cst.Subscript:
        index = target.slice[0].slice if len(target.slice) == 1 else None
        if type(index) is cst.Index and type(index.value) is cst.SimpleString:
            return None
        target = target.value
    return dotted(target)


def _derived(scope: cst.CSTNode, family: set[str]) -> set[str]:
    """`family` and the names assigned from it in `scope`, transitively."""
    assigns = [n for n in own_nodes(scope) if type(n) in (cst.Assign, cst.AnnAssign)]
    changed = True
    while changed:
        changed = False
        for assign in assigns:
            if assign.value is None or not names_of(assign.value) & family:
                continue
            targets = assign.targets if type(assign) is cst.Assign else [assign]
            for target in targets:
                for name in _target_names(target.target):
                    if name not in family:
                        family.add(name)
                        changed = True
    return family


def _target_names(target: cst.BaseExpression) -> list[str]:
    if type(target) in (cst.Tuple, cst.List):
        return [n for element in target.elements for n in _target_names(element.value)]
    name = dotted(target)
    return [name] if name else []


def _log_calls(scope: cst.CSTNode, family: set[str]) -> list[tuple[cst.Call, set[str]]]:
    found = []
    for node in walk_subtree(scope):
        if type(node) is not cst.Call or not _is_log_call(node):
            continue
        shown = set()
        for arg in node.args:
            shown |= names_of(arg.value) & family
        if shown and not any(mentions_rank(arg.value) for arg in node.args):
            found.append((node, shown))
    return found


def _is_log_call(call: cst.Call) -> bool:
    """`print`, `logger.info`, `writer.add_scalar`, and the rank-0 printing helpers
    scripts define (`print0`, `print_rank_0`, `log_master`)."""
    last = _last(call.func)
    return last in _LOG_CALLS or bool(_RANK_ZERO_LOG.match(last))


def _returns(function: cst.FunctionDef, family: set[str]) -> bool:
    return any(
        type(node) is cst.Return and node.value is not None and names_of(node.value) & family
        for node in own_nodes(function)
    )


def _is_evaluation(loop: Located, loader: str) -> bool:
    """The loop runs without gradients, or its loader or function reads as evaluation."""
    for node in loop.ancestors:
        if type(node) is cst.With:
            for item in node.items:
                call = item.item
                if type(call) is cst.Call and _last(call.func) in _NO_GRAD:
                    return True
        if type(node) is cst.FunctionDef:
            for decorator in node.decorators:
                expr = decorator.decorator
                if _last(expr.func if type(expr) is cst.Call else expr) in _NO_GRAD:
                    return True
    function = loop.function()
    words = [loader.rsplit(".", 1)[-1].lower()]
    if function is not None:
        words.append(function.name.value.lower())
    return any(_EVAL_WORD.search(word) for word in words)


def _after(scope: cst.CSTNode, loop: cst.CSTNode) -> set[int]:
    """Nodes of `scope` that come after `loop` in source order (not inside it)."""
    order = list(walk_subtree(scope))
    inside = {id(n) for n in walk_subtree(loop)}
    start = next(i for i, n in enumerate(order) if n is loop)
    return {id(n) for n in order[start:] if id(n) not in inside}


def _parameters(function: cst.FunctionDef) -> set[str]:
    params = function.params
    return {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
