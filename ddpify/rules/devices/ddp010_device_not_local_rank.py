from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.guards import single_process_branch
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.diagnostics import Severity
from ddpify.rules.devices._common import (
    INIT_PROCESS_GROUP,
    SET_DEVICE,
    DistributedRule,
    Rank,
    string_value,
)

# Other calls that choose this process's GPU from a run-time value.
_DEVICE_SELECTORS = frozenset(
    {"torch.cuda.device", "torch.accelerator.set_device_index", "torch.set_default_device"}
)
# Calls whose keyword names where tensors or modules go.
_DEVICE_KEYWORDS = ("device", "map_location")


@dataclass(frozen=True)
class _Ordered:
    call: cst.Call
    function: cst.FunctionDef | None
    order: int


def _cuda_index(text: str | None) -> int | None | bool:
    """`"cuda"` -> None (the current device), `"cuda:1"` -> 1, anything else -> False."""
    if text == "cuda":
        return None
    if text is not None and text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    return False


def _int_literal(node: cst.BaseExpression) -> int | None:
    return int(node.value) if type(node) is cst.Integer else None


def _is_constant(node: cst.BaseExpression) -> bool:
    return type(node) in (cst.Integer, cst.SimpleString)


class DeviceNotLocalRank(DistributedRule):
    """Every rank of a DDP job must pick its own GPU from the local rank."""

    CODE = "DDP010"
    NAME = "device-not-local-rank"
    SEVERITY = Severity.ERROR
    MESSAGE = "the device does not depend on the local rank, so every rank uses GPU 0"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.order = 0
        self.current_device_uses: list[tuple[cst.CSTNode, str]] = []
        self.fixed_index_uses: list[tuple[cst.CSTNode, str, int]] = []
        self.set_device_calls: list[_Ordered] = []
        self.init_calls: list[_Ordered] = []
        self.selects_device_otherwise = False
        # (where, as written, the global rank's origin): a GPU picked by the global rank.
        self.global_rank_uses: list[tuple[cst.CSTNode, str, str]] = []

    # -- collection ------------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        name = self.context.qualify(node.func)
        if name == SET_DEVICE:
            self._record_set_device(node)
        elif name == INIT_PROCESS_GROUP:
            self.init_calls.append(_Ordered(node, self.enclosing_function(), self.order))
        elif name in _DEVICE_SELECTORS:
            self.selects_device_otherwise |= bool(node.args) and not _is_constant(
                node.args[0].value
            )
        elif name == "torch.device":
            self._record_torch_device(node)
        elif method_name(node) == "cuda":
            self._record_cuda_method(node)
        elif method_name(node) == "to" and node.args and node.args[0].keyword is None:
            self._record_device_value(node.args[0].value)
        for keyword in _DEVICE_KEYWORDS:
            arg = find_arg(node, keyword)
            if arg is not None and arg.keyword is not None:
                self._record_device_value(arg.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        """`device = "cuda"` / `DEVICE = "cuda:0"`: the device every later `.to()` uses."""
        for target in node.targets:
            name = dotted(target.target)
            if name is not None and "device" in name.rsplit(".", 1)[-1].lower():
                self._record_device_value(node.value)

    def _record_set_device(self, node: cst.Call) -> None:
        if not node.args:
            return
        value = node.args[0].value
        index = _int_literal(value)
        if index is None and type(value) is cst.SimpleString:
            index = _cuda_index(string_value(value))
        if isinstance(index, int) and index is not False:
            self._fixed(node, self.context.code(node), index)
        elif not _is_constant(value):
            self.set_device_calls.append(_Ordered(node, self.enclosing_function(), self.order))
            self._check_global_rank(node, value)

    def _record_torch_device(self, node: cst.Call) -> None:
        if not node.args or node.args[0].keyword is not None:
            return
        if len(node.args) > 1 and string_value(node.args[0].value) == "cuda":
            self._check_global_rank(node, node.args[1].value)  # torch.device("cuda", rank)
        elif type(node.args[0].value) not in (cst.Name, cst.Attribute):
            self._check_global_rank(node, node.args[0].value)  # torch.device(f"cuda:{rank}")
        if type(node.args[0].value) is cst.IfExp:
            self._record_device_value(node.args[0].value)
            return
        kind = string_value(node.args[0].value)
        index = _cuda_index(kind)
        if len(node.args) > 1 and kind == "cuda":
            index = _int_literal(node.args[1].value)
            if index is None:
                return  # torch.device("cuda", local_rank)
        self._classify(node, index)

    def _record_cuda_method(self, node: cst.Call) -> None:
        device = find_arg(node, "device", 0)
        if device is None:
            self._classify(node, None)
            return
        index = _int_literal(device.value)
        if index is not None:
            self._classify(node, index)
        else:
            self._check_global_rank(node, device.value)

    def _record_device_value(self, value: cst.BaseExpression) -> None:
        if type(value) is cst.IfExp:
            self._record_device_value(value.body)
            self._record_device_value(value.orelse)
            return
        self._check_global_rank(value, value)
        self._classify(value, _cuda_index(string_value(value)))

    def _check_global_rank(self, use: cst.CSTNode, value: cst.BaseExpression) -> None:
        """`f"cuda:{rank}"`, `set_device(rank)`, `.to(rank)` with `rank = dist.get_rank()`:
        right on one node only, since GPU indices restart at 0 on every node."""
        index = _index_expression(value)
        if index is None:
            return
        origin = self.resolver.resolve(index, self.enclosing_function())
        if origin is not None and origin[0] is Rank.GLOBAL:
            self.global_rank_uses.append((use, self._spelling(use), origin[1]))

    def _classify(self, node: cst.CSTNode, index: int | None | bool) -> None:
        if index is False:
            return
        spelling = self._spelling(node)
        if index is None:
            if self._on_every_rank():
                self.current_device_uses.append((node, spelling))
        else:
            self._fixed(node, spelling, index)

    def _fixed(self, node: cst.CSTNode, spelling: str, index: int) -> None:
        if self._on_every_rank():
            self.fixed_index_uses.append((node, spelling, index))

    def _on_every_rank(self) -> bool:
        """Not rank 0's alone, and not a branch for a run of one process (the `else` of
        `elif args.distributed:`), where GPU 0 is the only GPU in use."""
        ancestors = self.context.ancestors
        return self.context.rank_zero_scope() is None and not single_process_branch(ancestors)

    def _spelling(self, node: cst.CSTNode) -> str:
        code = self.context.code(node)
        if len(code) <= 40 and "\n" not in code:
            return code
        if type(node) is cst.Call and method_name(node) == "cuda":
            return ".cuda()"
        return "the device"

    # -- decision --------------------------------------------------------------------

    def leave_Module(self, node: cst.Module) -> None:
        if not self.is_distributed() or self.pins_visible_devices():
            return
        for use, spelling, index in self.fixed_index_uses:
            self.report(
                use,
                f"`{spelling}` hard-codes GPU {index} on every rank; derive the device from "
                'the local rank, e.g. `torch.device("cuda", local_rank)`',
            )
        self._report_current_device_uses()
        self._report_late_set_device()
        self._report_nccl_without_set_device()
        self._report_global_rank_uses()

    def _report_global_rank_uses(self) -> None:
        for use, spelling, origin in self.global_rank_uses:
            shown = spelling if spelling == origin else f"{spelling}` (from `{origin}`)"
            shown = shown if shown.endswith(")") else f"{shown}`"
            self.report(
                use,
                f"`{shown} picks the GPU by the global rank, which runs past the GPUs of "
                "every node but the first; use the local rank "
                '(`int(os.environ["LOCAL_RANK"])`)',
                severity=Severity.WARNING,
            )

    def _report_current_device_uses(self) -> None:
        if self.set_device_calls or self.selects_device_otherwise or not self.init_calls:
            # No init here means the set-up lives elsewhere: it may well set the device.
            return
        bound = any(find_arg(init.call, "device_id") for init in self.init_calls)
        for use, spelling in self.current_device_uses:
            if bound:
                self.report(
                    use,
                    f"`{spelling}` means the current device, GPU 0 on every rank: "
                    "`init_process_group(device_id=...)` does not set it; "
                    "call `torch.cuda.set_device(local_rank)` as well",
                    severity=Severity.INFO,
                )
            else:
                self.report(
                    use,
                    f"`{spelling}` means the current device, GPU 0 on every rank, because "
                    "`torch.cuda.set_device(local_rank)` is never called; call it before "
                    "`init_process_group`",
                )

    def _report_late_set_device(self) -> None:
        for init in self.init_calls:
            if not _init_needs_device_first(init.call):
                continue
            same_function = [c for c in self.set_device_calls if c.function is init.function]
            if any(c.order < init.order for c in same_function):
                continue
            late = [c for c in same_function if c.order > init.order]
            if late:
                self.report(
                    late[0].call,
                    f"`{self.context.code(late[0].call)}` runs after `init_process_group`, "
                    "so NCCL may set up on GPU 0 first; call it before initialising the "
                    "process group (or pass `device_id=`)",
                    severity=Severity.WARNING,
                )

    def _report_nccl_without_set_device(self) -> None:
        """NCCL init with no device chosen at all: the model may sit on `local_rank`, but
        NCCL's communicator and every barrier use the current device, GPU 0 on all ranks."""
        if self.set_device_calls or self.selects_device_otherwise or self.current_device_uses:
            return  # the bare uses above already say it, on the line that shows it
        for init in self.init_calls:
            if _init_needs_device_first(init.call) and _names_nccl(init.call):
                self.report(
                    init.call,
                    "NCCL is initialised but `torch.cuda.set_device(local_rank)` is never "
                    "called, so each rank's communicator and barriers start on GPU 0; call it "
                    "before `init_process_group` (or pass `device_id=`)",
                    severity=Severity.WARNING,
                )
                return


def _index_expression(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """The GPU index inside a device spelling: `rank` in `f"cuda:{rank}"`,
    `"cuda:{}".format(rank)`, `"cuda:%d" % rank`, or a bare name or attribute."""
    if type(value) is cst.FormattedString:
        parts = value.parts
        if (
            len(parts) == 2
            and type(parts[0]) is cst.FormattedStringText
            and parts[0].value == "cuda:"
            and type(parts[1]) is cst.FormattedStringExpression
        ):
            return parts[1].expression
        return None
    if type(value) is cst.Call and method_name(value) == "format" and value.args:
        template = string_value(value.func.value)  # type: ignore[attr-defined]
        return value.args[0].value if template == "cuda:{}" else None
    if type(value) is cst.BinaryOperation and type(value.operator) is cst.Modulo:
        return value.right if string_value(value.left) == "cuda:%d" else None
    if type(value) in (cst.Name, cst.Attribute) or (
        type(value) is cst.Call and dotted(value.func) == "int"
    ):
        return value
    return None


def _names_nccl(call: cst.Call) -> bool:
    """Only a spelled-out NCCL backend: a default backend may be a CPU run."""
    backend = find_arg(call, "backend", 0)
    return backend is not None and (string_value(backend.value) or "").lower() == "nccl"


def _init_needs_device_first(call: cst.Call) -> bool:
    """NCCL without `device_id=`: the first collective picks the current device."""
    if find_arg(call, "device_id") is not None:
        return False
    backend = find_arg(call, "backend", 0)
    return backend is None or string_value(backend.value) != "gloo"
