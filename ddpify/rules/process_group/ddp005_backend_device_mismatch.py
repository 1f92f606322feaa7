"""DDP005: nccl on a path that runs on CPU, or CPU tensors in nccl collectives."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.values import falls_back_to_cpu, is_cuda_test
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix, Rule
from ddpify.rules.process_group._common import DIST, INIT_PROCESS_GROUP, callee_name, string_value

SET_DEVICE = "torch.cuda.set_device"
# Collectives and the position of the tensor they communicate.
_COLLECTIVE_TENSOR = {
    f"{DIST}.all_reduce": 0,
    f"{DIST}.reduce": 0,
    f"{DIST}.broadcast": 0,
    f"{DIST}.all_gather": 1,
    f"{DIST}.all_gather_into_tensor": 1,
    f"{DIST}.reduce_scatter_tensor": 1,
    f"{DIST}.gather": 0,
    f"{DIST}.scatter": 0,
}
_COLLECTIVE_NAMES = {name.rsplit(".", 1)[-1] for name in _COLLECTIVE_TENSOR}
# Factories that put a tensor on the CPU unless given `device=`.
_CPU_FACTORIES = {
    f"torch.{name}"
    for name in (
        "tensor as_tensor zeros ones empty full arange linspace rand randn randint "
        "from_numpy Tensor FloatTensor LongTensor DoubleTensor IntTensor"
    ).split()
}


class BackendDeviceMismatch(Rule):
    """The nccl backend only moves CUDA tensors."""

    CODE = "DDP005"
    NAME = "backend-device-mismatch"
    SEVERITY = Severity.WARNING
    MESSAGE = "the nccl backend is used where tensors live on the CPU"
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.cpu_fallback = False  # the script picks the CPU when CUDA is missing
        self.cuda_required = False  # an unconditional `torch.cuda.set_device(...)`
        self.inits: list[tuple[cst.Call, bool]] = []  # (init call, under a CUDA test)
        self.collectives: list[tuple[cst.Call, cst.Arg]] = []

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.cpu_fallback |= falls_back_to_cpu(node, self.context.imports)

    def visit_If(self, node: cst.If) -> None:
        self.cpu_fallback |= falls_back_to_cpu(node, self.context.imports)

    def visit_Call(self, node: cst.Call) -> None:
        name = callee_name(node.func)
        if name not in _COLLECTIVE_NAMES and name not in {"init_process_group", "set_device"}:
            return
        qualified = self.context.qualify(node.func)
        if qualified == INIT_PROCESS_GROUP:
            self.inits.append((node, self._under_cuda_test()))
        elif qualified == SET_DEVICE and not self._under_cuda_test():
            self.cuda_required = True
        elif qualified in _COLLECTIVE_TENSOR:
            arg = find_arg(node, "tensor", _COLLECTIVE_TENSOR[qualified])
            if arg is not None and not arg.star:
                self.collectives.append((node, arg))

    def _under_cuda_test(self) -> bool:
        ancestors = self.context.ancestors
        for parent, child in zip(ancestors, ancestors[1:]):
            if type(parent) in (cst.If, cst.IfExp) and child is not parent.test:
                if is_cuda_test(parent.test):
                    return True
        return False

    def leave_Module(self, node: cst.Module) -> None:
        if self.context.model.framework is not None:
            return
        if self.cpu_fallback and not self.cuda_required:
            for call, guarded in self.inits:
                for literal in self._nccl(call, guarded):
                    self.report(literal, _cpu_path_message(), fix=self._fix(literal))
        if not any(self._may_be_nccl(call) for call, _ in self.inits):
            return
        for _, arg in self.collectives:
            if self._on_cpu(arg.value):
                self.report(arg, _cpu_tensor_message(self.context.code(arg.value)))

    def _nccl(self, call: cst.Call, guarded: bool) -> list[cst.SimpleString]:
        """The `"nccl"` literal an unguarded init passes, directly or through a name bound
        only to it; [] for any other backend, or one that is chosen at run time."""
        arg = find_arg(call, "backend", 0)
        if guarded or arg is None:
            return []
        value = arg.value
        name = dotted(value)
        if name is not None:
            bound = self.context.model.bindings.get(name, [])
            if len(bound) != 1:
                return []
            value = bound[0]
        return [value] if _is_nccl(value) else []

    def _may_be_nccl(self, call: cst.Call) -> bool:
        """Whether the group is nccl on some machine: `"nccl"`, `"nccl" if cuda else "gloo"`,
        or a name bound to `"nccl"` in one branch. (`"cpu:gloo,cuda:nccl"` also moves CPU
        tensors, and a backend read from the command line is unknown.)"""
        arg = find_arg(call, "backend", 0)
        if arg is None:
            return False
        name = dotted(arg.value)
        values = self.context.model.bindings.get(name, []) if name else [arg.value]
        for value in values:
            options = [value.body, value.orelse] if type(value) is cst.IfExp else [value]
            if any(_is_nccl(option) for option in options):
                return True
        return False

    def _on_cpu(self, expr: cst.BaseExpression) -> bool:
        """A tensor made by a factory without `device=` (directly or in every binding)."""
        name = dotted(expr)
        values = self.context.model.bindings.get(name, []) if name else [expr]
        return bool(values) and all(self._cpu_factory(value) for value in values)

    def _cpu_factory(self, expr: cst.BaseExpression) -> bool:
        if type(expr) is not cst.Call:
            return False
        if self.context.qualify(expr.func) not in _CPU_FACTORIES:
            return False
        return find_arg(expr, "device") is None

    def _fix(self, literal: cst.SimpleString) -> NodeFix | None:
        torch = next(
            (local for local, full in self.context.imports.aliases.items() if full == "torch"),
            None,
        )
        if torch is None:
            return None
        quote = literal.quote
        new = cst.parse_expression(
            f"{quote}nccl{quote} if {torch}.cuda.is_available() else {quote}gloo{quote}"
        )
        return NodeFix(
            "Use nccl when CUDA is available, else gloo",
            ((literal, new),),
            Applicability.SAFE,
        )


def _is_nccl(expr: cst.BaseExpression) -> bool:
    return type(expr) is cst.SimpleString and (string_value(expr) or "").lower() == "nccl"


def _cpu_path_message() -> str:
    return (
        "`nccl` is hard-coded, but this script falls back to the CPU when CUDA is missing, "
        'where nccl cannot run; use `"nccl" if torch.cuda.is_available() else "gloo"`'
    )


def _cpu_tensor_message(tensor: str) -> str:
    return (
        f"`{tensor}` is created on the CPU, but an nccl process group only communicates CUDA "
        "tensors; create it with `device=` set to the local GPU"
    )
