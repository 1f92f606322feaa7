"""The DDP wrapper: where a model is wrapped, and which names hold the wrapper where.

Collected node by node during the engine's one traversal (`WrapperFacts.visit`, fed by
the engine itself: the rules read the one `context.wrappers`), or in a traversal of its
own with `collect(module)` for callers outside the engine (the migration passes). This
module is the one answer to "which names hold the DDP wrapper": the rules of the wrapping
and training-loop areas read it (`always_wrapped_in` asks it of another module's model).

- `wraps`: each `DistributedDataParallel(...)` call, the name it is bound to
  (`model`, `self.model`), the name of the module it wraps (`model` in
  `DDP(model.to(dev))`), its statement and its place in the file;
- `wrap_held(expr, ancestors, seq)`: the wrap a name or `self.attr` holds at a point
  of the script (scoped: a function's own names, a class's `self.` attributes, globals);
- `wrapper_binding(expr, place)`: the assignment of a wrapper (a helper of the file that
  returns one counted) that a name holds at a point, read in source order alone, as the
  rank-0 rules follow a saved, loaded or evaluated model; `assignment_before`, any name's;
- `wrapped_names()`, `always_wrapped(name)`: the same bindings by name alone, whatever
  the scope (a training loop in `train(model, ...)` reads the `model` that `main` wrapped
  and passed it): the names ever assigned a wrapper, and whether every assignment of a
  name is a plain wrap (so `name.no_sync()` always exists);
- `may_follow(first, second)`: whether the second place can run after the first (not in
  the other branch of the same `if`);
- `DDP_ATTRIBUTES`: the public attributes a DDP wrapper has itself (everything
  `nn.Module` defines, plus DDP's own), which never need `.module`.

Places are ancestor tuples (module first, the node last) plus a pre-order sequence
number: cheap to record, compared only for the few candidates a rule keeps.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.model import ScriptModel, unwrap_call_chain
from ddpify.analysis.names import ImportMap, dotted, find_arg, method_name
from ddpify.walk import children, is_kind, walk

DDP = "torch.nn.parallel.DistributedDataParallel"
Ancestors = tuple[cst.CSTNode, ...]

# Public attributes of a DistributedDataParallel instance (torch 2.x, read from
# `dir()` and `vars()` of a live wrapper, plus names older releases had). Reading any of
# them on the wrapper is fine; anything else raises AttributeError.
DDP_ATTRIBUTES = frozenset(
    {
        # nn.Module
        "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init",
        "children", "compile", "cpu", "cuda", "double", "dump_patches", "eval",
        "extra_repr", "float", "forward", "get_buffer", "get_extra_state",
        "get_parameter", "get_submodule", "half", "ipu", "load_state_dict", "modules",
        "mtia", "named_buffers", "named_children", "named_modules", "named_parameters",
        "parameters", "register_backward_hook", "register_buffer",
        "register_forward_hook", "register_forward_pre_hook",
        "register_full_backward_hook", "register_full_backward_pre_hook",
        "register_load_state_dict_post_hook", "register_load_state_dict_pre_hook",
        "register_module", "register_parameter", "register_state_dict_post_hook",
        "register_state_dict_pre_hook", "requires_grad_", "set_extra_state",
        "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train",
        "training", "type", "xpu", "zero_grad",
        # DistributedDataParallel
        "batched_grad_copy", "broadcast_bucket_size", "broadcast_buffers",
        "bucket_bytes_cap", "bucket_bytes_cap_default", "bucket_bytes_cap_list",
        "check_reduction", "ddp_uneven_inputs_config", "device", "device_ids",
        "device_type", "dim", "find_unused_parameters", "forward_sync_buffers", "gather",
        "gradient_as_bucket_view", "is_multi_device_module", "join", "join_device",
        "join_hook", "join_process_group", "logger", "mixed_precision", "module",
        "modules_buffers", "named_module_buffers", "no_sync", "output_device",
        "parameters_to_ignore", "process_group", "reducer", "register_comm_hook",
        "require_backward_grad_sync", "require_forward_param_sync", "scatter",
        "skip_all_reduce_unused_params", "static_graph", "to_kwargs",
        "use_side_stream_for_tensor_copies", "will_sync_module_buffers",
    }
)  # fmt: skip

# Library helpers that read a model's own attributes through `hasattr` (timm's optimizer
# factories ask for `model.no_weight_decay()`): handed the DDP wrapper, they silently
# miss them. Name -> (keyword, position) of the model argument.
READS_MODEL_ATTRIBUTES = {
    "timm.optim.create_optimizer": ("model", 1),
    "timm.optim.optim_factory.create_optimizer": ("model", 1),
    "timm.optim.create_optimizer_v2": ("model_or_params", 0),
    "timm.optim.optim_factory.create_optimizer_v2": ("model_or_params", 0),
}

# Methods of nn.Module that return the module itself.
MODULE_METHODS = frozenset(
    {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "train", "eval", "type"}
)
# How many aliases or compiles `forwarding_wrapper_binding` follows back to a wrap.
MAX_ALIASES = 3
_BRANCHING = (cst.If, cst.Else, cst.Try, cst.ExceptHandler, cst.Match, cst.IfExp)


@dataclass(frozen=True)
class Place:
    """Where a node is: its ancestors (module first, the node last) and its order."""

    ancestors: Ancestors
    seq: int

    @property
    def node(self) -> cst.CSTNode:
        return self.ancestors[-1]

    @property
    def scope(self) -> cst.CSTNode:
        """The innermost function, else the module."""
        return innermost(self.ancestors, cst.FunctionDef, cst.Module) or self.ancestors[0]

    @property
    def statement(self) -> cst.CSTNode | None:
        return innermost(self.ancestors, cst.SimpleStatementLine, cst.BaseCompoundStatement)


@dataclass(frozen=True)
class Binding:
    """One assignment `target = value`, in source order."""

    value: cst.BaseExpression
    place: Place


@dataclass(frozen=True)
class Wrap:
    """One `DistributedDataParallel(...)` call."""

    call: cst.Call
    place: Place
    target: str | None  # the name the wrapper is bound to, as written
    inner: str | None  # the name of the module it wraps, as written

    def keyword(self, name: str) -> cst.Arg | None:
        return find_arg(self.call, name)


@dataclass
class WrapperFacts:
    imports: ImportMap
    wraps: list[Wrap] = field(default_factory=list)
    seq: int = 0
    # The qualified callee of the call visited last: rules fed the same call reuse it.
    callee: str | None = None
    # (id of the binding scope, name) -> assignments, in order.
    bindings: dict[tuple[int, str], list[Binding]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # Whether a call returns a DDP wrapper: the engine counts a helper of the file that
    # returns one (`model = wrap_model(model)`); else only `DistributedDataParallel(...)`.
    returns_ddp: Callable[[cst.Call], bool] | None = None
    # Names ever assigned a wrapper (`returns_wrapper`, judged when assigned): a cheap
    # filter before `wrapper_binding`.
    wrapper_names: set[str] = field(default_factory=set)
    _wrap_by_call: dict[int, Wrap] = field(default_factory=dict)
    _last: cst.CSTNode | None = None

    # -- collection ----------------------------------------------------------------------

    def visit(self, node: cst.CSTNode, ancestors: Sequence[cst.CSTNode]) -> None:
        """Record `node` (the last of `ancestors`). Feeding one node twice in a row is a
        no-op, so several rules can feed one shared instance."""
        if node is self._last:
            return
        self._last = node
        self.seq += 1
        if type(node) is cst.Call:
            self.callee = self.imports.qualify(node.func)
            if self.callee == DDP:
                self._record_wrap(node, tuple(ancestors))
        elif type(node) is cst.Assign:
            for target in node.targets:
                self._bind(target.target, node.value, tuple(ancestors))
        elif type(node) is cst.AnnAssign and node.value is not None:
            self._bind(node.target, node.value, tuple(ancestors))

    def _record_wrap(self, call: cst.Call, ancestors: Ancestors) -> None:
        module = find_arg(call, "module", 0)
        inner = _module_name(module.value) if module is not None else None
        wrap = Wrap(call, Place(ancestors, self.seq), _assigned_name(ancestors, call), inner)
        self.wraps.append(wrap)
        self._wrap_by_call[id(call)] = wrap

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression, ancestors) -> None:
        name = dotted(target)
        if name is not None:
            key = (id(binding_scope(name, ancestors)), name)
            self.bindings[key].append(Binding(value, Place(ancestors, self.seq)))
            if self.returns_wrapper(value):
                self.wrapper_names.add(name)
        elif type(target) in (cst.Tuple, cst.List) and type(value) in (cst.Tuple, cst.List):
            for t, v in zip(target.elements, value.elements):
                self._bind(t.value, v.value, ancestors)

    # -- questions -----------------------------------------------------------------------

    def binding_of(self, name: str, place: Place) -> Binding | None:
        """The assignment `name` refers to at `place`: the latest one before it in its
        scope (a function reads a global after the whole module ran); for `self.x`, see
        `_attribute_binding`."""
        ancestors = place.ancestors
        # `model = DDP(model)`: the right-hand side reads the binding before this one.
        enclosing = {id(node) for node in ancestors}
        if name.startswith("self."):
            found = self.bindings.get((id(innermost(ancestors, cst.ClassDef)), name), [])
            found = [b for b in found if id(b.place.node) not in enclosing]
            return _attribute_binding(found, place)
        for scope in reversed(ancestors):
            if type(scope) not in (cst.FunctionDef, cst.Module):
                continue
            found = self.bindings.get((id(scope), name), [])
            found = [
                b
                for b in found
                if id(b.place.node) not in enclosing and not exclusive(b.place, place)
            ]
            before = [b for b in found if b.place.seq < place.seq]
            if type(scope) is cst.Module:
                if any(type(a) is cst.FunctionDef for a in ancestors):
                    before = found
                return before[-1] if before else None
            if found:
                return before[-1] if before else None
            if is_parameter(scope, name):
                return None
        return None

    def assignment_before(self, name: str, place: Place) -> Binding | None:
        """The assignment `name` holds at `place` in source order alone, whatever branch
        either sits in: the latest one before it in its scope (a function reads a global
        after the whole module ran); for `self.x`, the latest before it in its class,
        else the class's last. What the rank-0 rules follow (a saved or loaded name)."""
        ancestors, seq = place.ancestors, place.seq
        if name.startswith("self."):
            found = self.bindings.get((id(innermost(ancestors, cst.ClassDef)), name), [])
            before = [b for b in found if b.place.seq < seq]
            return (before or found or [None])[-1]
        for scope in reversed(ancestors):
            if type(scope) not in (cst.FunctionDef, cst.Module):
                continue
            found = self.bindings.get((id(scope), name), [])
            if type(scope) is cst.Module:
                before = [b for b in found if b.place.seq < seq]
                if any(type(a) is cst.FunctionDef for a in ancestors):
                    before = found
                return before[-1] if before else None
            if found:
                before = [b for b in found if b.place.seq < seq]
                return before[-1] if before else None
            if is_parameter(scope, name):
                return None
        return None

    def wrapper_binding(self, expr: cst.BaseExpression, place: Place) -> Binding | None:
        """The assignment of a DDP wrapper that `expr` (a name or `self.attr`) holds at
        `place` (by `assignment_before`, a helper returning a wrapper counted), if any."""
        name = dotted(expr)
        if name not in self.wrapper_names:
            return None
        binding = self.assignment_before(name, place)
        if binding is None or not self.returns_wrapper(binding.value):
            return None
        return binding

    def forwarding_wrapper_binding(
        self, expr: cst.BaseExpression, place: Place, depth: int = 0
    ) -> Binding | None:
        """The wrap whose forward `expr` runs at `place`: `wrapper_binding`'s, else one
        reached through an alias (`original_model = model`) or `torch.compile(model)`,
        whose forward is the wrapper's (`model = torch.compile(original_model)` after
        `model = DDP(model)`), a few assignments deep."""
        found = self.wrapper_binding(expr, place)
        name = dotted(expr)
        if found is not None or name is None or depth >= MAX_ALIASES:
            return found
        binding = self.assignment_before(name, place)
        if binding is None:
            return None
        value: cst.BaseExpression | None = binding.value
        if type(value) is cst.Call and self.imports.qualify(value.func) == "torch.compile":
            arg = find_arg(value, "model", 0)
            value = arg.value if arg is not None and not arg.star else None
        if value is None or dotted(value) is None:
            return None
        return self.forwarding_wrapper_binding(value, binding.place, depth + 1)

    def returns_wrapper(self, value: cst.BaseExpression) -> bool:
        """`DDP(m)`, `DDP(m).to(d)`, either branch of `x if c else y`, or with
        `returns_ddp`, a call of a helper that returns a wrapper."""
        if type(value) is cst.IfExp:
            return self.returns_wrapper(value.body) or self.returns_wrapper(value.orelse)
        call = unwrap_call_chain(value)
        if call is None:
            return False
        if self.returns_ddp is not None:
            return self.returns_ddp(call)
        return self.imports.qualify(call.func) == DDP

    def wrap_in(self, value: cst.BaseExpression) -> Wrap | None:
        """The wrap `value` evaluates to: `DDP(m)`, `DDP(m).to(dev)`, `x if c else DDP(m)`."""
        if type(value) is cst.IfExp:
            return self.wrap_in(value.body) or self.wrap_in(value.orelse)
        call = unwrap_call_chain(value)
        return self._wrap_by_call.get(id(call)) if call is not None else None

    def wrap_held(self, expr: cst.BaseExpression, place: Place) -> Wrap | None:
        """The wrap that `expr` (a name or `self.attr`) holds at `place`, if any."""
        name = dotted(expr)
        if name is None or not any(w.target == name for w in self.wraps):
            return None
        binding = self.binding_of(name, place)
        return self.wrap_in(binding.value) if binding is not None else None

    def wrapped_names(self) -> set[str]:
        """Names ever assigned a DistributedDataParallel wrapper (`model`, `self.model`),
        in any scope: `x = DDP(m)`, `x = DDP(m).to(d)`, `x = DDP(m) if c else m`."""
        if not self.wraps:
            return set()
        return {
            name
            for (_, name), bindings in self.bindings.items()
            if any(self.wrap_in(binding.value) is not None for binding in bindings)
        }

    def always_wrapped(self, name: str) -> bool:
        """Every assignment to `name`, in any scope, is a plain wrap (not `DDP(m) if c
        else m`): the name always holds a wrapper, so `name.no_sync()` always exists."""
        values = [
            binding.value
            for (_, bound), found in self.bindings.items()
            if bound == name
            for binding in found
        ]
        return bool(values) and all(
            type(value) is not cst.IfExp and self.wrap_in(value) is not None for value in values
        )

    def held_on_every_path(self, expr: cst.BaseExpression, place: Place) -> bool:
        """Whether every path reaching `place` assigned the wrapper `expr` holds there
        (not `model = DDP(model) if ddp else model`, not under an `if` around it only)."""
        name = dotted(expr)
        binding = self.binding_of(name, place) if name else None
        if binding is None or type(binding.value) is cst.IfExp:
            return False
        shared = {id(a) for a in place.ancestors}
        return all(
            id(a) in shared
            for a in binding.place.ancestors
            if isinstance(a, _BRANCHING) and not is_main_block(a)
        )


def _attribute_binding(found: list[Binding], place: Place) -> Binding | None:
    """The assignment `self.x` refers to at `place`: the latest one before it in the same
    method, else the last one in `__init__`, which runs before any other method. An
    assignment in another method may run before or after: unknown."""
    method = place.scope
    before = [b for b in found if b.place.scope is method and b.place.seq < place.seq]
    if before:
        return before[-1]
    if type(method) is cst.FunctionDef and method.name.value == "__init__":
        return None
    in_init = [
        b
        for b in found
        if type(b.place.scope) is cst.FunctionDef and b.place.scope.name.value == "__init__"
    ]
    return in_init[-1] if in_init else None


# -- helpers, also used by the rules ----------------------------------------------------

# Contexts in which no gradient is recorded: a forward there is evaluation.
NO_GRAD_CONTEXTS = frozenset(
    {
        "torch.no_grad",
        "torch.inference_mode",
        "torch.autograd.no_grad",
        "torch.autograd.grad_mode.no_grad",
        "torch.autograd.inference_mode",
        "torch.set_grad_enabled",
    }
)
# Functions whose name says they evaluate or sample rather than train.
EVAL_FUNCTION = re.compile(r"(eval|valid|test|infer|predict|generate|sample|visuali|plot|log)")


def records_gradients(ancestors: Sequence[cst.CSTNode], qualify) -> bool:
    """Whether code at the end of `ancestors` (module first) can record gradients for a
    training step: not under a no-grad context, not in a function named for evaluation."""
    for node in ancestors:
        if type(node) is cst.With:
            for item in node.items:
                call = item.item
                func = call.func if type(call) is cst.Call else call
                if qualify(func) in NO_GRAD_CONTEXTS:
                    return False
    function = innermost(ancestors, cst.FunctionDef)
    return not (function is not None and EVAL_FUNCTION.search(function.name.value.lower()))


# nn.Module's own housekeeping: runs no forward, and a DDP wrapper answers it itself.
MODULE_HOUSEKEEPING = frozenset(
    {
        "parameters",
        "named_parameters",
        "buffers",
        "named_buffers",
        "children",
        "named_children",
        "modules",
        "named_modules",
        "train",
        "eval",
        "zero_grad",
        "to",
        "cuda",
        "cpu",
        "half",
        "float",
        "requires_grad_",
        "apply",
    }
)
# nn.Module methods that run no forward: calling them through `.module` bypasses nothing.
NOT_A_FORWARD = MODULE_HOUSEKEEPING | {
    "state_dict",
    "load_state_dict",
    "get_submodule",
    "get_parameter",
    "register_buffer",
    "extra_repr",
}


def runs_model_outside_forward(tree, call: cst.Call, wrapper: str) -> bool:
    """Whether `call`, a method or submodule of the model that `wrapper` holds
    (`model.encode(x)` before the conversion, `model.module.encode(x)` after), runs part of
    the model in a training step that never calls the wrapper itself: a backward follows in
    the same loop (or loop-free function) and no `wrapper(...)` runs there, so DDP's forward
    never prepares the gradient all-reduce and the replicas drift apart (DDP033).

    A step that also calls `wrapper(...)` has DDP's forward; a method of a class in this
    file that calls no submodule (`init_hidden` making zeros) runs nothing DDP must see."""
    func = call.func
    if type(func) is not cst.Attribute or func.attr.value in NOT_A_FORWARD:
        return False
    if not _may_run_submodules(tree, func.attr.value):
        return False
    ancestors = tree.ancestors(call)
    if not records_gradients(ancestors, tree.qualify):
        return False
    loop = innermost(ancestors, cst.For, cst.While)
    function = tree.function(call)
    step = loop if loop is not None else function
    if step is not None and _calls_wrapper(tree, step, wrapper):
        return False
    for backward in tree.find(cst.Call, lambda c: method_name(c) == "backward"):
        if tree.function(backward) is not function:
            continue
        same_loop = innermost(tree.ancestors(backward), cst.For, cst.While) is loop
        if same_loop and (tree.after(backward, call) or loop is not None):
            return True
    return False


def _calls_wrapper(tree, step: cst.CSTNode, wrapper: str) -> bool:
    """`wrapper(x)` or `wrapper.forward(x)` inside `step`."""
    for call in tree.within(step, cst.Call):
        func = call.func
        if type(func) is cst.Attribute and func.attr.value == "forward":
            func = func.value
        if dotted(func) == wrapper:
            return True
    return False


def _may_run_submodules(tree, attr: str) -> bool:
    """A method of a class in this file that calls no submodule (`init_hidden` making zeros)
    runs nothing DDP must see; a submodule, or anything this file does not define, may."""
    methods = [
        f
        for cls in tree.find(cst.ClassDef)
        for f in cls.body.body
        if isinstance(f, cst.FunctionDef) and f.name.value == attr
    ]
    if not methods:
        return True
    for method in methods:
        cls = tree.parent[tree.parent[method]]
        own = {f.name.value for f in cls.body.body if isinstance(f, cst.FunctionDef)}
        for inner in tree.within(method, cst.Call):
            name = dotted(inner.func) or ""
            if name.startswith("self.") and name.split(".")[1] not in own - {"forward"}:
                return True
    return False


def innermost(ancestors: Sequence[cst.CSTNode], *types: type) -> cst.CSTNode | None:
    for node in reversed(ancestors):
        if is_kind(node, types):
            return node
    return None


def binding_scope(name: str, ancestors: Sequence[cst.CSTNode]) -> cst.CSTNode | None:
    """`self.x` lives in its class; other names in the innermost function or the module."""
    if name.startswith("self."):
        return innermost(ancestors, cst.ClassDef)
    return innermost(ancestors, cst.FunctionDef, cst.Module)


def is_parameter(function: cst.FunctionDef, name: str) -> bool:
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    for extra in (params.star_arg, params.star_kwarg):
        if type(extra) is cst.Param:
            every.append(extra)
    return any(p.name.value == name for p in every)


def is_main_block(node: cst.CSTNode) -> bool:
    """`if __name__ == "__main__":`, which every run takes."""
    return (
        type(node) is cst.If
        and type(node.test) is cst.Comparison
        and type(node.test.left) is cst.Name
        and node.test.left.value == "__name__"
    )


def exclusive(first: Place, second: Place) -> bool:
    """Whether the two places sit in different branches of one `if`/`try`/`match`, so
    that no run passes through both."""
    for index, (a, b) in enumerate(zip(first.ancestors, second.ancestors)):
        if a is not b:
            return False
        if isinstance(a, _BRANCHING) and not is_main_block(a):
            after = index + 1
            if after < len(first.ancestors) and after < len(second.ancestors):
                if first.ancestors[after] is not second.ancestors[after]:
                    return True
    return False


def conditions_between(binding: Place, place: Place) -> list[cst.BaseExpression]:
    """Tests of the `if`s around `binding` that do not also hold `place`: the conditions
    under which the binding ran while `place` runs either way."""
    shared = {id(node) for node in place.ancestors}
    return [
        node.test
        for node in binding.ancestors
        if type(node) in (cst.If, cst.IfExp) and id(node) not in shared
    ]


def may_follow(first: Place, second: Place) -> bool:
    """Whether `second` can run after `first`: later in the file, in the same scope, and
    not in another branch of an `if`/`try`/`match` that holds `first`."""
    if second.seq <= first.seq or first.scope is not second.scope:
        return False
    return not exclusive(first, second)  # `if c: wrap` ... `else: use`


def sibling_after(first: cst.CSTNode, parent: cst.CSTNode) -> cst.CSTNode | None:
    """The statement right after `first` in the block `parent`, if any."""
    body = getattr(parent, "body", None)
    if not isinstance(body, (list, tuple)):
        return None
    for index, statement in enumerate(body):
        if statement is first:
            return body[index + 1] if index + 1 < len(body) else None
    return None


def names_rooted_at(expr: cst.CSTNode) -> Iterator[str]:
    """Dotted names (`model.module.fc`) and their prefixes that occur in `expr`."""
    stack = [expr]
    while stack:
        node = stack.pop()
        name = dotted(node) if type(node) in (cst.Name, cst.Attribute) else None
        if name is not None:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                yield ".".join(parts[:end])
            continue
        stack.extend(children(node))


def _module_name(expr: cst.BaseExpression) -> str | None:
    """`model` for `model`, `model.to(dev)`, `model.cuda().half()`; None for `Net()`."""
    while (
        type(expr) is cst.Call
        and type(expr.func) is cst.Attribute
        and expr.func.attr.value in MODULE_METHODS
    ):
        expr = expr.func.value
    return dotted(expr)


def _assigned_name(ancestors: Ancestors, call: cst.Call) -> str | None:
    """The target of `target = DDP(...)` (through `.to()` chains and `x if c else y`)."""
    child: cst.CSTNode = call
    for node in reversed(ancestors[:-1]):
        if type(node) is cst.Assign:
            return dotted(node.targets[0].target) if len(node.targets) == 1 else None
        if type(node) is cst.AnnAssign:
            return dotted(node.target)
        chained = (
            (type(node) is cst.Attribute and node.value is child)
            or (type(node) is cst.Call and node.func is child)
            or (type(node) is cst.IfExp and child is not node.test)
        )
        if not chained:
            return None
        child = node
    return None


# -- access --------------------------------------------------------------------------

# The nodes `WrapperFacts.visit` records (by exact type): what the engine feeds it.
FED_TYPES = frozenset({cst.Call, cst.Assign, cst.AnnAssign})


def wraps_ddp(imports: ImportMap, value: cst.BaseExpression) -> bool:
    """`DDP(m, ...)`, `DDP(m).to(d)`, `DDP(m) if distributed else m`, judged with
    `imports` as they stand: for a module read outside the engine's walk."""
    if type(value) is cst.IfExp:
        return wraps_ddp(imports, value.body) or wraps_ddp(imports, value.orelse)
    call = unwrap_call_chain(value)
    return call is not None and imports.qualify(call.func) == DDP


def always_wrapped_in(model: ScriptModel, name: str) -> bool:
    """`WrapperFacts.always_wrapped` for another module of the project, from its script
    model (the modules that import a helper are read, not walked by the engine)."""
    values = model.bindings.get(name, [])
    return bool(values) and all(
        type(v) is not cst.IfExp and wraps_ddp(model.imports, v) for v in values
    )


def collect(module: cst.Module) -> WrapperFacts:
    """Wrapper facts of `module`, from a traversal of its own (outside the lint engine)."""
    return collect_with_calls(module, lambda call: False)[0]


def collect_with_calls(
    module: cst.Module, wanted: Callable[[cst.Call], bool]
) -> tuple[WrapperFacts, list[tuple[cst.Call, Place]]]:
    """`collect`, plus the place of every call `wanted` keeps: what a name holds there
    (`wrapper_binding`) can then be asked of another module of the project."""
    imports = ImportMap()
    facts = WrapperFacts(imports)
    model = ScriptModel(imports)
    ancestors: list[cst.CSTNode] = []
    calls: list[tuple[cst.Call, Place]] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        model.visit(node)  # keeps the import map current
        facts.visit(node, ancestors)
        if type(node) is cst.Call and wanted(node):
            calls.append((node, Place(tuple(ancestors), facts.seq)))

    walk(module, enter, lambda node: ancestors.pop())
    return facts, calls
