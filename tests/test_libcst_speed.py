"""The parse that skips re-checking the parser's own nodes (ddpify/libcst_speed.py)."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst._nodes.base import CSTNode

from ddpify.libcst_speed import clone, field_names, parse_module
from tests.helpers import FIXTURES


def _node_classes(base: type) -> list[type]:
    found = []
    for cls in base.__subclasses__():
        found.append(cls)
        found.extend(_node_classes(cls))
    return found


def test_no_node_class_has_its_own_post_init():
    # The skip is installed on CSTNode alone: a class of its own would bypass it.
    assert [c for c in _node_classes(CSTNode) if "__post_init__" in vars(c)] == []


@pytest.mark.parametrize(
    "path", sorted((FIXTURES / "migrate").glob("*/before.py"))[:25], ids=lambda p: p.parent.name
)
def test_the_module_equals_libcsts_parse(path):
    text = path.read_text()
    module = parse_module(text)
    assert module.deep_equals(cst.parse_module(text))
    assert module.code == text


def test_nodes_made_outside_a_parse_are_still_checked():
    parse_module("x = 1\n")
    with pytest.raises(cst.CSTValidationError):
        cst.SimpleWhitespace("not whitespace")
    with pytest.raises(cst.CSTValidationError):
        cst.Name("x", lpar=[cst.LeftParen()])  # a parenthesis with no partner


def test_a_syntax_error_is_libcsts_own():
    with pytest.raises(cst.ParserSyntaxError):
        parse_module("def broken(:\n")
    with pytest.raises(cst.CSTValidationError):  # and the check is back on after it
        cst.SimpleWhitespace("x")


def _nodes(node: CSTNode) -> list[CSTNode]:
    found = [node]
    for child in node.children:
        found.extend(_nodes(child))
    return found


def _layout(node: object) -> object:
    """Each node's class and each field's value, containers' types included."""
    if isinstance(node, CSTNode):
        return (
            type(node),
            {name: _layout(getattr(node, name)) for name in field_names(type(node))},
        )
    if isinstance(node, (list, tuple)):
        return (type(node), [_layout(item) for item in node])
    return node


@pytest.mark.parametrize(
    "path", sorted((FIXTURES / "migrate").glob("*/after.py"))[:10], ids=lambda p: p.parent.name
)
def test_a_clone_is_libcsts_deep_clone_with_no_node_shared(path):
    module = parse_module(path.read_text())
    copy = clone(module)
    assert _layout(copy) == _layout(module.deep_clone())
    assert copy.code == module.code
    assert not {id(n) for n in _nodes(copy)} & {id(n) for n in _nodes(module)}
