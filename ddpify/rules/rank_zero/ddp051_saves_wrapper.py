from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.wrappers import Binding, Place
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.rank_zero._common import (
    Ancestors,
    RankZeroRule,
    keyword_arg,
    last_name,
    positional_arg,
    unconditional_for,
)

TORCH_SAVES = {"torch.save": "obj", "safetensors.torch.save_file": "tensors"}


@dataclass(frozen=True)
class _Save:
    call: cst.Call
    whole_object: bool  # torch.save's first argument itself may be the wrapper
    ancestors: Ancestors
    seq: int


class SavesWrapper(RankZeroRule):
    """The DDP wrapper's state dict prefixes every key with `module.`."""

    CODE = "DDP051"
    NAME = "saves-wrapper"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`model.state_dict()` of the DDP wrapper saves keys prefixed `module.`; "
        "save `model.module.state_dict()` instead"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.saves: list[_Save] = []
        self.loads: list[_Save] = []  # `x.load_state_dict(...)` calls

    def on_call(self, node: cst.Call, qualified: str | None) -> None:
        if qualified is None and last_name(node.func) == "load_state_dict":
            self.loads.append(_Save(node, False, self.snapshot(), self.facts.seq))
            return
        if qualified in TORCH_SAVES:
            whole = qualified == "torch.save"
        elif qualified is None and "save" in last_name(node.func).lower():
            whole = False  # `save_checkpoint(model, ...)` may unwrap it itself
        else:
            return
        self.saves.append(_Save(node, whole, self.snapshot(), self.facts.seq))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.saves or self.delegates_to_framework():
            return
        reported: set[int] = set()
        self.loaded_into_wrapper = self._wrappers_loaded()
        for save in self.saves:
            for call, binding, ancestors in self._wrapper_state_dicts(save):
                if id(call) not in reported:
                    reported.add(id(call))
                    self._report_state_dict(call, binding, ancestors)
            if save.whole_object:
                self._check_whole_object(save)

    def _wrappers_loaded(self) -> set[str]:
        """Names whose `load_state_dict` is called while they hold the DDP wrapper: a
        resume checkpoint that goes back into the wrapper keeps its `module.` keys."""
        loaded = set()
        for load in self.loads:
            receiver = load.call.func.value  # type: ignore[attr-defined]
            name = dotted(receiver)
            if name and self.context.wrappers.wrapper_binding(
                receiver, Place(load.ancestors, load.seq)
            ):
                loaded.add(name)
        return loaded

    def _saved_values(self, save: _Save) -> Iterator[cst.BaseExpression]:
        qualified = self.context.qualify(save.call.func)
        if qualified in TORCH_SAVES:
            arg = keyword_arg(save.call, TORCH_SAVES[qualified]) or positional_arg(save.call, 0)
            if arg is not None:
                yield arg.value
        else:
            yield from (arg.value for arg in save.call.args)

    def _wrapper_state_dicts(self, save: _Save) -> Iterator[tuple[cst.Call, Binding, Ancestors]]:
        """`x.state_dict()` calls on the wrapper in what is saved, following a name once
        (`ckpt = {"model": model.state_dict()}` then `torch.save(ckpt, path)`)."""
        for value in self._saved_values(save):
            place = Place(save.ancestors, save.seq)
            sources = [(value, place)]
            name = dotted(value)
            if name is not None:
                bound = self.context.wrappers.assignment_before(name, place)
                if bound is not None:
                    sources.append((bound.value, bound.place))
                items = self.facts.items_of(name, save.ancestors, save.seq)
                sources += [(item.value, Place(item.ancestors, item.seq)) for item in items]
            for expr, where in sources:
                for call in _state_dict_calls(expr):
                    receiver = call.func.value  # type: ignore[attr-defined]
                    binding = self.context.wrappers.wrapper_binding(receiver, where)
                    if binding is not None:
                        yield call, binding, where.ancestors

    def _report_state_dict(self, call: cst.Call, binding: Binding, ancestors: Ancestors) -> None:
        receiver = call.func.value  # type: ignore[attr-defined]
        shown = self.context.code(receiver)
        fix = None
        if unconditional_for(binding, ancestors):
            unwrapped = cst.Attribute(value=receiver, attr=cst.Name("module"))
            fix = NodeFix(f"Save `{shown}.module.state_dict()`", ((receiver, unwrapped),))
        if dotted(receiver) in self.loaded_into_wrapper:
            message = (
                f"`{shown}.state_dict()` of the DDP wrapper saves keys prefixed `module.`; "
                f"this script loads them back into the wrapper, so resuming works, but the "
                f"bare model cannot load the file: save `{shown}.module.state_dict()` (and "
                f"load into `{shown}.module`) to make the checkpoint portable"
            )
            self.report(call, message, severity=Severity.INFO)
            return
        message = (
            f"`{shown}.state_dict()` of the DDP wrapper saves keys prefixed `module.`; "
            f"save `{shown}.module.state_dict()` instead"
        )
        self.report(call, message, fix=fix)

    def _check_whole_object(self, save: _Save) -> None:
        arg = keyword_arg(save.call, "obj") or positional_arg(save.call, 0)
        if arg is None:
            return
        binding = self.context.wrappers.wrapper_binding(arg.value, Place(save.ancestors, save.seq))
        if binding is None:
            return
        shown = self.context.code(arg.value)
        unwrapped = cst.Attribute(value=arg.value, attr=cst.Name("module"))
        fix = NodeFix(f"Save `{shown}.module`", ((arg.value, unwrapped),), Applicability.UNSAFE)
        message = (
            f"`torch.save({shown})` pickles the DDP wrapper, which cannot be restored "
            f"without its process group; save `{shown}.module.state_dict()` instead"
        )
        self.report(arg.value, message, severity=Severity.ERROR, fix=fix)


def _state_dict_calls(expr: cst.CSTNode) -> Iterator[cst.Call]:
    stack = [expr]
    while stack:
        node = stack.pop()
        if (
            type(node) is cst.Call
            and type(node.func) is cst.Attribute
            and node.func.attr.value == "state_dict"
            and dotted(node.func.value) is not None
        ):
            yield node
        stack.extend(node.children)
