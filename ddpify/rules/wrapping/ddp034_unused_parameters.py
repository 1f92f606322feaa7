from __future__ import annotations

import libcst as cst

from ddpify.analysis.frozen import freezes_part, may_switch_off, model_roots, wrap_before
from ddpify.analysis.model import unwrap_call_chain
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.wrappers import Place, Wrap
from ddpify.diagnostics import Severity
from ddpify.rules.wrapping._common import WrapperRule
from ddpify.walk import children

# `torch.nn` layers that own parameters (activations, pooling, dropout own none).
PARAMETER_LAYERS = frozenset(
    {
        "Linear", "Bilinear", "LazyLinear", "Embedding", "EmbeddingBag",
        "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
        "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d",
        "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell",
        "LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
        "SyncBatchNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "PReLU",
        "MultiheadAttention", "Transformer", "TransformerEncoder", "TransformerDecoder",
        "TransformerEncoderLayer", "TransformerDecoderLayer", "Sequential", "ModuleList",
        "ModuleDict",
    }
)  # fmt: skip
NN_MODULE = "torch.nn.Module"
# Ways to reach submodules without naming them: then every one may be used.
_DYNAMIC_ATTRIBUTES = frozenset(
    {"children", "modules", "named_children", "named_modules", "_modules", "__dict__"}
)


class UnusedParameters(WrapperRule):
    """A submodule whose parameters never get a gradient stops DDP at the next step with
    "Expected to have finished reduction in the prior iteration"."""

    CODE = "DDP034"
    NAME = "unused-parameters"
    SEVERITY = Severity.INFO
    MESSAGE = (
        "`Net.aux` is built but never used, so its parameters get no gradient and DDP "
        "stops at the next step; remove it or pass `find_unused_parameters=True`"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.classes: dict[str, cst.ClassDef] = {}
        # `requires_grad` switched off somewhere: (the node, whose parameters, its place,
        # the model names it reaches).
        self.freezes: list[tuple[cst.CSTNode, cst.BaseExpression, Place, frozenset[str]]] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.setdefault(node.name.value, node)

    def visit_Call(self, node: cst.Call) -> None:
        if method_name(node) == "requires_grad_":
            value = node.args[0].value if node.args else None
            if may_switch_off(value):
                self._add_freeze(node, node.func.value)  # type: ignore[attr-defined]

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            expr = target.target
            if type(expr) is cst.Attribute and expr.attr.value == "requires_grad":
                if may_switch_off(node.value):
                    self._add_freeze(node, expr.value)

    def _add_freeze(self, node: cst.CSTNode, owner: cst.BaseExpression) -> None:
        roots = model_roots(owner, self.context.ancestors)
        if roots:
            self.freezes.append((node, owner, self.place(), roots))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks():
            return
        reported: set[str] = set()
        for wrap in self.wrappers.wraps:
            if find_arg(wrap.call, "find_unused_parameters") is not None:
                continue  # set either way: the author has decided
            cls = self._model_class(wrap)
            if cls is None or cls.name.value in reported:
                continue
            unused = self._unused_submodules(cls)
            if unused:
                reported.add(cls.name.value)
                self._report(wrap, cls, unused)
        self._check_frozen_after_wrap()

    def _check_frozen_after_wrap(self) -> None:
        """Parameters switched off after the wrap: DDP still waits for their gradients."""
        reported: set[int] = set()
        for node, owner, place, roots in self.freezes:
            wrap = wrap_before(self.wrappers, roots, place)
            if wrap is None or id(wrap.call) in reported:
                continue
            if not freezes_part(owner, place.ancestors, wrap):
                continue  # frozen whole, nothing gets a gradient: no reduction to finish
            if find_arg(wrap.call, "find_unused_parameters") is not None:
                continue
            reported.add(id(wrap.call))
            shown = self.shown(node, 60)
            shown = "`requires_grad`" if shown == "the model" else f"`{shown}`"
            message = (
                f"{shown} can switch off gradients "
                "after this wrap, but DDP still waits for every parameter it saw needing one, "
                'and stops at the next step ("Expected to have finished reduction in the '
                'prior iteration"); freeze before the wrap, or pass '
                "`find_unused_parameters=True`"
            )
            self.report(wrap.call, message)

    def _model_class(self, wrap: Wrap) -> cst.ClassDef | None:
        """The class of this file that the wrapped model is an instance of, if it is
        built right there (`DDP(Net())`) or bound from its constructor (`model = Net()`)."""
        module = find_arg(wrap.call, "module", 0)
        if module is None:
            return None
        value: cst.BaseExpression = module.value
        name = dotted(value)
        if name is not None:
            binding = self.wrappers.binding_of(name, wrap.place)
            if binding is None:
                return None
            value = binding.value
        call = unwrap_call_chain(value)
        if call is None or type(call.func) is not cst.Name:
            return None
        cls = self.classes.get(call.func.value)
        if cls is None or not any(self.context.qualify(b.value) == NN_MODULE for b in cls.bases):
            return None
        return cls

    def _unused_submodules(self, cls: cst.ClassDef) -> list[str]:
        methods = {s.name.value: s for s in cls.body.body if type(s) is cst.FunctionDef}
        init = methods.get("__init__")
        if init is None or "forward" not in methods:
            return []  # without its own forward, what the model uses is decided elsewhere
        assignments = _self_assignments(init)
        uses = _self_attribute_uses(cls, {id(target) for target, _ in assignments})
        if uses is None:
            return []
        return [
            target.attr.value
            for target, value in assignments
            if self._owns_parameters(value) and target.attr.value not in uses
        ]

    def _owns_parameters(self, value: cst.BaseExpression) -> bool:
        if type(value) is not cst.Call:
            return False
        name = self.context.qualify(value.func)
        return (
            name is not None
            and name.startswith("torch.nn.")
            and name.rsplit(".", 1)[-1] in PARAMETER_LAYERS
        )

    def _report(self, wrap: Wrap, cls: cst.ClassDef, unused: list[str]) -> None:
        listed = ", ".join(f"`{cls.name.value}.{name}`" for name in unused)
        one = len(unused) == 1
        verb, its, it = ("is", "its", "it") if one else ("are", "their", "them")
        message = (
            f"{listed} {verb} built in `__init__` but never used by the model, so {its} "
            'parameters get no gradient and DDP stops at the next step ("Expected to have '
            f'finished reduction in the prior iteration"); remove or freeze {it} before the '
            "wrap, or pass `find_unused_parameters=True`"
        )
        self.report(wrap.call, message)


def _self_assignments(init: cst.FunctionDef) -> list[tuple[cst.Attribute, cst.BaseExpression]]:
    """`self.x = value` statements directly in `__init__`'s body."""
    found = []
    for statement in init.body.body:
        if type(statement) is not cst.SimpleStatementLine:
            continue
        for small in statement.body:
            if type(small) is cst.Assign and len(small.targets) == 1:
                target = small.targets[0].target
                if type(target) is cst.Attribute and _is_self(target.value):
                    found.append((target, small.value))
    return found


def _self_attribute_uses(cls: cst.ClassDef, assigned: set[int]) -> set[str] | None:
    """Attributes of `self` that the class reads anywhere (its assignments in `assigned`
    aside); None when it reaches submodules without naming them (`getattr(self, name)`,
    `self.children()`), so that every one may be used."""
    used: set[str] = set()
    stack: list[cst.CSTNode] = [cls]
    while stack:
        node = stack.pop()
        if type(node) is cst.Attribute and _is_self(node.value) and id(node) not in assigned:
            if node.attr.value in _DYNAMIC_ATTRIBUTES:
                return None
            used.add(node.attr.value)
        elif type(node) is cst.Call and type(node.func) is cst.Name:
            if (
                node.func.value in {"getattr", "vars"}
                and node.args
                and _is_self(node.args[0].value)
            ):
                return None
        stack.extend(children(node))
    return used


def _is_self(expr: cst.BaseExpression) -> bool:
    return type(expr) is cst.Name and expr.value == "self"


def _reflects_on_self(node: cst.CSTNode) -> bool:
    """`getattr(self, name)`, `vars(self)`."""
    return (
        type(node) is cst.Call
        and type(node.func) is cst.Name
        and node.func.value in {"getattr", "vars"}
        and bool(node.args)
        and _is_self(node.args[0].value)
    )
