"""Batch streams: iterables of the project, other than a DataLoader, whose items are whole
batches, and the loops whose target takes those batches.

Research code often iterates a class of its own (`class DataStreamer` whose `__iter__`
yields `data[start:end]`) or a generator function (`def batches(x, bs): ... yield
x[i:i + bs]`), through `tqdm`, `enumerate`, or a progress bar kept in a `with ... as t`.
Each item is then one batch, and it enters the training step at the loop target:
that is where a migration splits it by rank.

Purely syntactic. A stream is recognised by what it yields: a slice of rows
(`data[a:b]`, also inside a call such as `torch.from_numpy(data[a:b])`, or rows picked by
an index slice, `idx = perm[a:b]; yield x[idx]`), or a tuple of such slices. Anything
else (a whole tensor, one example, an unknown object) is not a batch stream: precision
first.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.walk import children

_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
# Wrappers that hand the stream's items through unchanged (`enumerate` pairs them with
# a counter; the others show progress or make an iterator).
PASS_THROUGH = {"tqdm", "iter", "progress_bar", "trange"}


@dataclass(frozen=True)
class StreamLoop:
    """`for i, x in enumerate(tqdm(stream))`: what the loop iterates, once unwrapped."""

    source: cst.BaseExpression  # `stream`, `self.trainloader`, `batches(x, bs)`
    enumerates: int  # how many `enumerate` layers pair the items with a counter


def _nodes(root: cst.CSTNode) -> list[cst.CSTNode]:
    """`root` and the nodes below it, nested functions and classes excluded."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(child for child in children(node) if not isinstance(child, _SCOPES))
    return found


def _callee(expr: cst.BaseExpression) -> str | None:
    name = dotted(expr.func) if isinstance(expr, cst.Call) else None
    return name.rsplit(".", 1)[-1] if name else None


def unwrap(
    expr: cst.BaseExpression, bindings: dict[str, list[cst.BaseExpression]]
) -> StreamLoop | None:
    """The iterable under `tqdm(...)`, `enumerate(...)`, `iter(...)`, also through a name
    bound once to such a wrapper (`t = tqdm(loader)`, `with tqdm(loader) as t`). None for
    `zip` and the like, whose items are not the stream's."""
    enumerates = 0
    for _ in range(6):
        name = dotted(expr)
        values = bindings.get(name or "", [])
        if (
            name is not None
            and len(values) == 1
            and _callee(values[0]) in (PASS_THROUGH | {"enumerate"})
        ):
            expr = values[0]
            continue
        callee = _callee(expr)
        if callee not in PASS_THROUGH | {"enumerate"} or not expr.args:  # type: ignore[union-attr]
            break
        enumerates += callee == "enumerate"
        expr = expr.args[0].value  # type: ignore[union-attr]
    if _callee(expr) == "zip":
        return None
    return StreamLoop(expr, enumerates)


def item_names(target: cst.BaseExpression, enumerates: int) -> list[str] | None:
    """The names the loop target binds to one item of the stream: `x` in
    `for i, x in enumerate(s)`, `x, y` in `for x, y in s`; None for other shapes."""
    for _ in range(enumerates):
        if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
            return None
        target = target.elements[1].value
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        names = [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
        return names if len(names) == len(target.elements) and names else None
    return None


def _row_slice(subscript: cst.Subscript) -> bool:
    """`data[a:b]`, `data[a:b, ...]`: a contiguous run of rows (no step)."""
    first = subscript.slice[0].slice if subscript.slice else None
    return isinstance(first, cst.Slice) and first.step is None


def _slices_rows(value: cst.BaseExpression, index_slices: set[str]) -> bool:
    """Whether `value` is (or wraps) rows of a tensor or array picked by a slice."""
    for node in _nodes(value):
        if not isinstance(node, cst.Subscript):
            continue
        if _row_slice(node):
            return True
        first = node.slice[0].slice if len(node.slice) == 1 else None
        if isinstance(first, cst.Index) and dotted(first.value) in index_slices:
            return True
    return False


def _yields_batches(func: cst.FunctionDef) -> bool:
    """A generator whose every `yield` gives a batch: a slice of rows, or a tuple of them."""
    nodes = _nodes(func.body)
    index_slices = {
        dotted(target.target)
        for node in nodes
        if isinstance(node, cst.Assign)
        and isinstance(node.value, cst.Subscript)
        and _row_slice(node.value)
        for target in node.targets
    } - {None}
    yields = [node for node in nodes if isinstance(node, cst.Yield)]
    if not yields:
        return False
    for node in yields:
        value = node.value
        if value is None or isinstance(value, cst.From):
            return False
        parts = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        if not all(_slices_rows(part, index_slices) for part in parts):  # type: ignore[arg-type]
            return False
    return True


def batch_stream_makers(classes: list[cst.ClassDef], functions: list[cst.FunctionDef]) -> set[str]:
    """Names of the classes whose `__iter__` yields batches and of the generator functions
    that yield batches: calling one makes a batch stream."""
    found = set()
    for cls in classes:
        for statement in cls.body.body:
            if (
                isinstance(statement, cst.FunctionDef)
                and statement.name.value == "__iter__"
                and _yields_batches(statement)
            ):
                found.add(cls.name.value)
    for func in functions:
        if func.name.value != "__iter__" and _yields_batches(func):
            found.add(func.name.value)
    return found


def maker_of(value: cst.BaseExpression, makers: set[str]) -> str | None:
    """`DataStreamer` for `DataStreamer(...)` when it makes a batch stream."""
    callee = _callee(value)
    return callee if callee in makers else None
