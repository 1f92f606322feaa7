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
    if type(inner) is cst.Call and method_name(inner) == "scale":
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
    return {id(child) for parent, child in zip(ancestors, ancestors[1:]) if type(parent) is cst.If}


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
        # Other calls with the number of events before them: a helper handed the scaler
        # between the backward and the clip may unscale it.
        self.others: dict[int, list[tuple[cst.Call, int]]] = defaultdict(list)
        self.units: list[int] = [id(context.module)]

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.units.append(id(node))

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.units.pop()

    def visit_Call(self, node: cst.Call) -> None:
        unit = self.units[-1]
        event = self._classify(node)
        if event is None:
            if node.args:
                self.others[unit].append((node, len(self.events[unit])))
            return
        kind, scaler = event
        self.events[unit].append(Event(kind, scaler, node, tuple(self.context.ancestors)))

    def _classify(self, call: cst.Call) -> tuple[Kind, str | None] | None:
        func = call.func
        if type(func) is cst.Attribute:
            last = func.attr.value
        elif type(func) is cst.Name:
            last = func.value
        else:
            return None
        if last == "backward":
            receiver = _scaled_backward_receiver(call)
            return (Kind.BACKWARD, receiver) if receiver is not None else None
        if last.startswith("clip_grad"):
            return (Kind.CLIP, None) if self.context.qualify(func) in CLIP_FUNCTIONS else None
        if type(func) is cst.Attribute and last in ("unscale_", "step"):
            kind = Kind.UNSCALE if last == "unscale_" else Kind.STEP
            return kind, dotted(func.value)
        if "unscale" in last.lower():
            return Kind.UNSCALE, None
        return None

    def leave_Module(self, node: cst.Module) -> None:
        clipping = [unit for unit, events in self.events.items() if _has_clip(events)]
        if not clipping:
            return
        bound = self.context.model.names_bound_to(*GRAD_SCALERS)
        for unit in clipping:
            events = self.events[unit]
            scalers = {
                e.scaler
                for e in events
                if e.kind is Kind.BACKWARD and (e.scaler in bound or "scaler" in e.scaler.lower())
            }
            for index, event in enumerate(events):
                if event.kind is Kind.CLIP:
                    self._check_clip(events, index, scalers, self.others[unit])

    def _check_clip(
        self, events: list[Event], index: int, scalers: set[str], others: list[tuple[cst.Call, int]]
    ) -> None:
        clip = events[index]
        for scaler in sorted(scalers):
            backward = _neighbour(events, range(index - 1, -1, -1), scaler)
            if backward is None or events[backward].kind is not Kind.BACKWARD:
                continue
            if _exclusive(events[backward].ancestors, clip.ancestors):
                continue
            if _handed_over(scaler, others, backward, index):
                continue  # a helper given the scaler after the backward may unscale
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
        replacement = insert_before(clip.ancestors, statement, unscale)
        if replacement is None:
            return None
        # Clipping outside the `if use_amp:` that holds the step: with a scaler that is
        # None on the other path, the inserted call would fail there.
        guarded = _branches(backward.ancestors) | _branches(step.ancestors)
        safe = guarded <= _branches(clip.ancestors)
        applicability = Applicability.SAFE if safe else Applicability.UNSAFE
        return NodeFix(f"Insert `{target}` before clipping", (replacement,), applicability)


def _has_clip(events: list[Event]) -> bool:
    return any(event.kind is Kind.CLIP for event in events)


def _handed_over(scaler: str, others: list[tuple[cst.Call, int]], backward: int, clip: int) -> bool:
    """Whether a call between event `backward` and event `clip` gets `scaler` as argument."""
    return any(
        dotted(arg.value) == scaler
        for call, position in others
        if backward < position <= clip
        for arg in call.args
    )


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
    if type(line) is not cst.SimpleStatementLine or len(line.body) != 1:
        return None
    if type(small) in (cst.Expr, cst.Assign, cst.AnnAssign) and small.value is clip.call:
        return line
    return None
