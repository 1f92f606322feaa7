"""DDP041: a distributed script keeps the learning rate tuned for one GPU.

Off by default: the rule cannot see whether `args.lr` was already tuned at the
multi-GPU global batch, and linear scaling is a heuristic (Adam-style optimizers
often want less), so on correct scripts it is noise more often than not.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.names import dotted, find_arg
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.training_loop._common import is_distributed

_LR_NAME = re.compile(r"^(base_|init_|initial_|max_|peak_|default_)?(lr|learning_rate)$", re.I)
_LR_WORD = re.compile(r"(^|_)lr($|_)|learning_?rate", re.I)
_WORLD_WORD = re.compile(
    r"world|replicas|nprocs?$|num_proc|num_processes|^n_?gpus?$|num_gpus?|ngpus|^gpus$"
    r"|device_count|num_devices|n_devices",
    re.I,
)
_BATCH_WORD = re.compile(r"batch|(^|_)bs($|_)", re.I)
_NOT_OPTIMIZERS = {"Optimizer", "LBFGS"}  # the base class; LBFGS is tuned per problem


def _is_optimizer(name: str | None) -> bool:
    if name is None or not name.startswith("torch.optim."):
        return False
    parts = name.split(".")
    return len(parts) <= 4 and parts[-1][:1].isupper() and parts[-1] not in _NOT_OPTIMIZERS


def _literal_key(node: cst.Subscript) -> str | None:
    index = node.slice[0].slice if len(node.slice) == 1 else None
    if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
        value = index.value.evaluated_value
        return value if isinstance(value, str) else None
    return None


def looks_unscaled(expr: cst.BaseExpression) -> bool:
    """A number, or a name that reads a configured learning rate: `args.lr`, `cfg["lr"]`."""
    if isinstance(expr, (cst.Integer, cst.Float)):
        return True
    if isinstance(expr, cst.Subscript):
        key = _literal_key(expr)
        return key is not None and bool(_LR_NAME.match(key))
    name = dotted(expr)
    return name is not None and bool(_LR_NAME.match(name.rsplit(".", 1)[-1]))


def _words(node: cst.CSTNode) -> list[str]:
    """Identifiers and string literals in `node` (`os.environ["WORLD_SIZE"]` counts)."""
    found: list[str] = []

    class _Collect(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.append(n.value)

        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            value = n.evaluated_value
            if isinstance(value, str):
                found.append(value)

    node.visit(_Collect())
    return found


def _mentions(words: list[str], pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(word) for word in words)


class _ScalingFinder(cst.CSTVisitor):
    """Anything that adapts the LR or the batch to the number of processes."""

    def __init__(self) -> None:
        self.found = False

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> bool:
        if not isinstance(node.operator, (cst.Multiply, cst.Divide, cst.FloorDivide)):
            return True
        words = _words(node)
        scaled_by = _mentions(words, _WORLD_WORD) or _mentions(words, _BATCH_WORD)
        if _mentions(words, _LR_WORD) and scaled_by:
            self.found = True  # `args.lr * world_size`, `base_lr * total_batch / 256`
        divides = isinstance(node.operator, (cst.Divide, cst.FloorDivide))
        if divides and _mentions(_words(node.right), _WORLD_WORD):
            self.found = True  # `batch_size // world_size`: the global batch is unchanged
        return not self.found

    def visit_Assign(self, node: cst.Assign) -> None:
        targets = [w for target in node.targets for w in _words(target.target)]
        self._scaled_assignment(targets, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, (cst.MultiplyAssign, cst.DivideAssign, cst.FloorDivideAssign)):
            self._scaled_assignment(_words(node.target), node.value, direct=True)

    def visit_Call(self, node: cst.Call) -> None:
        words = [w for arg in node.args for w in _words(arg.value)]
        if _mentions(words, _LR_WORD) and _mentions(words, _WORLD_WORD):
            self.found = True  # `scale_lr(args.lr, world_size)`

    def _scaled_assignment(
        self, targets: list[str], value: cst.BaseExpression, direct: bool = False
    ) -> None:
        """`lr = 0.1 * world_size`, `args.lr *= dist.get_world_size()`."""
        if not _mentions(targets, _LR_WORD):
            return
        arithmetic = direct or isinstance(value, cst.BinaryOperation)
        words = _words(value)
        if arithmetic and (_mentions(words, _WORLD_WORD) or _mentions(words, _BATCH_WORD)):
            self.found = True


class LrNotScaled(Rule):
    """N processes make the global batch N times larger; the LR usually has to follow."""

    CODE = "DDP041"
    NAME = "lr-not-scaled"
    SEVERITY = Severity.INFO
    MESSAGE = "the learning rate is the single-GPU value although the global batch is N× larger"
    DEFAULT_ENABLED = False

    def __init__(self, context) -> None:
        super().__init__(context)
        self.candidates: list[tuple[cst.Call, cst.BaseExpression]] = []

    def visit_Call(self, node: cst.Call) -> None:
        if not _is_optimizer(self.context.qualify(node.func)):
            return
        lr = find_arg(node, "lr", 1)
        if lr is not None and not lr.star and self._unscaled(lr.value):
            self.candidates.append((node, lr.value))

    def _unscaled(self, expr: cst.BaseExpression) -> bool:
        if not looks_unscaled(expr):
            return False
        name = dotted(expr)
        bound = self.context.model.bindings.get(name, []) if name else []
        return all(looks_unscaled(value) for value in bound)

    def leave_Module(self, node: cst.Module) -> None:
        if not self.candidates or self.context.model.framework is not None:
            return
        if not is_distributed(self.context):
            return
        finder = _ScalingFinder()
        node.visit(finder)
        if finder.found:
            return
        for call, lr in self.candidates:
            self.report(lr, _message(dotted(call.func) or "the optimizer", self.context.code(lr)))


def _message(optimizer: str, lr: str) -> str:
    return (
        f"`{optimizer}` gets `lr={lr}`, tuned for one GPU, while the global batch grows with "
        f"the world size; scale it (e.g. `{lr} * dist.get_world_size()`, with warmup) or divide "
        "the per-rank batch size by the world size"
    )
