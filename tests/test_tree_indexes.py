"""The indexes the analysis answers from give the answers a plain walk gives: `within`
(the nodes inside a container, told by positional parents), the per-type node lists a
kind is read from, each call's dotted and qualified name, the callers index behind the
roles' reaching functions, the names an import line holds, the calls to some names
and the identifiers a module spells."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis import roles
from ddpify.analysis.names import dotted
from ddpify.analysis.tree import Tree
from ddpify.migrate import imports
from ddpify.walk import walk
from tests.helpers import FIXTURES

SCRIPTS = [
    (FIXTURES / "migrate" / "single_main_argparse" / "before.py").read_text(),
    (FIXTURES / "migrate" / "single_trainer_class" / "before.py").read_text(),
]

NESTED = """\
import torch
import os, sys; from torch import nn as tnn
import torch.distributed as dist
flag = 1; import json


def outer(model, x):
    def inner(y):
        @decorate(helper(y))
        def deepest(z=make(z)):
            return model(z)
        return deepest(y)
    if x:
        with open("a.txt", "w") as handle:
            handle.write(str(inner(x)))
    return [inner(v) for v in x]


def caller():
    return outer(None, [1])


def unrelated():
    return tnn.Linear(2, 2)


class Holder:
    def step(self):
        dist.barrier()
        caller()
"""


def _descendants(node: cst.CSTNode) -> list[cst.CSTNode]:
    found: list[cst.CSTNode] = []
    walk(node, found.append, lambda _: None)
    return found[1:]  # the container itself is not inside


def _from_walk(module: cst.Module) -> Tree:
    """The tree the lint engine makes from its own walk's parent map."""
    parents: dict[cst.CSTNode, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = []

    def enter(node: cst.CSTNode) -> None:
        if stack:
            parents[node] = stack[-1]
        stack.append(node)

    walk(module, enter, lambda _: stack.pop())
    return Tree.from_walk(module, parents)


def _trees() -> list[Tree]:
    modules = [cst.parse_module(text) for text in [*SCRIPTS, NESTED]]
    return [Tree(module) for module in modules] + [_from_walk(modules[-1])]


@pytest.mark.parametrize("tree", _trees())
def test_within_yields_what_a_walk_of_the_container_finds(tree):
    kinds = [cst.CSTNode, cst.Call, cst.Name, cst.BaseStatement, cst.BaseExpression]
    containers = tree.find(cst.BaseCompoundStatement) + tree.find(cst.Call)[:50]
    assert containers
    for container in containers:
        inside = _descendants(container)
        for kind in kinds:
            assert list(tree.within(container, kind)) == [n for n in inside if isinstance(n, kind)]


def test_within_follows_the_parent_map_when_a_node_occurs_twice():
    # One statement object in two functions: the parent map keeps its last parent, so
    # the first function's walk stops where it meets it (as `inside` says).
    shared = cst.parse_statement("log(x)\n")
    module = cst.parse_module("def a():\n    pass\n\n\ndef b():\n    pass\n")
    first, second = module.body
    module = module.with_changes(
        body=[
            first.with_changes(body=first.body.with_changes(body=[shared, shared])),
            second.with_changes(body=second.body.with_changes(body=[shared])),
        ]
    )
    tree = Tree(module)
    a, b = tree.module.body
    assert tree._positional_parents() is None
    assert list(tree.within(a, cst.Call)) == []
    assert [dotted(c.func) for c in tree.within(b, cst.Call)] == ["log"]


@pytest.mark.parametrize("tree", _trees())
def test_a_kind_lists_the_nodes_isinstance_picks_in_source_order(tree):
    nodes = tree.nodes
    for kind in [cst.BaseStatement, cst.BaseSmallStatement, (cst.Import, cst.ImportFrom)]:
        assert tree.find(kind) == [n for n in nodes if isinstance(n, kind)]
        assert tree.find(kind) == [n for n in nodes if isinstance(n, kind)]  # cached


@pytest.mark.parametrize("tree", _trees())
def test_each_call_has_its_dotted_and_qualified_name(tree):
    calls = [n for n in tree.nodes if isinstance(n, cst.Call)]
    assert tree.call_names() == [(c, dotted(c.func), tree.qualify(c.func)) for c in calls]
    assert tree.qualified_calls() == [(c, tree.qualify(c.func)) for c in calls]


@pytest.mark.parametrize("tree", _trees())
def test_calls_to_some_names_are_their_calls_in_source_order(tree):
    calls = [n for n in tree.nodes if isinstance(n, cst.Call)]
    names = sorted({tree.qualify(c.func) for c in calls} - {None})
    assert len(names) >= 2
    for asked in [names[:1], names[-2:], [names[1], names[0], names[1]], ["no.such.call"]]:
        expected = [c for c in calls if tree.qualify(c.func) in asked]
        assert tree.calls_to(*asked) == expected


def _calls_a_call(call: cst.Call) -> bool:
    return isinstance(call.func, cst.Call) or any(isinstance(a.value, cst.Call) for a in call.args)


@pytest.mark.parametrize("tree", _trees())
def test_calls_where_a_test_holds_are_those_a_filter_keeps(tree):
    calls = [n for n in tree.nodes if isinstance(n, cst.Call)]
    expected = [c for c in calls if _calls_a_call(c)]
    assert expected and len(expected) < len(calls)
    assert tree.calls_where(_calls_a_call) == expected
    assert tree.calls_where(_calls_a_call) == expected  # kept per segment


@pytest.mark.parametrize("tree", _trees())
def test_names_are_the_identifiers_a_walk_finds(tree):
    assert tree.names() == {n.value for n in tree.nodes if isinstance(n, cst.Name)}
    for node in [*tree.module.body, *tree.find(cst.Call)[:20]]:
        found = {n.value for n in _descendants(node) if isinstance(n, cst.Name)}
        assert tree.names_in(node) == found


def _reaching_by_fixpoint(tree: Tree, calls: list[cst.Call]) -> frozenset[str]:
    """The definition: rescan every function until no name is added."""
    found = {f.name.value for f in map(tree.function, calls) if f is not None}
    grew = True
    while grew:
        grew = False
        for func in tree.find(cst.FunctionDef):
            if func.name.value in found:
                continue
            if any(roles._callee(c) in found for c in _descendants(func) if type(c) is cst.Call):
                found.add(func.name.value)
                grew = True
    return frozenset(found)


def test_reaching_functions_are_the_fixpoint_of_the_call_graph():
    tree = Tree(cst.parse_module(NESTED))
    for callee in ["model", "barrier", "make", "helper", "Linear", "write"]:
        calls = [c for c in tree.find(cst.Call) if roles._callee(c) == callee]
        assert calls, callee
        assert roles._reaching(tree, calls) == _reaching_by_fixpoint(tree, calls)
    model = [c for c in tree.find(cst.Call) if roles._callee(c) == "model"]
    # deepest holds the call; inner, outer, caller and Holder.step call up to it
    assert roles._reaching(tree, model) == {"deepest", "inner", "outer", "caller", "step"}


def test_used_names_leave_out_the_names_of_import_lines_only():
    tree = Tree(cst.parse_module(NESTED))
    used = imports._used_names(tree)
    # `sys` and `tnn` are on a line that begins with an import; `tnn` is read elsewhere
    assert "tnn" in used and "dist" in used and "torch" not in used
    assert "os" not in used and "sys" not in used
    assert "json" in used  # its line begins with an assignment
    assert "barrier" not in used  # an attribute's name is no local name
    assert {"outer", "inner", "model", "handle"} <= used


def test_owner_is_the_module_holding_a_node_for_a_tree_and_a_project_view():
    from ddpify.analysis.project import ProjectView

    entry = Tree(cst.parse_module("import helper\nhelper.run()\n"))
    helper = Tree(cst.parse_module("def run():\n    return 1\n"))
    view = ProjectView([entry, helper])
    call = entry.find(cst.Call)[0]
    returned = helper.find(cst.Return)[0]
    assert entry.owner(call) is entry
    assert view.owner(call) is entry
    assert view.owner(returned) is helper
    assert view.owner(cst.Name("elsewhere")) is None


def _plain_order(tree: Tree) -> dict:
    return dict(zip(tree.nodes, range(len(tree.nodes))))


@pytest.mark.parametrize("tree", _trees())
def test_each_nodes_order_is_its_last_index_in_the_walk(tree):
    order, plain = tree.order, _plain_order(tree)
    assert len(order) == len(plain)
    assert all(order[node] == index for node, index in plain.items())
    assert cst.Name("elsewhere") not in order and order.get(cst.Name("x"), -1) == -1


def test_the_order_of_a_tree_a_pass_made_counts_the_statements_it_moved():
    # A statement object twice (at the top level and in a function), and a tree made
    # from the one before: each node's order is its last place in this tree's walk.
    module = cst.parse_module(NESTED)
    before = Tree(module)
    before.order[module.body[-1]]  # the segments keep their indexes: reused below
    moved = module.body[1]
    outer = next(s for s in module.body if isinstance(s, cst.FunctionDef))
    edited = module.with_changes(
        body=[
            moved,
            *module.body[:2],
            outer.with_changes(body=outer.body.with_changes(body=[moved, *outer.body.body])),
            *module.body[2:],
        ]
    )
    after = Tree(edited, previous=before)
    plain = _plain_order(after)
    assert len(after.order) == len(plain)
    assert all(after.order[node] == index for node, index in plain.items())
