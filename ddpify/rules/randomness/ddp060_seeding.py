from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from ddpify.analysis.epochs import epoch_loops
from ddpify.analysis.names import dotted, find_arg
from ddpify.analysis.project import LocalFunction
from ddpify.analysis.seeding import (
    DATA_METHODS,
    SEED_CALLS,
    augmenting_modules,
    is_draw,
    is_random_transform,
    seed_parameter,
)
from ddpify.analysis.wrappers import Place, innermost
from ddpify.diagnostics import Severity
from ddpify.rules.devices._common import DistributedRule
from ddpify.walk import children

_RANK = re.compile(r"rank|gpu|device_id|process_index", re.I)


@dataclass(frozen=True)
class _Seed:
    call: cst.Call
    place: Place


class SameSeedEveryRank(DistributedRule):
    """Every rank seeds the global random streams with the same value, so every rank
    draws the same augmentations (crop offsets, flips) for its own samples."""

    CODE = "DDP060"
    NAME = "seeding"
    SEVERITY = Severity.INFO
    MESSAGE = (
        "`torch.manual_seed(seed)` gives every rank the same random stream, so the ranks "
        "draw identical augmentations; add the rank to the data seed (`seed + rank`)"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.seeds: list[_Seed] = []
        self.rank_seeded = False  # some seed in the file already depends on the rank
        self.augments = False
        self.order = 0
        self.local_calls: dict[str, list[cst.Call]] = {}
        # Draws from the global streams, to tell a seed that makes one draw reproducible.
        self.draws: list[Place] = []

    def visit_Call(self, node: cst.Call) -> None:
        self.order += 1
        name = self.context.qualify(node.func)
        kind = type(node.func)  # exact types: see ddpify.walk.is_kind
        if (kind is cst.Name or kind is cst.Attribute) and name is None:
            callee = node.func.value if kind is cst.Name else node.func.attr.value
            self.local_calls.setdefault(callee, []).append(node)  # type: ignore[arg-type]
        if name in SEED_CALLS:
            self._seeded_with(node, node.args[0].value if node.args else None)
        elif name is not None:
            if is_draw(name):
                self.draws.append(Place(tuple(self.context.ancestors), self.order))
            if not self.augments:
                self.augments = self._augments(node, name)
            if self._is_statement():
                self._helper_call(node)

    def _seeded_with(self, call: cst.Call, seed: cst.BaseExpression | None) -> None:
        if seed is not None and self._depends_on_rank(seed):
            self.rank_seeded = True
        elif seed is not None:
            place = Place(tuple(self.context.ancestors), self.order)
            self.seeds.append(_Seed(call, place))

    def _is_statement(self) -> bool:
        ancestors = self.context.ancestors
        return len(ancestors) > 1 and type(ancestors[-2]) is cst.Expr

    def _helper_call(self, call: cst.Call) -> None:
        """`set_random_seed(seed)` with the helper in a local module: its body seeds the
        global streams with that parameter, so the call seeds them with the argument."""
        helper = self.context.local_callee(call.func)
        if not isinstance(helper, LocalFunction):
            return
        found = seed_parameter(helper.node, helper.imports)
        if found is None:
            return
        position, name = found
        arg = find_arg(call, name, position)
        if arg is not None and not arg.star:
            self._seeded_with(call, arg.value)

    def visit_Arg(self, node: cst.Arg) -> None:
        # `DataLoader(..., worker_init_fn=seed_worker)` with a rank-aware seed function,
        # or a generator per rank: the author handles data seeding.
        if node.keyword is not None and node.keyword.value in {"worker_init_fn", "generator"}:
            if self._depends_on_rank(node.value):
                self.rank_seeded = True

    def _augments(self, call: cst.Call, name: str) -> bool:
        if is_random_transform(name):
            return True
        if is_draw(name):
            function = self.context.enclosing(cst.FunctionDef)
            return type(function) is cst.FunctionDef and function.name.value in DATA_METHODS
        return False

    def _depends_on_rank(self, expr: cst.BaseExpression) -> bool:
        """Whether the seed names a rank, directly or through the names it is built from."""
        seen: set[str] = set()
        pending = [expr]
        while pending:
            current = pending.pop()
            for name in _dotted_names(current):
                if _RANK.search(name):
                    return True
                if name in seen:
                    continue
                seen.add(name)
                pending.extend(self.model.bindings.get(name, ()))
        return False

    def leave_Module(self, node: cst.Module) -> None:
        if not self.is_distributed() or self.rank_seeded or not self.seeds:
            return
        seeds = [seed for seed in self.seeds if not self._local_draw(seed)]
        if not seeds:
            return
        seed = seeds[0]
        if innermost(seed.place.ancestors, cst.FunctionDef) is not None and self._rank_param(seed):
            return
        evidence: list[Path] = []
        if not self.augments:
            # Datasets found by a registry or a folder scan augment out of this file's sight.
            # Weaker evidence than a draw in this file: a package holds datasets this script
            # may not use, so it counts only for a script that trains (an epoch loop), not
            # for an inference script beside it.
            if not epoch_loops(self.context.tree):
                return
            evidence = augmenting_modules(self.context.local)
            if not evidence:
                return
        shown = self.context.code(seed.call)
        if len(shown) > 60 or "\n" in shown:
            shown = self.context.code(seed.call.func) + "(...)"
        message = (
            f"`{shown}` seeds every rank alike, so all ranks draw the same random "
            "augmentations for their samples; keep one seed for the model's initialisation "
            "(DDP broadcasts rank 0's weights anyway) and seed the data streams with "
            "`seed + rank`"
        )
        if evidence:
            message += f" (`{evidence[0].name}` draws random augmentations)"
        self.report(seed.call, message)

    def _local_draw(self, seed: _Seed) -> bool:
        """A seed in a function that draws right after it (`np.random.seed(s)` then
        `np.random.shuffle(indices)` to split the data): that draw must be the same on
        every rank, so the shared seed is deliberate."""
        function = innermost(seed.place.ancestors, cst.FunctionDef)
        return function is not None and any(
            draw.seq > seed.place.seq and function in draw.ancestors for draw in self.draws
        )

    def _rank_param(self, seed: _Seed) -> bool:
        """A seeding helper `set_seed(seed)` that some call site gives the rank: the
        parameter then carries it."""
        function = innermost(seed.place.ancestors, cst.FunctionDef)
        name = function.name.value  # type: ignore[union-attr]
        for call in self.local_calls.get(name, []):
            if any(self._depends_on_rank(arg.value) for arg in call.args):
                return True
        return False


def _dotted_names(expr: cst.CSTNode) -> list[str]:
    """Names in `expr`, and the strings it reads (`os.environ["RANK"]`)."""
    found, stack = [], [expr]
    while stack:
        node = stack.pop()
        name = dotted(node) if type(node) in (cst.Name, cst.Attribute) else None
        if name is not None:
            found.append(name)
            continue
        if type(node) is cst.SimpleString:
            found.append(node.raw_value)
        stack.extend(children(node))
    return found
