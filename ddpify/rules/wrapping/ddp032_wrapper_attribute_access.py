from __future__ import annotations

import builtins
import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted, find_arg, identifiers
from ddpify.analysis.wrappers import (
    DDP_ATTRIBUTES,
    READS_MODEL_ATTRIBUTES,
    Place,
    conditions_between,
)
from ddpify.diagnostics import FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.devices._common import DDP
from ddpify.rules.wrapping._common import WrapperRule
from ddpify.walk import children, walk

# Names of tests that choose between the distributed and the single-process path.
_DISTRIBUTED = re.compile(r"distributed|ddp|world_size|rank|is_initialized|parallel", re.I)
# `print(model)`, `len(loader)`: never a function of the file (checked first, it is cheap).
_BUILTINS = frozenset(dir(builtins))
# Tests under which an attribute read is deliberate: `hasattr(model, "module")` ...
_INTROSPECTION = frozenset({"hasattr", "getattr", "isinstance", "type"})


@dataclass(frozen=True)
class _Access:
    node: cst.Attribute
    place: Place


class WrapperAttributeAccess(WrapperRule):
    """`ddp_model.custom_method()` raises AttributeError: the wrapper only has what
    `nn.Module` and DDP define; the model's own attributes live on `ddp_model.module`."""

    CODE = "DDP032"
    NAME = "wrapper-attribute-access"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "`model.generate` is not an attribute of the DDP wrapper and raises AttributeError; "
        "use `model.module.generate`"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.accesses: list[_Access] = []
        # Wrappers handed to a library helper that reads the model's attributes.
        self.handed: list[tuple[cst.Call, cst.BaseExpression, Place]] = []
        # `ddp_model.x = ...` sets x on the wrapper itself: reading it back is fine.
        self.set_on_wrapper: set[tuple[str, str]] = set()
        # Names passed to a plain function call (`evaluate(model, loader)`).
        self.passed: list[tuple[cst.Call, int, cst.Arg, Place]] = []

    def visit_Attribute(self, node: cst.Attribute) -> None:
        attr = node.attr.value
        if attr.startswith("_") or attr in DDP_ATTRIBUTES:
            return
        if dotted(node.value) is None:
            return
        self.accesses.append(_Access(node, self.place()))

    def visit_Call(self, node: cst.Call) -> None:
        if type(node.func) is cst.Name and node.func.value not in _BUILTINS:
            for index, arg in enumerate(node.args):
                if not arg.star and dotted(arg.value) is not None:
                    self.passed.append((node, index, arg, self.place()))
        helper = READS_MODEL_ATTRIBUTES.get(self.wrappers.callee or "")
        if helper is not None:
            arg = find_arg(node, *helper)
            if arg is not None and dotted(arg.value) is not None:
                self.handed.append((node, arg.value, self.place()))

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if type(target.target) is cst.Attribute:
                owner = dotted(target.target.value)
                if owner is not None:
                    self.set_on_wrapper.add((owner, target.target.attr.value))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.speaks():
            return
        targets = {wrap.target for wrap in self.wrappers.wraps}
        for access in self.accesses:
            if dotted(access.node.value) in targets:
                self._check(access)
        for call, model, place in self.handed:
            self._check_handed(call, model, place)
        self._check_passed(node)

    def _check_passed(self, module: cst.Module) -> None:
        """The wrapper passed to a function of this file that reads an attribute of the
        model the wrapper does not have: `test_mmstar(model, ...)` with
        `def test_mmstar(model, ...): ... model.generate(...)`."""
        functions = {s.name.value: s for s in module.body if type(s) is cst.FunctionDef}
        for call, index, arg, place in self.passed:
            function = functions.get(call.func.value)  # type: ignore[attr-defined]
            if function is None or not self._holds_wrapper(arg.value, place):
                continue
            param = parameter_for(function, index, arg)
            read = _unwrapped_read(function, param) if param is not None else None
            if read is None:
                continue
            name = dotted(arg.value)
            every_path = self.wrappers.held_on_every_path(arg.value, place)
            if not every_path and self._other_path_possible(name, place):  # type: ignore[arg-type]
                continue
            instead = f"pass `{name}.module`" if every_path else "pass the unwrapped model"
            message = (
                f"`{function.name.value}` reads `{self.shown(read)}`, which the DDP wrapper "
                f"`{name}` passed here does not have (AttributeError); {instead}"
            )
            self.report(arg.value, message)

    def _holds_wrapper(self, expr: cst.BaseExpression, place: Place) -> bool:
        """`expr` holds a DDP wrapper at `place`: bound to `DDP(...)`, or to a helper of
        this file that returns one (`model = wrap_model(model)`)."""
        if self.wrappers.wrap_held(expr, place) is not None:
            return True
        name = dotted(expr)
        binding = self.wrappers.binding_of(name, place) if name else None
        value = binding.value if binding is not None else None
        return type(value) is cst.Call and self.model.call_returns(value, DDP)

    def _check_handed(self, call: cst.Call, model: cst.BaseExpression, place: Place) -> None:
        if self.wrappers.wrap_held(model, place) is None:
            return
        every_path = self.wrappers.held_on_every_path(model, place)
        name = dotted(model)
        if not every_path and self._other_path_possible(name, place):  # type: ignore[arg-type]
            return
        helper = self.shown(call.func)
        unwrapped = cst.Attribute(value=model, attr=cst.Name("module"))
        fix = NodeFix(f"Pass `{name}.module`", ((model, unwrapped),)) if every_path else None
        message = (
            f"`{helper}` reads the model's own attributes (`no_weight_decay()`) through "
            f"`hasattr`, which the DDP wrapper `{name}` hides, so they are silently ignored; "
            + (f"pass `{name}.module`" if every_path else "pass the unwrapped model")
        )
        self.report(model, message, severity=Severity.WARNING, fix=fix)

    def _check(self, access: _Access) -> None:
        owner = access.node.value
        name = dotted(owner)
        if name is None or (name, access.node.attr.value) in self.set_on_wrapper:
            return
        if self._assigned_to(access) or _introspected(access.place):
            return
        wrap = self.wrappers.wrap_held(owner, access.place)
        if wrap is None:
            return
        every_path = self.wrappers.held_on_every_path(owner, access.place)
        if not every_path and self._other_path_possible(name, access.place):
            return
        attr = access.node.attr.value
        unwrapped = access.node.with_changes(
            value=cst.Attribute(value=owner, attr=cst.Name("module"))
        )
        # Where the name holds the raw model on some paths, `.module` would break those.
        fix = (
            NodeFix(f"Use `{name}.module.{attr}`", ((access.node, unwrapped),))
            if every_path
            else None
        )
        if every_path:
            instead = f"use `{name}.module.{attr}`"
        else:
            instead = f"read it from `{name}.module` on the path that wraps it"
        message = (
            f"`{name}.{attr}` is not an attribute of the DDP wrapper and raises "
            f"AttributeError; {instead}"
        )
        self.report(access.node, message, fix=fix)

    def _other_path_possible(self, name: str, place: Place) -> bool:
        """For a wrap made under a condition (`if args.distributed: model = DDP(model)`),
        whether the access may be on the path without it: under a test of its own that
        names what the wrap's condition names, or anything distributed."""
        binding = self.wrappers.binding_of(name, place)
        if binding is None:
            return True
        conditions = conditions_between(binding.place, place)
        if type(binding.value) is cst.IfExp:
            conditions.append(binding.value.test)
        condition_names = {n for test in conditions for n in identifiers(test)}
        for test in conditions_between(place, binding.place):
            names = set(identifiers(test))
            if names & condition_names or any(_DISTRIBUTED.search(n) for n in names):
                return True
        return False

    @staticmethod
    def _assigned_to(access: _Access) -> bool:
        """`ddp.x = v` or `del ddp.x`: writing is legal on any object."""
        parent = access.place.ancestors[-2] if len(access.place.ancestors) > 1 else None
        return type(parent) in (cst.AssignTarget, cst.AugAssign, cst.Del) or (
            type(parent) is cst.AnnAssign and parent.target is access.node
        )


def parameter_for(function: cst.FunctionDef, index: int, arg: cst.Arg) -> str | None:
    """The parameter of `function` that `arg` (the `index`-th argument) binds."""
    params = function.params
    if arg.keyword is not None:
        named = {p.name.value for p in (*params.params, *params.kwonly_params)}
        return arg.keyword.value if arg.keyword.value in named else None
    positional = [*params.posonly_params, *params.params]
    return positional[index].name.value if index < len(positional) else None


def _unwrapped_read(function: cst.FunctionDef, param: str) -> cst.Attribute | None:
    """A read of `param.<attr>` in `function` that only the unwrapped model has; None
    when the function rebinds the parameter or looks at what it is (`hasattr`, `try`)."""
    found: list[cst.Attribute] = []
    ancestors: list[cst.CSTNode] = []
    rebinds = False

    def enter(node: cst.CSTNode) -> None:
        nonlocal rebinds
        ancestors.append(node)
        if type(node) in (cst.AssignTarget, cst.AugAssign) and dotted(node.target) == param:
            rebinds = True
        if not (type(node) is cst.Attribute and dotted(node.value) == param):
            return
        attr = node.attr.value
        if attr.startswith("_") or attr in DDP_ATTRIBUTES:
            return
        parent = ancestors[-2] if len(ancestors) > 1 else None
        if type(parent) in (cst.AssignTarget, cst.AugAssign, cst.Del):
            return
        if not _introspected(Place(tuple(ancestors), 0)):
            found.append(node)

    walk(function.body, enter, lambda node: ancestors.pop())
    return found[0] if found and not rebinds else None


def _introspected(place: Place) -> bool:
    """Under a test that looks at what the object is (`if hasattr(model, "module")`), or
    in a `try` that may be catching the AttributeError."""
    for parent, child in zip(place.ancestors, place.ancestors[1:]):
        if type(parent) is cst.Try and child is parent.body:
            return True
        if type(parent) in (cst.If, cst.IfExp, cst.While) and _introspects(parent.test):
            return True
    return False


def _introspects(test: cst.BaseExpression) -> bool:
    stack: list[cst.CSTNode] = [test]
    while stack:
        node = stack.pop()
        if type(node) is cst.Call and type(node.func) is cst.Name:
            if node.func.value in _INTROSPECTION:
                return True
        stack.extend(children(node))
    return False
