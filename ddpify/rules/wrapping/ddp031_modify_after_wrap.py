from __future__ import annotations

import enum
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.frozen import model_roots, wrap_before
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.wrappers import (
    Place,
    Wrap,
    innermost,
    names_rooted_at,
    sibling_after,
)
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.wrapping._common import WrapperRule

_CASTS = frozenset({"half", "float", "double", "bfloat16"})
_MOVES = frozenset({"to", "cuda", "cpu"})


class _Kind(enum.Enum):
    CAST = "cast"  # `model.half()`
    MOVE = "move"  # `model.to(device)`
    FREEZE = "freeze"  # `p.requires_grad = False`, `model.fc.requires_grad_(False)`
    SWAP = "swap"  # `model.module.fc = nn.Linear(...)`


@dataclass(frozen=True)
class _Change:
    node: cst.CSTNode  # what is reported
    place: Place
    kind: _Kind
    roots: frozenset[str]  # the dotted names the change reaches the model through


class ModifyAfterWrap(WrapperRule):
    """DDP registers its hooks and buckets on the parameters it sees at construction;
    changing them afterwards leaves it reducing the wrong set or the wrong tensors."""

    CODE = "DDP031"
    NAME = "modify-after-wrap"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`model.half()` changes the model after it was wrapped in DDP, whose hooks were "
        "registered on the old parameters; do it before the wrap"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.changes: list[_Change] = []

    # -- collection ----------------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:
        method = method_name(node)
        if method is None:
            return
        receiver = dotted(node.func.value)  # type: ignore[attr-defined]
        if method == "requires_grad_":
            roots = self._roots(node.func.value)  # type: ignore[attr-defined]
            if roots:
                self._add(node, _Kind.FREEZE, roots)
        elif receiver is not None and (method in _CASTS or method in _MOVES):
            kind = _Kind.CAST if method in _CASTS else _Kind.MOVE
            self._add(node, kind, frozenset({receiver}))

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            expr = target.target
            if type(expr) is not cst.Attribute:
                continue
            if expr.attr.value == "requires_grad":
                roots = self._roots(expr.value)
                if roots:
                    self._add(node, _Kind.FREEZE, roots)
            elif _builds_module(node.value, self.context.qualify) and dotted(expr) is not None:
                self._add(node, _Kind.SWAP, frozenset({dotted(expr.value)}))  # type: ignore[arg-type]

    def _add(self, node: cst.CSTNode, kind: _Kind, roots: frozenset[str]) -> None:
        self.changes.append(_Change(node, self.place(), kind, roots))

    def _roots(self, expr: cst.BaseExpression) -> frozenset[str]:
        return model_roots(expr, self.context.ancestors)

    # -- decision ------------------------------------------------------------------------

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks():
            return
        for change in self.changes:
            wrap = self._wrap_before(change)
            if wrap is not None and not self._harmless_move(change, wrap):
                self._report(change, wrap)

    def _wrap_before(self, change: _Change) -> Wrap | None:
        """A wrap of the model `change` reaches, which runs before it."""
        return wrap_before(self.wrappers, change.roots, change.place)

    def _harmless_move(self, change: _Change, wrap: Wrap) -> bool:
        """`.to(device)` after the wrap is a no-op for a model already on that device: one
        wrapped with `device_ids` (DDP checks it is there), moved before the wrap, or not
        known to have been built on the CPU."""
        if change.kind is not _Kind.MOVE:
            return False
        device_ids = find_arg(wrap.call, "device_ids", 1)
        if device_ids is not None and dotted(device_ids.value) != "None":
            return True
        module = find_arg(wrap.call, "module", 0)
        if module is None or _is_move_chain(module.value) or wrap.inner is None:
            return True
        binding = self.wrappers.binding_of(wrap.inner, wrap.place)
        return binding is None or not _constructed_in_place(binding.value)

    def _report(self, change: _Change, wrap: Wrap) -> None:
        shown = self.shown(change.node)
        what = {
            _Kind.CAST: "changes the parameters' dtype",
            _Kind.MOVE: "moves the parameters",
            _Kind.FREEZE: "changes which parameters need gradients",
            _Kind.SWAP: "replaces a submodule",
        }[change.kind]
        message = (
            f"`{shown}` {what} after the model was wrapped in DDP, whose hooks and "
            "buckets were registered on the parameters it saw then; do it before the wrap"
        )
        self.report(change.node, message, fix=self._reorder(change, wrap))

    # -- fix -----------------------------------------------------------------------------

    def _reorder(self, change: _Change, wrap: Wrap) -> NodeFix | None:
        """Swap the wrap with the change right after it, when that provably changes only
        the order: `model = DDP(model)` then `model.half()` (or a freezing loop) over the
        same name, nothing else in either statement, no `.module` in the change."""
        if change.kind is _Kind.SWAP or wrap.inner is None:
            return None
        if change.kind is _Kind.MOVE and method_name(change.node) == "cpu":  # type: ignore[arg-type]
            return None  # DDP(device_ids=...) of a CPU model raises
        first = wrap.place.statement
        block = wrap.place.ancestors[wrap.place.ancestors.index(first) - 1] if first else None
        second = self._change_statement(change)
        if first is None or second is None or sibling_after(first, block) is not second:
            return None
        if not _single_assignment(first, wrap):
            return None
        mentioned = set(names_rooted_at(second))
        if wrap.inner not in mentioned or f"{wrap.inner}.module" in mentioned:
            return None
        if wrap.target != wrap.inner and wrap.target in mentioned:
            return None
        safety = Applicability.UNSAFE if change.kind is _Kind.FREEZE else Applicability.SAFE
        return NodeFix("Do it before the wrap", ((first, second), (second, first)), safety)

    def _change_statement(self, change: _Change) -> cst.CSTNode | None:
        """The statement that holds the change: a simple one, or the `for` loop that
        freezes parameters one by one."""
        ancestors = change.place.ancestors
        if change.kind is _Kind.FREEZE:
            loop = innermost(ancestors, cst.For)
            if loop is not None and not _is_dotted_name(change.node):
                return loop
        statement = innermost(ancestors, cst.SimpleStatementLine)
        if type(statement) is cst.SimpleStatementLine and len(statement.body) == 1:
            return statement
        return None


def _is_dotted_name(node: cst.CSTNode) -> bool:
    """A change written on the model itself, not through a loop variable."""
    if type(node) is cst.Call:
        target = node.func.value  # type: ignore[attr-defined]
    else:  # `x.requires_grad = v`
        target = node.targets[0].target.value  # type: ignore[attr-defined]
    return dotted(target) is not None and "." in (dotted(target) or "")


def _single_assignment(statement: cst.CSTNode, wrap: Wrap) -> bool:
    """`target = DDP(...)` alone on its line."""
    if type(statement) is not cst.SimpleStatementLine or len(statement.body) != 1:
        return False
    small = statement.body[0]
    return type(small) is cst.Assign and small.value is wrap.call


def _is_move_chain(expr: cst.BaseExpression) -> bool:
    while type(expr) is cst.Call and type(expr.func) is cst.Attribute:
        if expr.func.attr.value in _MOVES:
            return True
        expr = expr.func.value
    return False


def _builds_module(value: cst.BaseExpression, qualify) -> bool:
    """`nn.Linear(...)`, `torch.nn.Identity()`: a new submodule with its own parameters."""
    if type(value) is not cst.Call:
        return False
    name = qualify(value.func)
    return name is not None and name.startswith("torch.nn.") and name[9:10].isupper()


def _constructed_in_place(value: cst.BaseExpression) -> bool:
    """`Net(...)`, `nn.Linear(...)`: a fresh module, on the CPU unless it moves itself."""
    if type(value) is not cst.Call or _is_move_chain(value):
        return False
    name = dotted(value.func)
    return name is not None and name.rsplit(".", 1)[-1][:1].isupper()
