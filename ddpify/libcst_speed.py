"""libcst's parse without re-checking the nodes its own parser builds.

Every libcst node checks its invariants when it is made (`CSTNode._validate`: a space
after `not`, whitespace made of spaces and tabs, parentheses that pair up). For a node a
pass builds that catches a wrong rewrite; for the nodes the parser builds from text, the
grammar has already decided every one of them, and the checks are about a sixth of the
parse (regular expressions over each whitespace node). `parse_module` skips them for the
nodes made during the parse, in this thread only; every node made elsewhere is checked as
before. Whatever ddpify parses is also checked as a whole: the input compiles under
CPython and renders back to its text byte for byte (gates.py), and an output is re-parsed
and compiled before it is written.

`clone` is `deep_clone` without each copy's `__init__`: the dataclass machinery and the
checks again, for a copy of a node that passed them (migrate copies a parsed snippet per
site, thousands of times on a large script).

(libcst hashes nodes by `id` in a Python method; CPython's identity hash would be cheaper
for the parent and order maps, but a process that also uses libcst may hold dicts keyed
by nodes hashed the old way, so that is left alone.)
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TypeVar

import libcst as cst
from libcst._nodes.base import CSTNode

NodeT = TypeVar("NodeT", bound=CSTNode)

_local = threading.local()
_check_node = CSTNode.__post_init__


def _post_init(node: CSTNode) -> None:
    if not getattr(_local, "parsing", False):
        _check_node(node)


# libcst's dataclass `__init__`s call `self.__post_init__()`, which no node class
# overrides (tests/test_libcst_speed.py checks it for the installed libcst).
CSTNode.__post_init__ = _post_init  # type: ignore[method-assign]


def parse_module(text: str) -> cst.Module:
    """`libcst.parse_module(text)`; raises its ParserSyntaxError alike."""
    if getattr(_local, "parsing", False):
        return cst.parse_module(text)
    _local.parsing = True
    try:
        return cst.parse_module(text)
    finally:
        _local.parsing = False


@functools.cache
def field_names(cls: type) -> tuple[str, ...]:
    """The fields of a node class, in order (`dataclasses.fields` is slow per node)."""
    return tuple(field.name for field in dataclasses.fields(cls))


def clone(node: NodeT) -> NodeT:
    """`node.deep_clone()`: a new object for `node` and every node below it, each field
    as libcst's copy has it (a sequence as a tuple, anything else that is not a node
    shared: strings, sentinels and enums are immutable)."""
    cls = type(node)
    copy = object.__new__(cls)
    for name in field_names(cls):
        value = getattr(node, name)
        if isinstance(value, CSTNode):
            value = clone(value)
        elif isinstance(value, (list, tuple)):
            value = tuple(clone(v) if isinstance(v, CSTNode) else v for v in value)
        object.__setattr__(copy, name, value)
    return copy
