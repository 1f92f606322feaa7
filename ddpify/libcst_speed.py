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

(libcst hashes nodes by `id` in a Python method; CPython's identity hash would be cheaper
for the parent and order maps, but a process that also uses libcst may hold dicts keyed
by nodes hashed the old way, so that is left alone.)
"""

from __future__ import annotations

import threading

import libcst as cst
from libcst._nodes.base import CSTNode

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
