"""Facts the rank-0 rules share: where each helper is called from, what a name is bound
to, and whether a node runs on rank 0 only (which names hold the DDP wrapper at a point
of the script is `context.wrappers.wrapper_binding`, ddpify/analysis/wrappers.py).

The engine visits once; the rules record candidates with a snapshot of their ancestors
and decide in `leave_Module`, when every helper's call sites are known. Snapshots are
tuples of references, so recording is cheap; guards are evaluated only for candidates
and for the call sites of helpers that contain one.
"""

from __future__ import annotations

import re
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst

from ddpify.analysis.guards import (
    Guard,
    Scope,
    classify,
    excludes_rank_zero,
    rank_zero_scope,
)
from ddpify.analysis.names import and_terms, dotted, find_arg
from ddpify.analysis.training import parameter_index
from ddpify.analysis.wrappers import Binding as WrapperBinding
from ddpify.rules.base import Rule
from ddpify.walk import children, is_kind

if TYPE_CHECKING:
    from ddpify.engine import Context

Ancestors = tuple[cst.CSTNode, ...]

DIST = "torch.distributed"
SPAWN_CALLS = {
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
}
PROCESS_CALLS = {"multiprocessing.Process", "torch.multiprocessing.Process"}
_PER_PROCESS_IDENTIFIERS = {"gpu", "gpu_id", "local_gpu", "device_id", "gpu_idx"}
_MAIN_PREDICATE = re.compile(
    r"^(is_|on_)?(local_|global_)?(main|master|primary|chief|rank_?0|rank_?zero|global_zero)"
    r"(_process|_proc|_rank|_node|_worker|_gpu)?(_only)?$"
)

_facts: weakref.WeakKeyDictionary[Context, RankZeroFacts] = weakref.WeakKeyDictionary()


def facts_for(context: Context) -> RankZeroFacts:
    """One shared record per linted file, whichever of the rank-0 rules are enabled."""
    found = _facts.get(context)
    if found is None:
        found = _facts[context] = RankZeroFacts(context)
    return found


def mentions_rank(node: cst.CSTNode) -> bool:
    """Whether an expression names a rank or a rank-0 predicate (`rank`, `is_main`...).

    Only identifiers count: the text `"rank0.pt"` is the same file on every rank.
    """
    for name in _names(node):
        lowered = name.lower()
        if "rank" in lowered or lowered in _PER_PROCESS_IDENTIFIERS:
            return True
        if _MAIN_PREDICATE.match(lowered):
            return True
    return False


def _names(node: cst.CSTNode) -> Iterator[str]:
    stack = [node]
    while stack:
        current = stack.pop()
        if type(current) is cst.Name:
            yield current.value
        stack.extend(children(current))


def keyword_arg(call: cst.Call, *keywords: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in keywords:
            return arg
    return None


def positional_arg(call: cst.Call, index: int) -> cst.Arg | None:
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[index] if index < len(positional) else None


def last_name(expr: cst.BaseExpression) -> str:
    """`save` for `torch.save`, `self.save` or `save`; "" for any other callee."""
    if type(expr) is cst.Attribute:  # exact types: see ddpify.walk.is_kind
        return expr.attr.value
    return expr.value if type(expr) is cst.Name else ""


def innermost(ancestors: Sequence[cst.CSTNode], *types: type) -> cst.CSTNode | None:
    for node in reversed(ancestors):
        if is_kind(node, types):
            return node
    return None


def statement_of(ancestors: Sequence[cst.CSTNode]) -> cst.CSTNode | None:
    """The statement a node belongs to: one finding per statement is enough."""
    return innermost(ancestors, cst.SimpleStatementLine, cst.BaseCompoundStatement)


# -- guards -------------------------------------------------------------------------------


def _is_main_check(test: cst.BaseExpression) -> bool:
    """`__name__ == "__main__"`."""
    return (
        type(test) is cst.Comparison
        and type(test.left) is cst.Name
        and test.left.value == "__name__"
    )


def non_zero_guarded(ancestors: Sequence[cst.CSTNode]) -> bool:
    """Whether the last node runs on the ranks other than 0 (`if rank != 0:`, `else:`,
    `if not is_leader and num_gpus > 1:`)."""
    for parent, child in zip(ancestors, ancestors[1:]):
        if type(parent) is not cst.If:
            continue
        if child is parent.body and excludes_rank_zero(parent.test):
            return True
        guard = classify(parent.test)
        if guard is not None and guard[0] is Guard.RANK_ZERO and child is parent.orelse:
            return True
    return False


def under_main_block(ancestors: Sequence[cst.CSTNode]) -> bool:
    return any(
        type(parent) is cst.If and child is parent.body and _is_main_check(parent.test)
        for parent, child in zip(ancestors, ancestors[1:])
    )


# -- call sites of the script's own functions ----------------------------------------------


@dataclass(frozen=True)
class Site:
    """Where a function of the script is called or handed on (`mp.spawn(worker)`)."""

    ancestors: Ancestors
    every_rank: bool = False  # the target of mp.spawn / Process: runs in every worker
    receiver: str | None = None  # `evaluator` of `evaluator.evaluate()`


@dataclass(frozen=True)
class Resolution:
    """Whether code runs on rank 0 only: `scope` None means on every rank."""

    scope: Scope | None
    known: bool = True  # False: a helper never called in this file
    helper: str | None = None  # the function whose call sites decided it


UNKNOWN = Resolution(None, known=False)
# How many functions deep `rank_zero_path` follows call sites.
MAX_CALL_CHAIN = 4
EVERY_RANK = Resolution(None)
# A call site inside the helper itself (recursion, or `self.optimizer.step()` inside a
# method named `step`): it says nothing about where the helper runs.
_RECURSIVE = Resolution(None, known=False, helper="<recursive>")


# -- bindings -------------------------------------------------------------------------------


@dataclass
class Binding:
    """One assignment `target = value` (or `target[...] = value`), in source order."""

    seq: int
    value: cst.BaseExpression
    ancestors: Ancestors
    item: bool = False  # `target[key] = value`: adds to the object, does not rebind


@dataclass
class RankZeroFacts:
    context: Context
    seq: int = 0
    sites: dict[str, list[Site]] = field(default_factory=lambda: defaultdict(list))
    method_sites: dict[str, list[Site]] = field(default_factory=lambda: defaultdict(list))
    bindings: dict[tuple[int, str], list[Binding]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # The same bindings by name alone, whatever the scope: what `assigned_anywhere` reads.
    bindings_by_name: dict[str, list[Binding]] = field(default_factory=lambda: defaultdict(list))
    callee: str | None = None  # the qualified name of the call visited last
    _seen: dict[str, cst.CSTNode] = field(default_factory=dict)
    _resolved: dict[tuple[str, bool, bool], Resolution] = field(default_factory=dict)

    def first_visit(self, node: cst.CSTNode) -> bool:
        """Several rules feed the facts; each node is recorded once."""
        kind = type(node).__name__
        if self._seen.get(kind) is node:
            return False
        self._seen[kind] = node
        # The engine's wrapper facts number the same nodes (calls, assignments) as they
        # are visited: one order, so a place here can be asked about there.
        self.seq = self.context.wrappers.seq
        return True

    # -- recording ---------------------------------------------------------------------

    def record_call(self, call: cst.Call) -> None:
        if not self.first_visit(call):
            return
        ancestors = tuple(self.context.ancestors)
        qualified = self.callee = self.context.qualify(call.func)
        if qualified is None:
            if type(call.func) is cst.Name:  # exact types: see ddpify.walk.is_kind
                self.sites[call.func.value].append(Site(ancestors))
            elif type(call.func) is cst.Attribute:
                receiver = dotted(call.func.value)
                site = Site(ancestors, receiver=receiver)
                self.method_sites[call.func.attr.value].append(site)
        spawned = self._spawned_function(call, qualified)
        for arg in call.args:
            if type(arg.value) is cst.Name:
                site = Site(ancestors, every_rank=arg.value is spawned)
                self.sites[arg.value.value].append(site)
            elif type(arg.value) is cst.Attribute and self.context.qualify(arg.value) is None:
                site = Site(ancestors, every_rank=arg.value is spawned)
                self.method_sites[arg.value.attr.value].append(site)

    @staticmethod
    def _spawned_function(call: cst.Call, qualified: str | None) -> cst.BaseExpression | None:
        arg = None
        if qualified in SPAWN_CALLS:
            arg = keyword_arg(call, "fn") or positional_arg(call, 0)
        elif qualified in PROCESS_CALLS:
            arg = keyword_arg(call, "target")
        return arg.value if arg else None

    def record_assign(self, node: cst.Assign | cst.AnnAssign) -> None:
        if not self.first_visit(node) or node.value is None:
            return
        ancestors = tuple(self.context.ancestors)
        if type(node) is cst.Assign:
            targets = [t.target for t in node.targets]
        else:
            targets = [node.target]
        for target in targets:
            self._bind(target, node.value, ancestors)

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression, ancestors) -> None:
        item = False
        if type(target) is cst.Subscript:
            target, item = target.value, True
        name = dotted(target)
        if name is not None:
            key = (id(binding_scope(name, ancestors)), name)
            binding = Binding(self.seq, value, ancestors, item)
            self.bindings[key].append(binding)
            self.bindings_by_name[name].append(binding)
        elif type(target) in (cst.Tuple, cst.List) and type(value) in (cst.Tuple, cst.List):
            for t, v in zip(target.elements, value.elements):
                self._bind(t.value, v.value, ancestors)

    # -- whole-file questions ----------------------------------------------------------

    def spawns_workers(self) -> bool:
        """mp.spawn scripts: the `__main__` block runs once, in the launching process."""
        return self.context.model.calls_any(*SPAWN_CALLS, *PROCESS_CALLS)

    def resolve(self, ancestors: Ancestors, *, launcher_counts: bool = True) -> Resolution:
        """Whether the last node of `ancestors` runs on rank 0 only.

        A node in a helper inherits the weakest guard of the helper's call sites.
        `launcher_counts`: code under `__main__` in an mp.spawn script runs once.
        """
        return self._resolve(ancestors, launcher_counts, set())

    def _resolve(self, ancestors: Ancestors, launcher_counts: bool, active: set) -> Resolution:
        scope = rank_zero_scope(ancestors) or self._flag_guard_scope(ancestors)
        if scope is not None:
            return Resolution(scope)
        if launcher_counts and self.spawns_workers() and under_main_block(ancestors):
            return Resolution(Scope.GLOBAL)
        function = innermost(ancestors, cst.FunctionDef)
        if function is None:
            return EVERY_RANK
        return self._function(function, ancestors, launcher_counts, active)

    def _flag_guard_scope(self, ancestors: Ancestors) -> Scope | None:
        """`if args.should_save:` where every assignment of `args.should_save` in the file
        is a rank-0 test (`... and is_master(args)`): a guard kept in a flag."""
        scopes = map(self._flag_scope, _required_names(ancestors))
        return next((scope for scope in scopes if scope is not None), None)

    def is_guard_flag(self, name: str) -> bool:
        return self._flag_scope(name) is not None

    def assigned_anywhere(self, name: str) -> list[cst.BaseExpression]:
        """Every value `name` is assigned in the file, in any scope (`x[k] = v` aside)."""
        return [b.value for b in self.bindings_by_name.get(name, ()) if not b.item]

    def _flag_scope(self, name: str) -> Scope | None:
        values = self.assigned_anywhere(name)
        guards = [classify(value) for value in values]
        if not values or not all(g is not None and g[0] is Guard.RANK_ZERO for g in guards):
            return None
        return Scope.LOCAL if any(g[1] is Scope.LOCAL for g in guards) else Scope.GLOBAL

    def _function(self, function, ancestors, launcher_counts, active) -> Resolution:
        name = function.name.value
        index = ancestors.index(function)
        is_method = index > 1 and isinstance(ancestors[index - 2], cst.ClassDef)
        key = (name, is_method, launcher_counts)
        if key in self._resolved:
            return self._resolved[key]
        if key in active:  # recursion: the other call sites decide
            return _RECURSIVE
        active.add(key)
        sites = self._sites_of(name, is_method, ancestors[index - 2] if is_method else None)
        results = [
            EVERY_RANK
            if site.every_rank
            else self._resolve(site.ancestors, launcher_counts, active)
            for site in sites
        ]
        active.discard(key)
        resolution = _weakest(results, name)
        self._resolved[key] = resolution
        return resolution

    def rank_zero_path(self, ancestors: Ancestors, depth: int = 0) -> tuple[str, ...] | None:
        """Some chain of calls that reaches the node at the end of `ancestors` on rank 0
        only, when `resolve` says it runs on every rank because another chain does: the
        module functions called, outermost first (`("write_json", "get_repo_root")` when
        `if rank == 0: write_json()` and `write_json` calls `get_repo_root`, which holds
        the node); () when the node itself is guarded; None when no chain is guarded.
        Methods are not followed (their receivers are not told apart)."""
        if rank_zero_scope(ancestors) or self._flag_guard_scope(ancestors):
            return ()
        function = innermost(ancestors, cst.FunctionDef)
        if type(function) is not cst.FunctionDef or depth >= MAX_CALL_CHAIN:
            return None
        index = ancestors.index(function)
        if index > 1 and isinstance(ancestors[index - 2], cst.ClassDef):
            return None
        name = function.name.value
        for site in self._sites_of(name, False, None):
            if site.every_rank or function in site.ancestors:
                continue  # a worker's entry, or a recursive call
            if _branch_closed_by(site.ancestors[-1], function, ancestors):
                continue
            found = self.rank_zero_path(site.ancestors, depth + 1)
            if found is not None:
                return (*found, name)
        return None

    def _sites_of(self, name: str, is_method: bool, cls: cst.CSTNode | None) -> list[Site]:
        if not is_method:
            return self.sites.get(name, [])
        if name == "__init__" and type(cls) is cst.ClassDef:
            return self.sites.get(cls.name.value, [])
        sites = self.method_sites.get(name, [])
        if type(cls) is cst.ClassDef:
            sites = [site for site in sites if not self._other_class(site.receiver, cls)]
        return sites

    def _other_class(self, receiver: str | None, cls: cst.ClassDef) -> bool:
        """Whether every assignment of `receiver` in the file builds something other than
        `cls` (`coco_eval = COCOeval(...)`; `coco_eval.evaluate()` is not `cls.evaluate`)."""
        if receiver is None or receiver in ("self", "cls"):
            return False
        values = self.assigned_anywhere(receiver)
        return bool(values) and all(
            type(value) is cst.Call
            and (dotted(value.func) or "").rsplit(".", 1)[-1] not in ("", cls.name.value)
            for value in values
        )

    def items_of(self, name: str, ancestors: Ancestors, seq: int) -> list[Binding]:
        """`name[key] = value` assignments before `seq`, in the same scope."""
        key = (id(binding_scope(name, ancestors)), name)
        return [b for b in self.bindings.get(key, []) if b.item and b.seq < seq]


def binding_scope(name: str, ancestors: Sequence[cst.CSTNode]) -> cst.CSTNode | None:
    """`self.x` lives in its class; other names in the innermost function or the module."""
    if name.startswith("self."):
        return innermost(ancestors, cst.ClassDef)
    return innermost(ancestors, cst.FunctionDef, cst.Module)


def unconditional_for(binding: WrapperBinding, ancestors: Sequence[cst.CSTNode]) -> bool:
    """Whether every path reaching `ancestors`' node went through `binding`: every `if`
    around the assignment (not `__main__`, which every run takes) holds the node too."""
    shared = {id(a) for a in ancestors}
    conditions = {
        id(parent)
        for parent in binding.place.ancestors
        if type(parent) in (cst.If, cst.IfExp) and not _is_main_check(parent.test)
    }
    return conditions <= shared and type(binding.value) is not cst.IfExp


def under_flag(ancestors: Sequence[cst.CSTNode], is_guard_flag) -> bool:
    """Whether the last node sits in the body of an `if` that requires a guard flag."""
    return any(is_guard_flag(name) for name in _required_names(ancestors))


def _required_names(ancestors: Sequence[cst.CSTNode]) -> Iterator[str]:
    """The names and attributes the `if`s around the last node require to run its body."""
    for parent, child in zip(ancestors, ancestors[1:]):
        if type(parent) is cst.If and child is parent.body:
            yield from _conjuncts(parent.test)


def _conjuncts(test: cst.BaseExpression) -> Iterator[str]:
    """The names and attributes `test` requires: `a and b.c and f(x)` -> a, b.c."""
    for term in and_terms(test):
        name = dotted(term)
        if name is not None:
            yield name


def _branch_closed_by(call: cst.CSTNode, function: cst.FunctionDef, ancestors: Ancestors) -> bool:
    """Whether `call` of `function` passes a literal False (None, 0) for the parameter an
    `if flag:` around the node tests (`get_root(name, False)` with the barrier under
    `if download:`): on that call the node never runs."""
    if type(call) is not cst.Call:
        return False
    inner = ancestors[ancestors.index(function) + 1 :]
    for node, child in zip(inner, inner[1:]):
        if type(node) is not cst.If or child is not node.body or type(node.test) is not cst.Name:
            continue
        position, is_parameter = parameter_index(function, node.test.value)
        arg = find_arg(call, node.test.value, position) if is_parameter else None
        if arg is not None and not arg.star and _is_falsy_literal(arg.value):
            return True
    return False


def _is_falsy_literal(value: cst.BaseExpression) -> bool:
    if type(value) is cst.Name:
        return value.value in ("False", "None")
    return type(value) is cst.Integer and value.value == "0"


def _weakest(results: Iterable[Resolution], helper: str) -> Resolution:
    results = [r for r in results if r is not _RECURSIVE]
    if not results:
        return UNKNOWN
    if any(r.known and r.scope is None for r in results):
        return Resolution(None, helper=helper)
    if any(not r.known for r in results):
        return UNKNOWN
    scope = Scope.LOCAL if any(r.scope is Scope.LOCAL for r in results) else Scope.GLOBAL
    return Resolution(scope, helper=helper)


class RankZeroRule(Rule):
    """A rule fed by the shared facts; subclasses add their own handlers."""

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.facts = facts_for(context)

    def visit_Call(self, node: cst.Call) -> None:
        self.facts.record_call(node)
        self.on_call(node, self.facts.callee)

    def visit_Assign(self, node: cst.Assign) -> None:
        self.facts.record_assign(node)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.facts.record_assign(node)

    def on_call(self, node: cst.Call, qualified: str | None) -> None:
        """A call, after the facts recorded it; `qualified` is its callee through imports."""

    def snapshot(self) -> Ancestors:
        return tuple(self.context.ancestors)

    def delegates_to_framework(self) -> bool:
        return self.context.model.framework is not None
