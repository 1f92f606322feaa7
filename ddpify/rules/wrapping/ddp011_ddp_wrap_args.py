from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.diagnostics import Severity
from ddpify.rules.devices._common import DDP, DistributedRule, Rank

_MOVES = frozenset({"to", "cuda"})
# Calls that return the same module on the same device (or change nothing).
_KEEP_DEVICE = frozenset(
    {
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
        "torch.compile",
        "print",
        "len",
        "isinstance",
        "type",
        "id",
        "str",
        "repr",
    }
)
# Constructors whose result is known to start on the CPU.
_CPU_FACTORIES = ("torch.nn.", "torchvision.models.")


class _Event(enum.Enum):
    MOVE = "move"  # `model.to(dev)`, `model.cuda()`
    BIND = "bind"  # `model = ...`
    UNKNOWN = "unknown"  # `model` passed to a helper that may move it


@dataclass(frozen=True)
class _Step:
    event: _Event
    order: int
    value: cst.BaseExpression | None = None


@dataclass(frozen=True)
class _Finding:
    node: cst.CSTNode
    message: str
    constructor: str | None = None  # judged at the end: a class of this file?
    hard_coded: bool = False  # a literal GPU index: right if each process sees one GPU


class DdpWrapArgs(DistributedRule):
    """`DDP(model, device_ids=[...])` needs the model on that GPU and a local GPU index."""

    CODE = "DDP011"
    NAME = "ddp-wrap-args"
    SEVERITY = Severity.ERROR
    MESSAGE = "`device_ids` must hold the local rank, and the model must be on that GPU"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.order = 0
        # (enclosing function, target as written) -> what happened to it, in order.
        self.history: dict[tuple[cst.FunctionDef | None, str], list[_Step]] = defaultdict(list)
        self.findings: list[_Finding] = []
        self.classes: dict[str, cst.ClassDef] = {}

    # -- collection ------------------------------------------------------------------

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.setdefault(node.name.value, node)

    def leave_Assign(self, node: cst.Assign) -> None:
        """Recorded on leaving, so `model = DDP(model, ...)` sees the old `model`."""
        self.order += 1
        for target in node.targets:
            name = dotted(target.target)
            if name is not None:
                self._step(name, _Event.BIND, node.value)

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        callee = self.context.qualify(node.func)
        if callee == DDP:
            self._check_wrap(node)
            return
        # The enclosing function is looked up once per call, and only when a name is
        # recorded (most calls move nothing and pass no plain name).
        function: list[cst.FunctionDef | None] = []
        if method_name(node) in _MOVES:
            receiver = dotted(node.func.value)  # type: ignore[attr-defined]
            if receiver is not None:
                self._step(receiver, _Event.MOVE, function=function)
        keeps_device = callee in _KEEP_DEVICE or (
            type(node.func) is cst.Name and node.func.value in _KEEP_DEVICE
        )
        if not keeps_device:
            for arg in node.args:
                name = dotted(arg.value)
                if name is not None:
                    self._step(name, _Event.UNKNOWN, function=function)

    def _step(
        self,
        name: str,
        event: _Event,
        value: cst.BaseExpression | None = None,
        function: list[cst.FunctionDef | None] | None = None,
    ) -> None:
        """Record `event` for `name`; `function`, when given, memoises the enclosing
        function across the steps of one node (empty until first asked)."""
        if function is None:
            enclosing = self.enclosing_function()
        else:
            if not function:
                function.append(self.enclosing_function())
            enclosing = function[0]
        self.history[(enclosing, name)].append(_Step(event, self.order, value))

    # -- the wrap --------------------------------------------------------------------

    def _check_wrap(self, call: cst.Call) -> None:
        device_ids = find_arg(call, "device_ids", 1)
        if (
            device_ids is None
            or type(device_ids.value) is cst.Name
            and (device_ids.value.value == "None")
        ):
            return
        if type(device_ids.value) in (cst.List, cst.Tuple) and device_ids.value.elements:
            if len(device_ids.value.elements) == 1:
                index = device_ids.value.elements[0].value
                self._check_device_index(index, f"device_ids=[{self.context.code(index)}]")
        output_device = find_arg(call, "output_device", 2)
        if output_device is not None:
            value = output_device.value
            self._check_device_index(value, f"output_device={self.context.code(value)}")
        module = find_arg(call, "module", 0)
        if module is not None:
            self._check_model_moved(module.value)

    def _check_device_index(self, index: cst.BaseExpression, shown: str) -> None:
        code = self.context.code(index)
        if type(index) is cst.Integer:
            message = f"`{shown}` uses GPU {code} on every rank; pass the local rank instead"
            self.findings.append(_Finding(index, message, hard_coded=True))
            return
        origin = self.resolver.resolve(index, self.enclosing_function())
        if origin is None or origin[0] is not Rank.GLOBAL:
            return
        source = "" if origin[1] == code else f" (from `{origin[1]}`)"
        message = (
            f"`{shown}` passes the global rank{source}, which is not a GPU index "
            'beyond the first node; pass the local rank (`int(os.environ["LOCAL_RANK"])`)'
        )
        self.findings.append(_Finding(index, message))

    def _check_model_moved(self, module: cst.BaseExpression) -> None:
        name = dotted(module)
        if name is None:
            self._check_constructor(module, module)
            return
        steps = self.history.get((self.enclosing_function(), name), [])
        for step in reversed(steps):
            if step.event is not _Event.BIND:
                return  # moved, or handed to a helper that may have moved it
            value = step.value
            if self._keeps_device_of(value, name):
                continue
            if _transforms(value, name):
                return  # `model = DataParallel(model)`: built from the model, not a new one
            self._check_constructor(value, module)
            return

    def _keeps_device_of(self, value: cst.BaseExpression | None, name: str) -> bool:
        """`model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` keeps it where it is."""
        return (
            type(value) is cst.Call
            and self.context.qualify(value.func) in _KEEP_DEVICE
            and bool(value.args)
            and dotted(value.args[0].value) == name
        )

    def _check_constructor(self, value: cst.BaseExpression | None, module: cst.BaseExpression):
        if type(value) is not cst.Call or find_arg(value, "device") is not None:
            return
        if type(value.func) is cst.Attribute and method_name(value) in _MOVES:
            return
        callee = self.context.qualify(value.func)
        local_class = value.func.value if type(value.func) is cst.Name else None
        if not (callee and callee.startswith(_CPU_FACTORIES)) and local_class is None:
            return
        shown = self.context.code(module)
        if len(shown) > 40 or "\n" in shown:
            shown = "the model"
        message = (
            f"`{shown}` is still on the CPU when DDP is given `device_ids`, which raises a "
            "ValueError; move it to the local GPU first (`.to(local_rank)`)"
        )
        constructor = None if callee and callee.startswith(_CPU_FACTORIES) else local_class
        self.findings.append(_Finding(module, message, constructor))

    # -- decision --------------------------------------------------------------------

    def leave_Module(self, node: cst.Module) -> None:
        if not self.is_distributed():
            return
        for finding in self.findings:
            if finding.hard_coded and self.pins_visible_devices():
                continue
            if finding.constructor is None or self._builds_on_cpu(finding.constructor):
                self.report(finding.node, finding.message)

    def _builds_on_cpu(self, class_name: str) -> bool:
        """A model class of this file that never moves itself in its own code."""
        cls = self.classes.get(class_name)
        if cls is None:
            return False
        code = self.context.code(cls)
        return ".cuda(" not in code and ".to(" not in code


def _transforms(value: cst.BaseExpression | None, name: str) -> bool:
    """A call given the model itself (a wrapper, a converter): where its result lives
    depends on the model's device, which this rule has not tracked."""
    return type(value) is cst.Call and any(dotted(arg.value) == name for arg in value.args)
