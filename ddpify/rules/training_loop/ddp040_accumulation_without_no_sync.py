"""DDP040: gradient accumulation that all-reduces on every micro-step.

The pattern: a loop whose body runs a backward on every iteration and steps the
optimizer only under an accumulation test (`if (i + 1) % accum == 0:`), with the
DDP wrapper's forward in the loop and no `no_sync` anywhere in the file. The backward
may run in a loop of its own inside that body (a rollout over time steps): the step
is then in the enclosing loop. A `no_sync`
block around the backward alone (the forward ran before it) is reported too: DDP
decides in the forward whether the next backward synchronises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.accumulation import (
    Phase,
    counted_by_hand,
    flag_synced_phase,
    nested_backward,
    step_phases,
    steps_every_nth,
    synced_phase,
)
from ddpify.analysis.call_sites import constructor_arguments
from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.roles import optimizer_names
from ddpify.analysis.training import (
    DDP,
    Located,
    accumulation_test,
    is_optimizer_step,
    names_of,
    own_nodes,
    walk_subtree,
)
from ddpify.analysis.wrappers import WrapperFacts, always_wrapped_in, wraps_ddp
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.training_loop._common import LoopRule
from ddpify.walk import SubtreeMemo, children

_MODEL_NAME = re.compile(r"^(ddp_)?(model|net|network|module)$", re.I)
_ASSIGNING = (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.NamedExpr, cst.For)


@dataclass(frozen=True)
class _Accumulation:
    """One accumulation loop: its body statements and where backward and step are."""

    loop: Located
    body: list[cst.BaseStatement]
    wrapper: str
    backward: cst.Call
    backward_index: int  # the body statement holding the backward
    step_if: cst.If  # the `if <accumulation test>:` that steps the optimizer
    forward_index: int | None  # the first body statement that uses the wrapper (None:
    # no fix; the backward is in a nested loop)


class AccumulationWithoutNoSync(LoopRule):
    """Accumulation micro-steps that all-reduce gradients nobody uses yet."""

    CODE = "DDP040"
    NAME = "accumulation-without-no_sync"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "the backward all-reduces gradients on every accumulation micro-step; run the "
        "forward and backward of the micro-steps under `model.no_sync()`"
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self._optimizer_names: set[str] | None = None
        self._micro_steps: dict[int, _MicroStep | None] = {}  # loop node id -> its step

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in ("no_sync", "require_backward_grad_sync"):
            self._feed(node)

    def leave_Module(self, node: cst.Module) -> None:
        # The author's own `no_sync` test is wrong or right whatever else the file
        # imports (an optional DeepSpeed backend does not make this DDP code go away).
        self._check_sync_phase(node)
        model = self.context.model
        if not model.method_calls.get("backward") or not self.applies():
            return
        wrappers = self.context.wrappers.wrapped_names()
        imports_ddp = DDP in self.context.imports.aliases.values()
        if not wrappers and not imports_ddp:
            imports_ddp = self._wrapped_in_another_module()
        if not wrappers and not imports_ddp:
            return
        # A loop body, or a `train_step` function called once per micro-step.
        reported: set[int] = set()
        for unit in self._units():
            if self.loops.no_sync_near(unit):
                if wrappers and type(unit.node) is not cst.FunctionDef:
                    self._check_partial(unit, wrappers)
                continue
            found = self._accumulation_around(unit, wrappers)
            if found is None and imports_ddp:
                found = self._accumulation_around(unit, {"<any>"}, any_model=True)
                if found is not None and id(found.loop.node) not in reported:
                    self._report_unknown_wrapper(found)
            elif found is not None and id(found.loop.node) not in reported:
                self._report(found)
            if found is not None:
                reported.add(id(found.loop.node))

    def _optimizers(self) -> set[str]:
        """The names the shared analysis knows hold optimizers (`g_solver`)."""
        if self._optimizer_names is None:
            self._optimizer_names = optimizer_names(self.context.tree)
        return self._optimizer_names

    def _units(self) -> list[Located]:
        backwards = self.context.model.method_calls.get("backward", [])
        return self.loops.units_with_backward(self.context.tree, backwards)

    def _accumulation_around(
        self, unit: Located, wrappers: set[str], any_model: bool = False
    ) -> _Accumulation | None:
        """The accumulation pattern in the unit holding a backward, else in a loop around
        it within the same function: the loop that steps the optimizer may enclose the
        one that runs the backward (a rollout over time steps per batch)."""
        found = self._accumulation(unit, wrappers, any_model)
        if found is not None or type(unit.node) is cst.FunctionDef:
            return found
        for outer in self._enclosing_loops(unit):
            found = self._accumulation(outer, wrappers, any_model)
            if found is not None:
                return found
        return None

    def _accumulation(
        self, loop: Located, wrappers: set[str], any_model: bool
    ) -> _Accumulation | None:
        """`_accumulation`, finding each loop's micro-step once: `leave_Module` asks about
        each unit up to three times (its wrappers, any model, whether another module
        wraps), and finding the backward walks the loop's statements."""
        steps = self._micro_steps
        if id(loop.node) not in steps:
            steps[id(loop.node)] = _micro_step(self.context.model, loop, self._optimizers())
        step = steps[id(loop.node)]
        return None if step is None else _accumulation(loop, step, wrappers, any_model)

    def _enclosing_loops(self, unit: Located) -> list[Located]:
        """The loops around `unit`'s loop, innermost first, up to its function."""
        loops = {id(loop.node): loop for loop in self.loops.loops}
        found = []
        for node in reversed(unit.ancestors[:-1]):
            if type(node) in (cst.FunctionDef, cst.ClassDef, cst.Lambda):
                break
            if id(node) in loops:
                found.append(loops[id(node)])
        return found

    def _wrapped_in_another_module(self) -> bool:
        """A distributed module (a trainer) whose model arrives from elsewhere, in a project
        where another module wraps models in DDP: the wrapper may well be what it trains.
        Asked only when the file has an accumulation loop (the project scan is lazy)."""
        model = self.context.model
        if not model.is_distributed or model.framework is not None:
            return False
        units = [unit for unit in self._units() if not self.loops.no_sync_near(unit)]
        if not any(self._accumulation_around(u, {"<any>"}, any_model=True) for u in units):
            return False
        return bool(self.context.ddp_wrapping_modules())

    def _report_unknown_wrapper(self, found: _Accumulation) -> None:
        """The model is wrapped elsewhere (it arrives as an argument or attribute):
        the same pattern, at info level, since it may not be DDP at all; a warning when
        every module that builds the class hands it a DDP wrapper."""
        if self._wrapped_by_every_caller(found):
            self._report(found)
            return
        backward = self.context.code(found.backward.func).removesuffix(".backward")
        test = self.context.code(found.step_if.test)
        message = (
            f"`{backward}.backward()` runs on every micro-step while the optimizer steps only "
            f"when `{test}`; if `{found.wrapper}` is a DistributedDataParallel wrapper, every "
            f"micro-step all-reduces the gradients: run them under `{found.wrapper}.no_sync()`"
        )
        self.report(found.backward, message, severity=Severity.INFO)

    def _wrapped_by_every_caller(self, found: _Accumulation) -> bool:
        """`self.model` of a class whose `__init__` stores its `model` parameter there,
        built (`Trainer(ddp_model, ...)`) only with DDP wrappers by the modules that import
        this one: then the wrap is proven, not guessed."""
        head, _, attribute = found.wrapper.partition(".")
        cls = found.loop.scope()
        if head != "self" or not attribute or type(cls) is not cst.ClassDef:
            return False
        values = self.context.model.bindings.get(found.wrapper, [])
        if len(values) != 1 or type(values[0]) is not cst.Name:
            return False
        if not any(node is values[0] for node in walk_subtree(cls)):
            return False  # another class of the module stores it
        helper = self.context.local.file
        if helper is None:
            return False
        passed = constructor_arguments(
            cls, values[0].value, helper, self.context.importing_modules()
        )
        return bool(passed) and all(_is_ddp(model, value) for model, value in passed)

    # -- the plain case: no no_sync at all ------------------------------------------

    def _report(self, found: _Accumulation) -> None:
        backward = self.context.code(found.backward.func).removesuffix(".backward")
        test = self.context.code(found.step_if.test)
        message = (
            f"`{backward}.backward()` all-reduces the gradients on every micro-step, but the "
            f"optimizer steps only when `{test}`; run the forward and backward of the other "
            f"micro-steps under `{found.wrapper}.no_sync()`"
        )
        self.report(found.backward, message, fix=self._fix(found))

    def _fix(self, found: _Accumulation) -> NodeFix | None:
        if found.forward_index is None:
            return None
        if not _safe_to_wrap(self.context.wrappers, found, self._optimizers()):
            return None
        nullcontext, import_fix = self._nullcontext()
        if nullcontext is None:
            return None
        test = found.step_if.test
        shown = self.context.code(test).strip()
        if type(test) in (cst.BooleanOperation, cst.IfExp, cst.NamedExpr):
            shown = f"({shown})"
        header = f"with {nullcontext}() if {shown} else {found.wrapper}.no_sync():\n    pass\n"
        template = cst.parse_statement(header)
        wrapped = found.body[found.forward_index : found.backward_index + 1]
        first = wrapped[0]
        block = cst.IndentedBlock(body=[wrapped[0].with_changes(leading_lines=()), *wrapped[1:]])
        with_statement = template.with_changes(body=block, leading_lines=first.leading_lines)
        body = list(found.body)
        body[found.forward_index : found.backward_index + 1] = [with_statement]
        loop_body = found.loop.node.body
        replacements = [(loop_body, loop_body.with_changes(body=body))]
        if import_fix is not None:
            replacements.append(import_fix)
        return NodeFix(
            f"Run the micro-steps' forward and backward under `{found.wrapper}.no_sync()`",
            tuple(replacements),
            Applicability.SAFE,
        )

    def _nullcontext(self) -> tuple[str | None, tuple[cst.CSTNode, cst.CSTNode] | None]:
        """How to spell `contextlib.nullcontext`, and an import to add when there is none."""
        aliases = self.context.imports.aliases
        for local, full in aliases.items():
            if full == "contextlib.nullcontext":
                return local, None
            if full == "contextlib":
                return f"{local}.nullcontext", None
        module = self.context.module
        for statement in module.body:
            if _is_plain_import(statement):
                new = cst.parse_statement("import contextlib\n")
                flattened = cst.FlattenSentinel(
                    [
                        new.with_changes(leading_lines=statement.leading_lines),
                        statement.with_changes(leading_lines=()),
                    ]
                )
                return "contextlib.nullcontext", (statement, flattened)
        return None, None

    # -- no_sync on the wrong micro-step --------------------------------------------

    def _check_sync_phase(self, module: cst.Module) -> None:
        """`model.no_sync if i % accum != 0 else nullcontext` (or
        `model.require_backward_grad_sync = i % accum == 0`) while the optimizer steps
        when `(i + 1) % accum == 0`: the micro-step that all-reduces is not the one the
        optimizer steps after, so it applies gradients that differ between ranks."""
        model = self.context.model
        synced = [
            (m, synced_phase(m.ancestors, model))
            if m.node.attr.value == "no_sync"
            else (m, flag_synced_phase(m.ancestors, model))
            for m in self.loops.no_sync
        ]
        synced = [(m, phase) for m, phase in synced if phase is not None]
        if not synced:
            return  # the common case: no extra walk
        steps = list(step_phases(module, model, self._optimizers()))
        for mention, phase in synced:
            windows = {step for step in steps if step.same_window(phase)}
            if len(windows) != 1:
                continue  # no step test on this window, or several that disagree
            step = windows.pop()
            if step == phase or not step.on_zero or counted_by_hand(module, phase.counter):
                continue
            self.report(mention.node, _phase_message(mention.node.attr.value, phase, step))

    # -- no_sync around the backward only ------------------------------------------

    def _check_partial(self, loop: Located, wrappers: set[str]) -> None:
        """`with model.no_sync(): loss.backward()` after a forward outside the block."""
        for node in own_nodes(loop.node):
            if type(node) is not cst.With:
                continue
            for item in node.items:
                call = item.item
                if not (type(call) is cst.Call and method_name(call) == "no_sync"):
                    continue
                wrapper = dotted(call.func.value)  # type: ignore[attr-defined]
                if wrapper in wrappers and _forward_outside(loop.node, node, wrapper):
                    message = (
                        f"`{self.context.code(call)}` wraps the backward only; the forward ran "
                        "outside it, so the gradients are still all-reduced on every "
                        "micro-step; move the forward into the `no_sync` block"
                    )
                    self.report(call, message)


def _phase_message(control: str, synced: Phase, step: Phase) -> str:
    if control == "no_sync":
        chosen = f"`no_sync` is left off when `{synced.shown()}`"
        advice = f"skip `no_sync` exactly when `{step.shown()}`"
    else:
        chosen = f"`{control}` is set when `{synced.shown()}`"
        advice = f"set it exactly when `{step.shown()}`"
    return (
        f"{chosen}, but the optimizer steps when `{step.shown()}`: the micro-step that "
        "all-reduces is not the one before the step, so the step applies gradients "
        f"accumulated without synchronisation, which differ between ranks; {advice}"
    )


def _forward_outside(loop: cst.CSTNode, block: cst.With, wrapper: str) -> bool:
    """The block runs a backward but not the wrapper, which the loop calls elsewhere."""
    inside = list(own_nodes(block.body))
    if not any(type(n) is cst.Call and method_name(n) == "backward" for n in inside):
        return False
    if wrapper in names_of(block.body):
        return False
    ids = {id(n) for n in inside}
    return any(
        type(n) is cst.Call and dotted(n.func) == wrapper and id(n) not in ids
        for n in own_nodes(loop)
    )


def _is_ddp(model, value: cst.BaseExpression) -> bool:
    """`DDP(m)` itself, or a name every assignment of which is one (in `model`'s module)."""
    if wraps_ddp(model.imports, value) and type(value) is not cst.IfExp:
        return True
    name = dotted(value)
    return name is not None and always_wrapped_in(model, name)


def _is_plain_import(statement: cst.CSTNode) -> bool:
    """A top-level `import x` / `from x import y` line (not `from __future__`)."""
    if type(statement) is not cst.SimpleStatementLine:
        return False
    for small in statement.body:
        if type(small) is cst.Import:
            return True
        if type(small) is cst.ImportFrom:
            return dotted(small.module) != "__future__" if small.module else True
    return False


@dataclass
class _MicroStep:
    """A loop or function body that runs a backward and, after it, an `if` stepping the
    optimizer: accumulation, whichever model it trains."""

    body: list[cst.BaseStatement]
    index: int  # the body statement running the backward
    backward: cst.Call
    nested: bool  # the backward runs in a loop nested in that statement
    step_if: cst.If


def _micro_step(model, loop: Located, optimizers: set[str]) -> _MicroStep | None:
    node = loop.node
    if type(node.body) is not cst.IndentedBlock:
        return None
    body = list(node.body.body)
    backward = _BACKWARD_IN(node)
    nested = backward is None and type(node) in (cst.For, cst.While)
    if nested:
        backward = _nested_backward_in(body, node, optimizers)
    if backward is None:
        return None
    index, call = backward
    step_if = _accumulation_step(model, body, index + 1, optimizers)
    if step_if is None:
        return None
    return _MicroStep(body, index, call, nested, step_if)


def _accumulation(
    loop: Located, step: _MicroStep, wrappers: set[str], any_model: bool = False
) -> _Accumulation | None:
    """The accumulation pattern of `step` with a DDP wrapper; `any_model`: take the first
    name that reads as a model (`self.model`, `net`) for the wrapper."""
    node = loop.node
    body, index, call, nested, step_if = (
        step.body,
        step.index,
        step.backward,
        step.nested,
        step.step_if,
    )
    used = _NAMES_OF(node)
    if any_model:
        wrappers = {name for name in used if _MODEL_NAME.search(name.rsplit(".", 1)[-1])}
    wrapper = next((w for w in sorted(wrappers) if w in used), None)
    if wrapper is None:
        return None
    forward = next((i for i, s in enumerate(body[: index + 1]) if wrapper in names_of(s)), None)
    return _Accumulation(loop, body, wrapper, call, index, step_if, None if nested else forward)


def _nested_backward_in(
    body: list[cst.BaseStatement], loop: cst.For | cst.While, optimizers: set[str]
) -> tuple[int, cst.Call] | None:
    """The body statement (and the call) running `.backward()` from a loop nested in it
    on every iteration of `loop` (see `nested_backward`); not one that also steps the
    optimizer itself (every backward may then be followed by its step)."""
    for index, statement in enumerate(body):
        call = nested_backward(statement, loop)
        if call is None:
            continue
        steps = own_nodes(statement)
        if any(type(n) is cst.Call and is_optimizer_step(n, optimizers) for n in steps):
            return None
        return index, call
    return None


# Per loop (or step function), its subtree alone: kept across the language server's lints.
_BACKWARD_IN = SubtreeMemo(lambda node: _backward_in(list(node.body.body)))
_NAMES_OF = SubtreeMemo(lambda node: frozenset(names_of(node)))


def _backward_in(body: list[cst.BaseStatement]) -> tuple[int, cst.Call] | None:
    """The body statement (and the call) running `.backward()` on every iteration:
    directly, or in a `with` block (autocast, no_sync), never under an `if`."""
    for index, statement in enumerate(body):
        for node in _unconditional(statement):
            if type(node) is cst.Call and method_name(node) == "backward":
                return index, node
    return None


_CONDITIONAL = (cst.If, cst.For, cst.While, cst.Try, cst.FunctionDef, cst.Lambda, cst.ClassDef)
# type -> whether its body may not run when it does: asked by exact type, cached, since
# `isinstance` against libcst's ABC node classes goes through ABCMeta's check per class
# (this runs for every node of every loop body, on every lint: the language server's).
_conditional_types: dict[type, bool] = {}


def _unconditional(statement: cst.CSTNode):
    """Nodes of `statement` that run whenever it runs (not under an if, loop or try)."""
    stack = [statement]
    while stack:
        node = stack.pop()
        yield node
        node_type = type(node)
        conditional = _conditional_types.get(node_type)
        if conditional is None:
            conditional = _conditional_types[node_type] = issubclass(node_type, _CONDITIONAL)
        if not conditional:
            found = list(children(node))
            found.reverse()
            stack.extend(found)


def _accumulation_step(
    model, body: list[cst.BaseStatement], start: int, optimizers: set[str]
) -> cst.If | None:
    """The `if` among `body[start:]` (after the backward) that steps the optimizer on
    the last micro-step of a window: its test names an accumulation count, or the loop
    has the shape of accumulation (`steps_every_nth`)."""
    for statement in body[start:]:
        if type(statement) is not cst.If:
            continue
        if accumulation_test(statement.test, model) or steps_every_nth(statement, body, optimizers):
            if any(
                type(n) is cst.Call and is_optimizer_step(n, optimizers)
                for n in own_nodes(statement.body)
            ):
                return statement
    return None


def _safe_to_wrap(wrappers: WrapperFacts, found: _Accumulation, optimizers: set[str]) -> bool:
    """The fix evaluates the step test before the forward: it must mean the same there.

    So: the wrapper is always a DDP object (it has `no_sync`), the test calls nothing
    but `len` and reads nothing the loop body assigns, and the loop steps the optimizer
    nowhere else (a step outside the test would use unsynchronised gradients).
    """
    if not wrappers.always_wrapped(found.wrapper):
        return False
    test = found.step_if.test
    for node in own_nodes(test):
        if type(node) is cst.Call and dotted(node.func) not in {"len", "int"}:
            return False
    assigned = set()
    for node in own_nodes(found.loop.node.body):
        if isinstance(node, _ASSIGNING):
            targets = _targets(node)
            assigned |= {name for t in targets for name in names_of(t)}
    if names_of(test) & assigned:
        return False
    steps = [
        n
        for n in own_nodes(found.loop.node.body)
        if type(n) is cst.Call and is_optimizer_step(n, optimizers)
    ]
    in_test = {id(n) for n in own_nodes(found.step_if.body) if type(n) is cst.Call}
    if not all(id(step) in in_test for step in steps):
        return False
    # A step after the loop (flushing the last partial window) would use gradients the
    # no_sync micro-steps left unsynchronised.
    scope = found.loop.function() or found.loop.ancestors[0]
    inside = {id(n) for n in own_nodes(found.loop.node)}
    return not any(
        type(n) is cst.Call and is_optimizer_step(n, optimizers) and id(n) not in inside
        for n in own_nodes(scope)
    )


def _targets(node: cst.CSTNode) -> list[cst.CSTNode]:
    if type(node) is cst.Assign:
        return [t.target for t in node.targets]
    if type(node) in (cst.AugAssign, cst.AnnAssign, cst.NamedExpr, cst.For):
        return [node.target]
    return []
