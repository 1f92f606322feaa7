"""A fast read-only traversal of a libcst tree, in source order.

libcst's own `visit` rebuilds every node it passes (it is written for transformers),
which costs about as much as parsing. Linting only reads, so this walk follows the
dataclass fields directly and skips formatting-only children (whitespace, parentheses,
commas, empty lines): about five times faster, with the syntax nodes rules care about.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Callable

import libcst as cst

_FORMATTING_FIELDS = frozenset(
    {
        "leading_lines",
        "lines_after_decorators",
        "lpar",
        "rpar",
        "comma",
        "semicolon",
        "header",
        "footer",
        "trailing_whitespace",
        "newline",
        "default_indent",
        "default_newline",
        "encoding",
        "has_trailing_newline",
        "indent",
        "equal",
        "star",
        "colon",
        "dot",
        "asynchronous",
    }
)

# Dataclass field order differs from source order for these; rules that look at
# "what came before" rely on source order.
_SOURCE_ORDER = {
    cst.FunctionDef: ("decorators", "name", "type_parameters", "params", "returns", "body"),
    cst.ClassDef: ("decorators", "name", "type_parameters", "bases", "keywords", "body"),
    cst.IfExp: ("body", "test", "orelse"),
}

_fields_cache: dict[type, tuple[str, ...]] = {}


def _child_fields(node_type: type) -> tuple[str, ...]:
    names = _fields_cache.get(node_type)
    if names is None:
        names = _SOURCE_ORDER.get(node_type) or tuple(
            field.name
            for field in dataclasses.fields(node_type)
            if field.name not in _FORMATTING_FIELDS and not field.name.startswith("whitespace")
        )
        _fields_cache[node_type] = names
    return names


# type -> whether it is a CSTNode: `isinstance(x, cst.CSTNode)` goes through ABCMeta's
# check, and this runs for every field of every node of every walk.
_node_types: dict[type, bool] = {}


def _is_node(value_type: type) -> bool:
    known = _node_types.get(value_type)
    if known is None:
        known = _node_types[value_type] = issubclass(value_type, cst.CSTNode)
    return known


def child_list(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The syntax children of `node`, in source order (a list: a walk asks for every
    node's, and a generator's resumptions cost more than building it)."""
    found: list[cst.CSTNode] = []
    for name in _child_fields(type(node)):
        value = getattr(node, name)
        value_type = type(value)
        if _is_node(value_type):
            found.append(value)
        elif value_type is tuple or value_type is list:
            found.extend([item for item in value if _is_node(type(item))])
    return found


def children(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    return iter(child_list(node))


def subtree(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """`root` and every node below it, in source (pre-)order; iterative, like `walk`."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(child_list(node)))


def walk(
    root: cst.CSTNode,
    enter: Callable[[cst.CSTNode], None],
    leave: Callable[[cst.CSTNode], None],
) -> None:
    """Call `enter` before and `leave` after each node's children; iterative, so deep
    expressions cannot exhaust the interpreter's recursion limit."""
    enter(root)
    stack = [(root, children(root))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            leave(node)
        else:
            enter(child)
            stack.append((child, children(child)))


# kinds -> {node type -> whether it is one of them}. `isinstance` against libcst's node
# classes (ABCs) runs ABCMeta's Python-level check, about 0.4 µs per class that does not
# match; the rules' per-node helpers (the innermost enclosing loop, guard or statement)
# ask it for every ancestor of every call, on every lint.
_KIND_ANSWERS: dict[tuple[type, ...], dict[type, bool]] = {}


def is_kind(node: object, kinds: tuple[type, ...]) -> bool:
    """`isinstance(node, kinds)`, answered once per node type."""
    answers = _KIND_ANSWERS.get(kinds)
    if answers is None:
        answers = _KIND_ANSWERS[kinds] = {}
    node_type = type(node)
    found = answers.get(node_type)
    if found is None:
        found = answers[node_type] = issubclass(node_type, kinds)
    return found


class SubtreeMemo:
    """Answers that depend on one subtree alone, kept from one lint to the next.

    libcst's nodes are immutable, so a question about a node's subtree has one answer for
    the node's life; the language server's next lint reuses every top-level statement an
    edit did not touch (ddpify/reparse.py), so only the loops and functions of the
    statement parsed anew are asked about again. Nodes take no weak references: an entry
    holds its node (so its id cannot be reused while the entry exists), and the engine
    starts a new generation with every lint (`new_generation`), dropping the entries the
    lint before did not ask about: a memo holds the nodes of about one file.

    Only for functions of the subtree alone: nothing from the rest of the file, the
    imports or the configuration may enter the answer.
    """

    def __init__(self, compute: Callable[[cst.CSTNode], object]) -> None:
        self._compute = compute
        self._last: dict[int, tuple[cst.CSTNode, object]] = {}
        self._now: dict[int, tuple[cst.CSTNode, object]] = {}
        MEMOS.append(self)

    def __call__(self, node: cst.CSTNode):
        key = id(node)
        entry = self._now.get(key)
        if entry is None or entry[0] is not node:
            entry = self._last.get(key)
            if entry is None or entry[0] is not node:
                entry = (node, self._compute(node))
            self._now[key] = entry
        return entry[1]

    def new_generation(self) -> None:
        self._last, self._now = self._now, {}


MEMOS: list[SubtreeMemo] = []


def new_generation() -> None:
    """A new lint starts: each memo keeps only what the last lint asked it about."""
    for memo in MEMOS:
        memo.new_generation()
