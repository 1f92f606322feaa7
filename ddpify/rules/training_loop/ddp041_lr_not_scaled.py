"""DDP041: a distributed script keeps the learning rate tuned for one GPU.

Off by default: the rule cannot see whether `args.lr` was already tuned at the
multi-GPU global batch, and linear scaling is a heuristic (Adam-style optimizers
often want less), so on correct scripts it is noise more often than not.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.roles import is_optimizer, replicated_steps, train_loaders
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.training_loop._common import descendants

_LR_NAME = re.compile(r"^(base_|init_|initial_|max_|peak_|default_)?(lr|learning_rate)$", re.I)
_LR_WORD = re.compile(r"(^|_)lr($|_)|learning_?rate", re.I)
_WORLD_WORD = re.compile(
    r"world|replicas|nprocs?$|num_proc|num_processes|^n_?gpus?$|num_gpus?|ngpus|^gpus$"
    r"|device_count|num_devices|n_devices",
    re.I,
)
_BATCH_WORD = re.compile(r"batch|(^|_)bs($|_)", re.I)
# LBFGS is an optimizer (analysis/roles.py), but its step size is tuned per problem.
_NOT_SCALED = {"LBFGS"}


def _scales_with_batch(name: str) -> bool:
    """An optimizer whose learning rate follows the global batch: all but LBFGS."""
    return is_optimizer(name) and name.rsplit(".", 1)[-1] not in _NOT_SCALED


def _literal_key(node: cst.Subscript) -> str | None:
    index = node.slice[0].slice if len(node.slice) == 1 else None
    if type(index) is cst.Index and type(index.value) is cst.SimpleString:
        value = index.value.evaluated_value
        return value if isinstance(value, str) else None
    return None


def looks_unscaled(expr: cst.BaseExpression) -> bool:
    """A number, or a name that reads a configured learning rate: `args.lr`, `cfg["lr"]`."""
    if type(expr) in (cst.Integer, cst.Float):
        return True
    if type(expr) is cst.Subscript:
        key = _literal_key(expr)
        return key is not None and bool(_LR_NAME.match(key))
    name = dotted(expr)
    return name is not None and bool(_LR_NAME.match(name.rsplit(".", 1)[-1]))


def _words(node: cst.CSTNode) -> list[str]:
    """Identifiers and string literals in `node` (`os.environ["WORLD_SIZE"]` counts)."""
    found = []
    for child in (node, *descendants(node)):
        if type(child) is cst.Name:
            found.append(child.value)
        elif type(child) is cst.SimpleString:
            value = child.evaluated_value
            if isinstance(value, str):
                found.append(value)
    return found


def _mentions(words: list[str], pattern: re.Pattern[str]) -> bool:
    return any(pattern.search(word) for word in words)


def _scales_lr_or_batch(node: cst.BinaryOperation) -> bool:
    """`args.lr * world_size`, `base_lr * total_batch / 256`, `batch_size // world_size`."""
    if type(node.operator) not in (cst.Multiply, cst.Divide, cst.FloorDivide):
        return False
    words = _words(node)
    by_world_or_batch = _mentions(words, _WORLD_WORD) or _mentions(words, _BATCH_WORD)
    if _mentions(words, _LR_WORD) and by_world_or_batch:
        return True
    # Dividing (the batch) by the world size keeps the global batch of one GPU.
    divides = type(node.operator) in (cst.Divide, cst.FloorDivide)
    return divides and _mentions(_words(node.right), _WORLD_WORD)


def _scaled_assignment(targets: list[str], value: cst.BaseExpression, direct: bool = False) -> bool:
    """`lr = 0.1 * world_size`, `args.lr *= dist.get_world_size()`."""
    if not _mentions(targets, _LR_WORD):
        return False
    if not (direct or type(value) is cst.BinaryOperation):
        return False
    words = _words(value)
    return _mentions(words, _WORLD_WORD) or _mentions(words, _BATCH_WORD)


def _adapts_to_world(node: cst.CSTNode) -> bool:
    """Whether `node` adapts the LR or the batch to the number of processes."""
    if type(node) is cst.BinaryOperation:
        return _scales_lr_or_batch(node)
    if type(node) is cst.Assign:
        targets = [word for target in node.targets for word in _words(target.target)]
        return _scaled_assignment(targets, node.value)
    if type(node) is cst.AugAssign:
        scaling = (cst.MultiplyAssign, cst.DivideAssign, cst.FloorDivideAssign)
        return isinstance(node.operator, scaling) and _scaled_assignment(
            _words(node.target), node.value, direct=True
        )
    if type(node) is cst.Call:  # `scale_lr(args.lr, world_size)`
        words = [word for arg in node.args for word in _words(arg.value)]
        return _mentions(words, _LR_WORD) and _mentions(words, _WORLD_WORD)
    return False


class LrNotScaled(Rule):
    """N processes make the global batch N times larger; the LR usually has to follow."""

    CODE = "DDP041"
    NAME = "lr-not-scaled"
    SEVERITY = Severity.INFO
    MESSAGE = "the learning rate is the single-GPU value although the global batch is N× larger"
    DEFAULT_ENABLED = False

    def _candidates(self) -> list[tuple[cst.Call, cst.BaseExpression]]:
        found = []
        for name, calls in self.context.model.calls.items():
            if not _scales_with_batch(name):
                continue
            for call in calls:
                lr = find_arg(call, "lr", 1)
                if lr is not None and not lr.star and self._unscaled(lr.value):
                    found.append((call, lr.value))
        return found

    def _unscaled(self, expr: cst.BaseExpression) -> bool:
        if not looks_unscaled(expr):
            return False
        name = dotted(expr)
        bound = self.context.model.bindings.get(name, []) if name else []
        return all(looks_unscaled(value) for value in bound)

    def leave_Module(self, node: cst.Module) -> None:
        if self.context.model.framework is not None:
            return
        candidates = self._candidates()
        if not candidates or not self.context.model.is_distributed:
            return
        if any(_adapts_to_world(child) for child in descendants(node)):
            return
        if self._replicated_only():
            return
        for call, lr in candidates:
            self.report(lr, _message(dotted(call.func) or "the optimizer", self.context.code(lr)))

    def _replicated_only(self) -> bool:
        """Every training step runs whole on every rank (a carried state, a full batch:
        `roles.replicated_steps`) and no DataLoader feeds one: the global batch is the
        original's at any world size, so its learning rate is still right."""
        tree = self.context.tree
        loaders, _ = train_loaders(tree)
        return not loaders and bool(replicated_steps(tree))


def _message(optimizer: str, lr: str) -> str:
    return (
        f"`{optimizer}` gets `lr={lr}`, tuned for one GPU, while the global batch grows with "
        f"the world size; scale it (e.g. `{lr} * dist.get_world_size()`, with warmup) or divide "
        "the per-rank batch size by the world size"
    )
