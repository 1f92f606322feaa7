"""DDP044: gradient clipping between `scaler.scale(loss).backward()` and `scaler.step()`."""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted, method_name
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix, Rule
from ddpify.rules.training_loop._common import insert_before

CLIP_FUNCTIONS = {
    f"torch.nn.utils.{module}{name}"
    for module in ("", "clip_grad.")
    for name in ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
}
GRAD_SCALERS = (
    "torch.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
    "torch.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
)
_LOOPS = (cst.For, cst.While)
_UNITS = (cst.FunctionDef, cst.Module)


class Kind(enum.Enum):
    BACKWARD = "backward"  # `scaler.scale(loss).backward()`
    UNSCALE = "unscale"  # `scaler.unscale_(opt)`, or a helper that may unscale
    STEP = "step"  # `scaler.step(opt)`
    CLIP = "clip"


@dataclass(frozen=True)
class Event:
    kind: Kind
    scaler: str | None  # None: any scaler (a helper named `*unscale*`)
    call: cst.Call
    ancestors: tuple[cst.CSTNode, ...]


def _scaled_backward_receiver(call: cst.Call) -> str | None:
    """`scaler` for `scaler.scale(loss).backward()`."""
    if method_name(call) != "backward":
        return None
    inner = call.func.value  # type: ignore[attr-defined]
    if isinstance(inner, cst.Call) and method_name(inner) == "scale":
        return dotted(inner.func.value)  # type: ignore[attr-defined]
    return None


def _exclusive(a: tuple[cst.CSTNode, ...], b: tuple[cst.CSTNode, ...]) -> bool:
    """Whether two nodes sit in different branches of one `if`, so never both run."""
    for depth, (x, y) in enumerate(zip(a, b)):
        if x is not y:
            return depth > 0 and isinstance(a[depth - 1], cst.If)
    return False


def _loops(ancestors: tuple[cst.CSTNode, ...]) -> list[int]:
    return [id(node) for node in ancestors if isinstance(node, _LOOPS)]


def _branches(ancestors: tuple[cst.CSTNode, ...]) -> set[int]:
    """The `if` branches a node sits in (body or else), by identity."""
    return {
        id(child) for parent, child in zip(ancestors, ancestors[1:]) if isinstance(parent, cst.If)
    }


class ClipWithoutUnscale(Rule):
    """Clipping scaled gradients compares them to a threshold they exceed by the scale."""

    CODE = "DDP044"
    NAME = "clip-without-unscale"
    SEVERITY = Severity.ERROR
    MESSAGE = "gradients are clipped while still scaled by the GradScaler; call `unscale_` first"
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        # Events per function body (or the module), in source order.
        self.events: dict[int, list[Event]] = defaultdict(list)
        # Dotted names passed as arguments: a helper given the scaler may unscale it.
        self.passed: dict[int, list[tuple[str, int]]] = defaultdict(list)

    def visit_Call(self, node: cst.Call) -> None:
        event = self._classify(node)
        unit = self._unit()
        if event is not None:
            kind, scaler = event
            self.events[unit].append(Event(kind, scaler, node, tuple(self.context.ancestors)))
            return
        for arg in node.args:
            name = dotted(arg.value)
            if name is not None:
                self.passed[unit].append((name, len(self.events[unit])))

    def _unit(self) -> int:
        return id(self.context.enclosing(*_UNITS) or self.context.module)

    def _classify(self, call: cst.Call) -> tuple[Kind, str | None] | None:
        receiver = _scaled_backward_receiver(call)
        if receiver is not None:
            return Kind.BACKWARD, receiver
        if self.context.qualify(call.func) in CLIP_FUNCTIONS:
            return Kind.CLIP, None
        method = method_name(call)
        if method == "unscale_":
            return Kind.UNSCALE, dotted(call.func.value)  # type: ignore[attr-defined]
        if method == "step":
            return Kind.STEP, dotted(call.func.value)  # type: ignore[attr-defined]
        name = dotted(call.func)
        if name is not None and "unscale" in name.rsplit(".", 1)[-1].lower():
            return Kind.UNSCALE, None
        return None

    def leave_Module(self, node: cst.Module) -> None:
        bound = self.context.model.names_bound_to(*GRAD_SCALERS)
        for unit, events in self.events.items():
            scalers = {
                e.scaler
                for e in events
                if e.kind is Kind.BACKWARD and (e.scaler in bound or "scaler" in e.scaler.lower())
            }
            for index, event in enumerate(events):
                if event.kind is Kind.CLIP:
                    self._check_clip(events, index, scalers, self.passed[unit])

    def _check_clip(
        self, events: list[Event], index: int, scalers: set[str], passed: list[tuple[str, int]]
    ) -> None:
        clip = events[index]
        for scaler in sorted(scalers):
            backward = _neighbour(events, range(index - 1, -1, -1), scaler)
            if backward is None or events[backward].kind is not Kind.BACKWARD:
                continue
            if _exclusive(events[backward].ancestors, clip.ancestors):
                continue
            if any(name == scaler and backward < position <= index for name, position in passed):
                continue  # handed to a helper after the backward: it may unscale
            step = _neighbour(events, range(index + 1, len(events)), scaler)
            if step is None or events[step].kind is not Kind.STEP:
                continue
            if _exclusive(events[step].ancestors, clip.ancestors):
                continue
            self._report(clip, scaler, events[backward], events[step])
            return

    def _report(self, clip: Event, scaler: str, backward: Event, step: Event) -> None:
        optimizer = _single_name_argument(step.call)
        clip_name = dotted(clip.call.func) or "the clip"
        target = f"{scaler}.unscale_({optimizer or 'optimizer'})"
        message = f"`{clip_name}` clips gradients still scaled by `{scaler}`; call `{target}` first"
        fix = self._fix(clip, backward, step, target) if optimizer else None
        self.report(clip.call, message, fix=fix)

    def _fix(self, clip: Event, backward: Event, step: Event, target: str) -> NodeFix | None:
        # Inside a loop that does not also hold the step, unscale_ would run twice.
        if _loops(clip.ancestors) != _loops(step.ancestors):
            return None
        statement = _statement_of(clip)
        if statement is None:
            return None
        unscale = cst.SimpleStatementLine([cst.Expr(cst.parse_expression(target))])
        replacement = insert_before(self.context.module, clip.ancestors, statement, unscale)
        if replacement is None:
            return None
        # Clipping outside the `if use_amp:` that holds the step: with a scaler that is
        # None on the other path, the inserted call would fail there.
        guarded = _branches(backward.ancestors) | _branches(step.ancestors)
        safe = guarded <= _branches(clip.ancestors)
        applicability = Applicability.SAFE if safe else Applicability.UNSAFE
        return NodeFix(f"Insert `{target}` before clipping", (replacement,), applicability)


def _neighbour(events: list[Event], indices: range, scaler: str) -> int | None:
    """The first index in `indices` of a scaler event that concerns `scaler`."""
    for index in indices:
        event = events[index]
        if event.kind is not Kind.CLIP and event.scaler in (scaler, None):
            return index
    return None


def _single_name_argument(call: cst.Call) -> str | None:
    """`opt` for `scaler.step(opt)`: a plain name, so repeating it has no side effect."""
    if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
        return None
    return dotted(call.args[0].value)


def _statement_of(clip: Event) -> cst.SimpleStatementLine | None:
    """The line holding only `clip(...)` or `norm = clip(...)`."""
    ancestors = clip.ancestors
    if len(ancestors) < 3:
        return None
    line, small = ancestors[-3], ancestors[-2]
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    if isinstance(small, (cst.Expr, cst.Assign, cst.AnnAssign)) and small.value is clip.call:
        return line
    return None
