"""DataLoader and sampler facts: which calls build loaders, and with what.

Collected node by node during the engine's one traversal (`LoaderFacts.visit`), or in
a traversal of its own with `collect(module)` for callers outside the engine (the
migration passes). Every fact keeps its libcst node, so a caller can both report on it
and rewrite it.

- `loaders`: each `DataLoader(...)` call with its dataset / batch_size / shuffle /
  sampler / batch_sampler arguments (keyword or positional) and the name it is bound to;
- `samplers`: each `DistributedSampler(...)` call, the name that holds it or the loader
  it is written into, and its `shuffle` argument;
- `epoch_loops`: `for`/`while` loops over epochs, and whether they nest in another;
- `set_epoch_mentions`: every place that may set a sampler's epoch (`x.set_epoch`,
  the string "set_epoch", a `set_sampler_epoch(...)` helper), so "never called" is only
  claimed when there is none at all;
- `calls_passing_names()`: calls with a plain name among their arguments, to tell
  whether a loader or sampler is handed to code outside the file.

Names are the dotted targets as written (`train_sampler`, `self.train_loader`); no scope
analysis is done, so two functions that both bind `loader` share the name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.epochs import is_epoch_loop
from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.model import ScriptModel, unwrap_call_chain
from ddpify.analysis.names import ImportMap, dotted, find_arg
from ddpify.analysis.roles import (
    ITERABLE_BASES,
    distributed_sampler_value,
    iterable_dataset_classes,
)
from ddpify.analysis.tree import Tree
from ddpify.walk import children, walk

DATALOADER = "torch.utils.data.DataLoader"
DISTRIBUTED_SAMPLER = "torch.utils.data.DistributedSampler"

# Positions in `DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)`.
_LOADER_POSITIONS = {"dataset": 0, "batch_size": 1, "shuffle": 2, "sampler": 3, "batch_sampler": 4}
# DataLoader's positional parameters, in order (the rest are keyword-only): what a fix
# needs to give by keyword the positional arguments after one it removes.
LOADER_PARAMETERS = (
    "dataset",
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
)
# `DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)`.
_SAMPLER_SHUFFLE_POSITION = 3
_SAMPLER_SEED_POSITION = 4
_SAMPLER_DROP_LAST_POSITION = 5

# Packages whose datasets stream (and shard by rank themselves).
STREAMING_PACKAGES = ("webdataset", "streaming", "torchdata", "litdata", "ray.data")
_STREAMING_NAME = re.compile(r"(Iterable|Stream|Streaming|WebDataset|IterDataPipe)", re.I)
_SET_EPOCH_HELPER = re.compile(r"set_\w*epoch", re.I)
# Words of code that splits data by process: `rank=`, `world_size`, `split_by_node`.
_SHARD_WORD = re.compile(r"rank|world|replica|shard|num_parts|part_id|by_node", re.I)
_HF_LOAD = "datasets.load_dataset"
_MAX_ORIGIN_DEPTH = 3


@dataclass(frozen=True)
class Where:
    """Where a node sits: its function and class, and the guards around it."""

    function: cst.FunctionDef | None
    class_def: cst.ClassDef | None
    order: int  # pre-order index: compares "before/after" within one file
    rank_zero: bool  # under a rank-0 guard (`if rank == 0:` ...)
    conditions: tuple[cst.BaseExpression, ...] = ()  # tests of the enclosing `if`s

    def parameter_names(self) -> set[str]:
        if self.function is None:
            return set()
        params = self.function.params
        every = [*params.posonly_params, *params.params, *params.kwonly_params]
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                every.append(star)
        return {param.name.value for param in every}


@dataclass(frozen=True)
class LoaderCall:
    """One `DataLoader(...)` call."""

    call: cst.Call
    target: str | None  # the name it is assigned to, if any
    where: Where

    def arg(self, name: str) -> cst.Arg | None:
        """The argument `name` (dataset, batch_size, shuffle, sampler, batch_sampler)."""
        return find_arg(self.call, name, _LOADER_POSITIONS.get(name))

    @property
    def dataset(self) -> cst.BaseExpression | None:
        arg = self.arg("dataset")
        return arg.value if arg is not None else None

    @property
    def has_star_args(self) -> bool:
        """`*args` / `**kwargs`: any argument may be hidden in them."""
        return any(arg.star for arg in self.call.args)


@dataclass(frozen=True)
class SamplerCall:
    """One `DistributedSampler(...)` call."""

    call: cst.Call
    target: str | None  # the name it is assigned to, if any
    loader: LoaderCall | None  # the loader it is written into, as `sampler=DistributedSampler(..)`
    where: Where

    @property
    def shuffle(self) -> cst.Arg | None:
        return find_arg(self.call, "shuffle", _SAMPLER_SHUFFLE_POSITION)

    @property
    def shuffles(self) -> bool | None:
        """True by default or `shuffle=True`, False for `shuffle=False`, None if computed."""
        arg = self.shuffle
        if arg is None:
            return True
        if isinstance(arg.value, cst.Name) and arg.value.value in {"True", "False"}:
            return arg.value.value == "True"
        return None

    @property
    def seed(self) -> cst.Arg | None:
        return sampler_seed(self.call)

    @property
    def drop_last(self) -> cst.Arg | None:
        return find_arg(self.call, "drop_last", _SAMPLER_DROP_LAST_POSITION)

    @property
    def receiver(self) -> str | None:
        """How code reaches the sampler: `train_sampler`, or `train_loader.sampler`."""
        if self.target is not None:
            return self.target
        if self.loader is not None and self.loader.target is not None:
            return f"{self.loader.target}.sampler"
        return None


def sampler_seed(call: cst.Call) -> cst.Arg | None:
    """The `seed` argument of a `DistributedSampler(...)` call (keyword or fifth)."""
    return find_arg(call, "seed", _SAMPLER_SEED_POSITION)


@dataclass(frozen=True)
class EpochLoop:
    node: cst.For | cst.While
    where: Where
    nested: bool  # inside another epoch loop

    @property
    def epoch_name(self) -> str | None:
        """`epoch` of `for epoch in ...`; None for `while` loops and tuple targets."""
        if isinstance(self.node, cst.For) and isinstance(self.node.target, cst.Name):
            name = self.node.target.value
            return None if name == "_" else name
        return None


@dataclass(frozen=True)
class PassedNames:
    """A call with dotted names among its arguments; `callee` is its dotted name, if any."""

    call: cst.Call
    callee: str | None
    arguments: tuple[str, ...]


def _assigned_name(ancestors: Sequence[cst.CSTNode]) -> str | None:
    """The target `x` of `x = <node>`, also through `<node> if c else None`."""
    child_index = len(ancestors) - 1
    while child_index > 0:
        parent, child = ancestors[child_index - 1], ancestors[child_index]
        if isinstance(parent, cst.IfExp) and child is not parent.test:
            child_index -= 1
            continue
        if isinstance(parent, cst.Assign) and parent.value is child and len(parent.targets) == 1:
            return dotted(parent.targets[0].target)
        if isinstance(parent, cst.AnnAssign) and parent.value is child:
            return dotted(parent.target)
        return None
    return None


def _conditions(ancestors: Sequence[cst.CSTNode]) -> tuple[cst.BaseExpression, ...]:
    """The tests of the `if` statements and expressions whose branches hold the node."""
    found = []
    for parent, child in zip(ancestors, ancestors[1:]):
        if isinstance(parent, (cst.If, cst.IfExp)) and child is not parent.test:
            found.append(parent.test)
    return tuple(found)


def _enclosing_loader_arg(ancestors: Sequence[cst.CSTNode]) -> tuple[cst.Call, cst.Arg] | None:
    """The call and argument that `<node>` is written into (also through an `if` expression)."""
    index = len(ancestors) - 2
    while index >= 0 and isinstance(ancestors[index], cst.IfExp):
        index -= 1
    if index >= 1 and isinstance(ancestors[index], cst.Arg):
        call = ancestors[index - 1]
        if isinstance(call, cst.Call):
            return call, ancestors[index]
    return None


class LoaderFacts:
    """Loader, sampler and epoch-loop facts of one file; see the module docstring."""

    def __init__(self, model: ScriptModel, tree: Callable[[], Tree]) -> None:
        self.model = model
        self.tree = tree  # the file's Tree, made when a question needs it
        self.imports: ImportMap = model.imports
        self.loaders: list[LoaderCall] = []
        self.samplers: list[SamplerCall] = []
        self.epoch_loops: list[EpochLoop] = []
        self.set_epoch_mentions: list[cst.CSTNode] = []
        self._calls_with_names: list[cst.Call] = []
        self.classes: dict[str, cst.ClassDef] = {}
        self._loader_by_call: dict[cst.Call, LoaderCall] = {}
        self._last: cst.CSTNode | None = None
        self._order = 0

    # -- collection --------------------------------------------------------------------

    def visit(self, node: cst.CSTNode, ancestors: Sequence[cst.CSTNode]) -> None:
        """Record `node`; `ancestors` runs from the module down to `node` itself.

        Feeding the same node twice in a row is a no-op, so several rules may feed one
        shared instance from their own handlers.
        """
        if node is self._last:
            return
        self._last = node
        self._order += 1
        handler = _HANDLERS.get(type(node))
        if handler is not None:
            handler(self, node, ancestors)

    def _visit_attribute(self, node: cst.Attribute, ancestors) -> None:
        if node.attr.value == "set_epoch":
            self.set_epoch_mentions.append(node)

    def _visit_string(self, node: cst.SimpleString, ancestors) -> None:
        if "set_epoch" in node.value:
            self.set_epoch_mentions.append(node)

    def _visit_loop(self, node: cst.For | cst.While, ancestors) -> None:
        if is_epoch_loop(node):
            self._visit_epoch_loop(node, ancestors)

    def _visit_class(self, node: cst.ClassDef, ancestors) -> None:
        self.classes.setdefault(node.name.value, node)

    def _where(self, ancestors: Sequence[cst.CSTNode]) -> Where:
        function = class_def = None
        for node in reversed(ancestors[:-1]):
            if isinstance(node, cst.FunctionDef) and function is None:
                function = node
            elif isinstance(node, cst.ClassDef):
                class_def = node
                break
        rank_zero = rank_zero_scope(ancestors) is not None
        return Where(function, class_def, self._order, rank_zero, _conditions(ancestors))

    def _visit_call(self, node: cst.Call, ancestors: Sequence[cst.CSTNode]) -> None:
        # The script model has just qualified this call: reuse its answer.
        if self._latest_call_to(DATALOADER, node):
            loader = LoaderCall(node, _assigned_name(ancestors), self._where(ancestors))
            self.loaders.append(loader)
            self._loader_by_call[node] = loader
            return
        if self._latest_call_to(DISTRIBUTED_SAMPLER, node) or self._chosen_sampler_class(node):
            sampler = SamplerCall(
                node, _assigned_name(ancestors), self._inline_in(ancestors), self._where(ancestors)
            )
            self.samplers.append(sampler)
            return
        func = node.func
        last = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", "")
        if isinstance(last, str) and "epoch" in last and last != "set_epoch":
            if _SET_EPOCH_HELPER.search(last):
                self.set_epoch_mentions.append(node)
        if any(isinstance(arg.value, (cst.Name, cst.Attribute)) for arg in node.args):
            self._calls_with_names.append(node)

    def _chosen_sampler_class(self, node: cst.Call) -> bool:
        """`Sampler(ds)` where the script bound `Sampler` to the DistributedSampler class,
        alone or as a branch (`Sampler = RandomSampler if args.local_rank == -1 else
        DistributedSampler`): in distributed runs the call builds a DistributedSampler."""
        if type(node.func) is not cst.Name:
            return False
        return any(
            self._names_distributed_sampler(value)
            for value in self.model.bindings.get(node.func.value, ())
        )

    def _names_distributed_sampler(self, value: cst.BaseExpression) -> bool:
        if type(value) is cst.IfExp:
            branches = (value.body, value.orelse)
            return any(self._names_distributed_sampler(branch) for branch in branches)
        return self.model.imports.qualify(value) == DISTRIBUTED_SAMPLER

    def _latest_call_to(self, name: str, node: cst.Call) -> bool:
        calls = self.model.calls.get(name)
        return bool(calls) and calls[-1] is node

    def _inline_in(self, ancestors: Sequence[cst.CSTNode]) -> LoaderCall | None:
        found = _enclosing_loader_arg(ancestors)
        if found is None:
            return None
        call, arg = found
        loader = self._loader_by_call.get(call)
        if loader is None or loader.arg("sampler") is not arg:
            return None
        return loader

    def _visit_epoch_loop(self, node: cst.For | cst.While, ancestors) -> None:
        where = self._where(ancestors)
        nested = any(
            is_epoch_loop(a) for a in ancestors[:-1] if isinstance(a, (cst.For, cst.While))
        )
        self.epoch_loops.append(EpochLoop(node, where, nested))

    # -- questions -----------------------------------------------------------------------

    def loader_of(self, call: cst.Call) -> LoaderCall | None:
        return self._loader_by_call.get(call)

    def sampler_names(self) -> set[str]:
        """Names that hold a sampler: DistributedSampler targets, names passed as
        `sampler=`/`batch_sampler=` to a loader, and `<loader>.sampler` of named loaders."""
        names = {s.target for s in self.samplers if s.target}
        for loader in self.loaders:
            for key in ("sampler", "batch_sampler"):
                arg = loader.arg(key)
                value = dotted(arg.value) if arg is not None else None
                if value is not None and value != "None":
                    names.add(value)
                if arg is not None and loader.target is not None:
                    names.add(f"{loader.target}.{key}")
        return names

    def distributed_sampler_of(self, loader: LoaderCall) -> SamplerCall | None:
        """The DistributedSampler `loader` draws from: written inline, a name bound to one,
        or behind a conditional or a few names (`roles.distributed_sampler_value`, the
        answer migrate reads)."""
        arg = loader.arg("sampler")
        if arg is None:
            return None
        name = dotted(arg.value)
        for sampler in self.samplers:
            if sampler.loader is loader or (name is not None and sampler.target == name):
                return sampler
        if not self.samplers:
            return None  # the common case: no DistributedSampler call, no Tree to build
        tree = self.tree()
        value = distributed_sampler_value(tree, arg.value)
        if isinstance(value, cst.IfExp):  # the branch that holds the sampler
            branches = (value.body, value.orelse)
            value = next(filter(None, (distributed_sampler_value(tree, b) for b in branches)))
        return next((s for s in self.samplers if s.call is value), None)

    def loaders_drawing_from(self, sampler: SamplerCall) -> list[LoaderCall]:
        """The loaders whose `sampler=` is `sampler`."""
        return [loader for loader in self.loaders if self.distributed_sampler_of(loader) is sampler]

    def loader_names(self) -> set[str]:
        return {loader.target for loader in self.loaders if loader.target}

    def set_epoch_receivers(self) -> list[str | None]:
        """The dotted receiver of each `<x>.set_epoch` written in the file (None if computed)."""
        return [
            dotted(node.value)
            for node in self.set_epoch_mentions
            if isinstance(node, cst.Attribute)
        ]

    def may_set_epoch(self) -> bool:
        """Whether anything in the file may call `set_epoch` on some sampler: a direct call,
        a `getattr(..., "set_epoch")`, a `set_..._epoch` helper, a function or import named
        `set_epoch`. Only a file with none of these never sets a sampler's epoch."""
        if self.set_epoch_mentions:
            return True
        if any(_SET_EPOCH_HELPER.search(name) for name in self.model.functions):
            return True
        return any(_SET_EPOCH_HELPER.search(local) for local in self.imports.aliases)

    def calls_passing_names(self) -> list[PassedNames]:
        """Calls other than DataLoader/DistributedSampler that pass dotted names."""
        found = []
        for call in self._calls_with_names:
            arguments = tuple(d for d in (dotted(arg.value) for arg in call.args) if d)
            if arguments:
                found.append(PassedNames(call, dotted(call.func), arguments))
        return found

    def defines(self, name: str) -> bool:
        """Whether the callable `name` (its last dotted part) is defined in this file."""
        last = name.rsplit(".", 1)[-1]
        return last in self.model.functions or last in self.classes

    def iterable_dataset_classes(self) -> set[str]:
        """Classes of this file that derive, directly or through each other, from an
        IterableDataset or IterDataPipe (asked of the roles analysis, as migrate asks)."""
        return iterable_dataset_classes(self.tree())

    def dataset_sources(self, dataset: cst.BaseExpression) -> list[cst.BaseExpression]:
        """The expressions a dataset argument comes from: itself, and for a name, every
        value assigned to that name in the file."""
        name = dotted(dataset)
        if name is None:
            return [dataset]
        return [dataset, *self.model.bindings.get(name, ())]

    def is_streaming(self, dataset: cst.BaseExpression) -> bool:
        """Whether `dataset` is (or may well be) an iterable, streaming dataset: an
        instance of an IterableDataset subclass of this file, something from a streaming
        package, `streaming=True`, or a name or call that says so (`stream_ds`,
        `WebDataset(...)`, `.to_iterable_dataset()`)."""
        iterable_classes = self.iterable_dataset_classes()
        for source in self.dataset_sources(dataset):
            names = _chain_names(source)
            if any(_STREAMING_NAME.search(name) or name in iterable_classes for name in names):
                return True
            call = unwrap_call_chain(source)
            if call is None:
                continue
            qualified = self.imports.qualify(call.func) or ""
            if qualified in ITERABLE_BASES or qualified.startswith(STREAMING_PACKAGES):
                return True
            streaming = find_arg(call, "streaming")
            if streaming is not None and not _is_false(streaming.value):
                return True
        return False

    def splits_streams_by_node(self) -> bool:
        """Whether the file splits a Hugging Face dataset by process anywhere:
        `split_dataset_by_node(...)` or `ds.shard(num_shards=world_size, index=rank)`."""
        if "split_dataset_by_node" in self.model.method_calls or "shard" in self.model.method_calls:
            return True
        return any(name.endswith("split_dataset_by_node") for name in self.model.calls)

    def unsharded_stream(self, dataset: cst.BaseExpression, hf_split: bool) -> str | None:
        """Whether `dataset` is an iterable dataset that no code of this file splits by rank:
        "class" for an instance of an IterableDataset subclass of this file whose code never
        mentions a rank, "hf" for `load_dataset(..., streaming=True)` or
        `.to_iterable_dataset()` when nothing calls `split_dataset_by_node`; else None.
        Datasets from other files and streaming packages (which shard themselves) are None."""
        iterable_classes = self.iterable_dataset_classes()
        found = None
        for origin in self._origins(dataset, 0):
            if _mentions_shard_word(origin):
                return None  # `MyStream(files, rank=rank, world_size=world_size)`
            call = unwrap_call_chain(origin)
            if call is None:
                continue
            names = _chain_names(origin)
            callee = dotted(call.func)
            last = callee.rsplit(".", 1)[-1] if callee else None
            if last in iterable_classes:
                if self._class_shards(last):
                    return None
                found = found or "class"
            elif self._is_hf_stream(call, names) and not hf_split:
                found = found or "hf"
        return found

    def _origins(self, expr: cst.BaseExpression, depth: int) -> list[cst.BaseExpression]:
        """`expr`, and what the names it starts from were bound to (`ds["train"]` -> ds)."""
        found = [expr]
        base = expr
        while isinstance(base, (cst.Call, cst.Attribute, cst.Subscript)):
            base = base.func if isinstance(base, cst.Call) else base.value
        name = dotted(base) if isinstance(base, (cst.Name, cst.Attribute)) else None
        if name is not None and depth < _MAX_ORIGIN_DEPTH:
            for value in self.model.bindings.get(name, ()):
                if value is not expr:
                    found.extend(self._origins(value, depth + 1))
        return found

    def _class_shards(self, name: str) -> bool:
        """Whether the class `name`, or a class of this file it derives from, mentions a rank."""
        seen: set[str] = set()
        pending = [name]
        while pending:
            current = pending.pop()
            if current in seen or current not in self.classes:
                continue
            seen.add(current)
            class_def = self.classes[current]
            if _mentions_shard_word(class_def.body):
                return True
            pending.extend(
                (dotted(base.value) or "").rsplit(".", 1)[-1] for base in class_def.bases
            )
        return False

    def _is_hf_stream(self, call: cst.Call, names: list[str]) -> bool:
        if "to_iterable_dataset" in names:
            return True
        if self.imports.qualify(call.func) != _HF_LOAD:
            return False
        streaming = find_arg(call, "streaming")
        return streaming is not None and not _is_false(streaming.value)


def _mentions_shard_word(node: cst.CSTNode) -> bool:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Name) and _SHARD_WORD.search(current.value):
            return True
        if isinstance(current, cst.SimpleString) and _SHARD_WORD.search(current.value):
            return True
        stack.extend(children(current))
    return False


def _chain_names(expr: cst.BaseExpression) -> list[str]:
    """Every name along `a.b(...).c(...)`: `a`, `b`, `c`."""
    names = []
    while True:
        if isinstance(expr, cst.Call):
            expr = expr.func
        elif isinstance(expr, cst.Attribute):
            names.append(expr.attr.value)
            expr = expr.value
        elif isinstance(expr, cst.Name):
            names.append(expr.value)
            return names
        else:
            return names


_HANDLERS = {
    cst.Call: LoaderFacts._visit_call,
    cst.Attribute: LoaderFacts._visit_attribute,
    cst.SimpleString: LoaderFacts._visit_string,
    cst.For: LoaderFacts._visit_loop,
    cst.While: LoaderFacts._visit_loop,
    cst.ClassDef: LoaderFacts._visit_class,
}


def names_in(node: cst.CSTNode) -> list[str]:
    """Every identifier (Name) in `node`; cheaper than a libcst visitor."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Name):
            found.append(current.value)
        else:
            stack.extend(children(current))
    return found


def _is_false(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value in {"False", "None"}


@dataclass
class _Collector:
    facts: LoaderFacts
    ancestors: list[cst.CSTNode] = field(default_factory=list)

    def enter(self, node: cst.CSTNode) -> None:
        self.ancestors.append(node)
        self.facts.model.visit(node)
        self.facts.visit(node, self.ancestors)

    def leave(self, node: cst.CSTNode) -> None:
        self.ancestors.pop()


def collect(module: cst.Module) -> LoaderFacts:
    """Loader facts of `module`, from a traversal of its own (outside the lint engine)."""
    imports = ImportMap()
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    imports.add(small)
    collector = _Collector(LoaderFacts(ScriptModel(imports), lambda: Tree(module)))
    walk(module, collector.enter, collector.leave)
    return collector.facts


# -- samplers a project writes itself ------------------------------------------------------

# An argument that seeds a sampler's shuffling: by keyword (`seed=`, `generator=`, `rng=`)
# or, positionally, through a name that says so (`np_rng`, `sampler_seed`).
_SEED_WORD = re.compile(r"seed|rng|generator|random_state", re.I)
_TORCH_DATA = "torch.utils.data."


def project_samplers(model: ScriptModel) -> list[cst.Call]:
    """Calls that build a sampler class of the project's own (`BucketingSampler(...)`,
    `samplers.DistributedGroupSampler(...)`), not one of torch.utils.data's."""
    found: dict[int, cst.Call] = {}
    for name, calls in (*model.calls.items(), *model.method_calls.items()):
        if not name.rsplit(".", 1)[-1].endswith("Sampler"):
            continue
        for call in calls:
            qualified = model.imports.qualify(call.func) or ""
            if not qualified.startswith(_TORCH_DATA):
                found.setdefault(id(call), call)
    return list(found.values())


def seed_arguments(call: cst.Call) -> list[cst.Arg]:
    """The arguments of `call` that seed its randomness, by keyword or by name."""
    seeds = []
    for arg in call.args:
        if arg.star:
            continue
        if arg.keyword is not None:
            if _SEED_WORD.search(arg.keyword.value):
                seeds.append(arg)
            continue
        name = dotted(arg.value)
        if name is not None and _SEED_WORD.search(name.rsplit(".", 1)[-1]):
            seeds.append(arg)
    return seeds
