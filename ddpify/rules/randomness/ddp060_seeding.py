from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.wrappers import Place, innermost
from ddpify.diagnostics import Severity
from ddpify.rules.devices._common import DistributedRule
from ddpify.walk import children

# Calls that seed a global random stream with their first argument.
SEED_CALLS = frozenset(
    {
        "torch.manual_seed",
        "torch.random.manual_seed",
        "torch.cuda.manual_seed",
        "torch.cuda.manual_seed_all",
        "random.seed",
        "numpy.random.seed",
        "transformers.set_seed",
        "transformers.trainer_utils.set_seed",
    }
)
# Libraries whose `Random*` transforms draw from the global streams.
AUGMENTATION_PACKAGES = ("torchvision.transforms", "albumentations", "kornia.augmentation")
# Python and NumPy draws inside a dataset's item access: per-sample augmentation.
DRAW_PACKAGES = ("random.", "numpy.random.", "torch.rand", "torch.randint", "torch.randn")
DATA_METHODS = frozenset({"__getitem__", "__iter__", "__next__"})
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
        if isinstance(node.func, (cst.Name, cst.Attribute)) and name is None:
            callee = node.func.value if isinstance(node.func, cst.Name) else node.func.attr.value
            self.local_calls.setdefault(callee, []).append(node)  # type: ignore[arg-type]
        if name in SEED_CALLS:
            if node.args and self._depends_on_rank(node.args[0].value):
                self.rank_seeded = True
            elif node.args:
                place = Place(tuple(self.context.ancestors), self.order)
                self.seeds.append(_Seed(node, place))
        elif name is not None:
            if name.startswith(DRAW_PACKAGES):
                self.draws.append(Place(tuple(self.context.ancestors), self.order))
            if not self.augments:
                self.augments = self._augments(node, name)

    def visit_Arg(self, node: cst.Arg) -> None:
        # `DataLoader(..., worker_init_fn=seed_worker)` with a rank-aware seed function,
        # or a generator per rank: the author handles data seeding.
        if node.keyword is not None and node.keyword.value in {"worker_init_fn", "generator"}:
            if self._depends_on_rank(node.value):
                self.rank_seeded = True

    def _augments(self, call: cst.Call, name: str) -> bool:
        last = name.rsplit(".", 1)[-1]
        if name.startswith(AUGMENTATION_PACKAGES) and last.startswith("Random"):
            return True
        if name.startswith(DRAW_PACKAGES) and "seed" not in last:
            function = self.context.enclosing(cst.FunctionDef)
            return isinstance(function, cst.FunctionDef) and function.name.value in DATA_METHODS
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
        if not self.is_distributed() or self.rank_seeded or not self.augments or not self.seeds:
            return
        seeds = [seed for seed in self.seeds if not self._local_draw(seed)]
        if not seeds:
            return
        seed = seeds[0]
        if innermost(seed.place.ancestors, cst.FunctionDef) is not None and self._rank_param(seed):
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
        name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
        if name is not None:
            found.append(name)
            continue
        if isinstance(node, cst.SimpleString):
            found.append(node.raw_value)
        stack.extend(children(node))
    return found
