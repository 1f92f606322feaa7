"""Training streams: a DataLoader over an IterableDataset class of the project.

Such a loader takes no sampler; the migration shards the stream inside the class that
yields its items instead. These are the facts it needs, asked of the whole project:
which class really yields the items (a subclass whose `__iter__` only delegates to
`super().__iter__()` yields nothing of its own), whether the stream is already sharded,
whether it reads as evaluation data, and where it draws random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.evaluation import looks_like_eval
from ddpify.analysis.loaders import _mentions_shard_word
from ddpify.analysis.names import class_methods, dotted, find_arg
from ddpify.analysis.roles import Loader, _bindings, iterable_dataset_classes

# The decorators the migration puts on the methods it shards, and the switch it sets on
# the training dataset (see ddpify/migrate/streams.py).
ITER_DECORATOR = "rank_sharded_iter"
LEN_DECORATOR = "rank_sharded_len"
SWITCH = "shard_by_rank"

# Calls that draw from a random generator: Python's, NumPy's and torch's.
_RANDOM_MODULES = ("random.", "numpy.random.")
_TORCH_RANDOM = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "multinomial",
    "bernoulli",
    "normal",
    "poisson",
}


@dataclass
class Stream:
    """A loader over an instance of a project IterableDataset class."""

    loader: Loader
    dataset: str  # the name the loader reads the dataset from (`train`, `self.train_ds`)
    created: str  # the class the dataset is an instance of
    classes: list[cst.ClassDef]  # that class and its project bases, most-derived first
    iter_method: cst.FunctionDef | None  # the `__iter__` that yields the items
    len_method: cst.FunctionDef | None  # the `__len__` that counts them

    @property
    def owner(self) -> cst.ClassDef | None:
        """The class whose `__iter__` yields the items (the one the migration shards)."""
        return next((c for c in self.classes if _defines(c, self.iter_method)), None)

    @property
    def evaluation(self) -> bool:
        return looks_like_eval(self.dataset, *sorted(self.loader.names))


def training_stream(tree, loader: Loader) -> Stream | None:
    """The stream `loader` reads when its dataset is an instance of an IterableDataset
    class of the project, bound to a name; None for any other loader."""
    view = tree.view
    dataset = find_arg(loader.call, "dataset", 0)
    if dataset is None:
        return None
    iterable = iterable_dataset_classes(tree)
    name = dotted(dataset.value)
    if name is None:
        created = dotted(dataset.value.func) if isinstance(dataset.value, cst.Call) else None
        if created is not None and created.rsplit(".", 1)[-1] in iterable:
            return Stream(loader, "", created.rsplit(".", 1)[-1], [], None, None)
        return None
    for value in _dataset_values(view, loader.call, name):
        created = dotted(value.func) if isinstance(value, cst.Call) else None
        last = created.rsplit(".", 1)[-1] if created else None
        if last in iterable:
            classes = class_chain(view, last)
            return Stream(
                loader,
                name,
                last,
                classes,
                producing_method(classes, "__iter__"),
                producing_method(classes, "__len__"),
            )
    return None


def _dataset_values(view, call: cst.Call, name: str) -> list[cst.BaseExpression]:
    """What `name` is bound to where the loader is built (its function), else anywhere in
    the project (`self.train_ds` set in `__init__`, a loader built in a helper)."""
    scope = view.scope(call)
    here = [
        assign.value
        for assign in view.find(cst.Assign)
        if view.scope(assign) is scope and any(dotted(t.target) == name for t in assign.targets)
    ]
    return here or _bindings(view).get(name, [])


def class_chain(view, name: str) -> list[cst.ClassDef]:
    """The project class `name` and the project classes it derives from, in method
    resolution order for single inheritance (depth first, left to right otherwise)."""
    classes = {c.name.value: c for c in view.find(cst.ClassDef)}
    chain: list[cst.ClassDef] = []
    pending = [name]
    while pending:
        current = pending.pop(0)
        cls = classes.get(current)
        if cls is None or cls in chain:
            continue
        chain.append(cls)
        bases = [(dotted(b.value) or "").rsplit(".", 1)[-1] for b in cls.bases]
        pending = bases + pending
    return chain


def producing_method(classes: list[cst.ClassDef], method: str) -> cst.FunctionDef | None:
    """The first definition of `method` along `classes` that does more than hand the
    call on to `super()`."""
    for cls in classes:
        found = class_methods(cls).get(method)
        if found is not None and not delegates_to_super(found, method):
            return found
    return None


def _defines(cls: cst.ClassDef, method: cst.FunctionDef | None) -> bool:
    return method is not None and any(s is method for s in cls.body.body)


def delegates_to_super(func: cst.FunctionDef, method: str) -> bool:
    """`yield from super().__iter__()`, `return super().__iter__()`, `return
    super().__len__()`: the whole body hands the call on (a docstring aside)."""
    body = [s for s in func.body.body if not _is_docstring(s)]
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine):
        return False
    small = body[0].body[0]
    value = None
    if isinstance(small, cst.Return):
        value = small.value
    elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Yield):
        yielded = small.value.value
        value = yielded.item if isinstance(yielded, cst.From) else None
    return (
        isinstance(value, cst.Call)
        and not value.args
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == method
        and isinstance(value.func.value, cst.Call)
        and dotted(value.func.value.func) == "super"
    )


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def is_sharded(stream: Stream) -> bool:
    """Whether the stream's classes already split it by rank: the migration's decorator,
    or code that mentions a rank or a world size (`islice(..., rank, None, world)`)."""
    return any(_mentions_shard_word(cls.body) for cls in stream.classes)


def switched_on(view, stream: Stream) -> bool:
    """Whether some statement sets the training dataset's shard switch
    (`train.shard_by_rank = True`)."""
    target = f"{stream.dataset}.{SWITCH}"
    return any(
        dotted(t.target) == target for assign in view.find(cst.Assign) for t in assign.targets
    )


def random_draws(view, node: cst.CSTNode) -> list[cst.Call]:
    """The calls inside `node` that draw from a random generator (`randint(...)`,
    `random.sample(...)`, `np.random.rand(...)`, `torch.randperm(...)`)."""
    found = []
    for call in view.within(node, cst.Call):
        name = view.qualify(call.func) or ""
        if name.startswith(_RANDOM_MODULES) or (
            name.startswith("torch.") and name.rsplit(".", 1)[-1] in _TORCH_RANDOM
        ):
            found.append(call)
    return found


def stream_random_draws(view, stream: Stream) -> list[cst.Call]:
    """Where building or iterating the stream draws random numbers: its `__init__`s and
    the `__iter__` that yields the items."""
    found: list[cst.Call] = []
    for cls in stream.classes:
        init = class_methods(cls).get("__init__")
        if init is not None:
            found.extend(random_draws(view, init))
    if stream.iter_method is not None:
        found.extend(random_draws(view, stream.iter_method))
    return found
