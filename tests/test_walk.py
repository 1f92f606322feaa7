"""The fast traversal visits syntax nodes in source order and survives deep nesting."""

from __future__ import annotations

import libcst as cst

from ddpify.walk import SubtreeMemo, new_generation, subtree, walk


def names_in_order(source: str) -> list[str]:
    seen: list[str] = []
    walk(
        cst.parse_module(source),
        lambda node: seen.append(node.value) if isinstance(node, cst.Name) else None,
        lambda node: None,
    )
    return seen


def test_source_order_for_decorators_and_conditional_expressions():
    source = "@deco\ndef f(a):\n    return b if c else d\n"
    assert names_in_order(source) == ["deco", "f", "a", "b", "c", "d"]


def test_every_enter_has_a_leave_in_nesting_order():
    events: list[tuple[str, str]] = []
    walk(
        cst.parse_module("x = f(y)\n"),
        lambda n: events.append(("enter", type(n).__name__)),
        lambda n: events.append(("leave", type(n).__name__)),
    )
    depth = 0
    for kind, _ in events:
        depth += 1 if kind == "enter" else -1
        assert depth >= 0
    assert depth == 0
    assert events[0] == ("enter", "Module") and events[-1] == ("leave", "Module")


def test_formatting_nodes_are_skipped():
    kinds: set[str] = set()
    walk(cst.parse_module("# c\nx = ( 1 ,)\n"), lambda n: kinds.add(type(n).__name__), lambda n: 0)
    assert {"Comment", "SimpleWhitespace", "LeftParen", "Comma", "EmptyLine"}.isdisjoint(kinds)
    assert {"Assign", "Tuple", "Integer"} <= kinds


def test_deep_expression_does_not_hit_the_recursion_limit():
    source = "x = " + " + ".join(["a"] * 3000) + "\n"
    assert len(names_in_order(source)) == 3001


def test_type_parameters_are_visited_between_name_and_parameters():
    # PEP 695 generics: a bound can name a module (`T: nn.Module`) a rule must see.
    function = "def f[T: Bound](x: T) -> R:\n    pass\n"
    assert names_in_order(function) == ["f", "T", "Bound", "x", "T", "R"]
    cls = "class C[T: Bound](Base):\n    pass\n"
    assert names_in_order(cls) == ["C", "T", "Bound", "Base"]


def test_subtree_yields_what_walk_enters_in_the_same_order():
    module = cst.parse_module("@d\ndef f(x=a if b else c):\n    return [g(y) for y in x]\n")
    entered: list[cst.CSTNode] = []
    walk(module, entered.append, lambda node: None)
    assert list(subtree(module)) == entered
    body = module.body[0].body
    assert list(subtree(body))[0] is body


def test_subtree_memo_answers_once_per_node_and_keeps_one_lint():
    """An answer is kept for the node it was computed for, across one new generation (the
    next lint), and dropped when that lint did not ask about the node."""
    asked = []
    memo = SubtreeMemo(lambda node: asked.append(node) or cst.Module([]).code_for_node(node))
    first, twin = cst.parse_statement("x = 1\n"), cst.parse_statement("x = 1\n")
    assert memo(first) == memo(first) == "x = 1\n"
    new_generation()  # the next lint reuses `first`
    assert memo(first) == "x = 1\n"
    assert memo(twin) == "x = 1\n"  # the same code in another node: computed anew
    assert asked == [first, twin]
    new_generation()  # this lint asks about `twin` only
    memo(twin)
    new_generation()
    memo(first)
    assert asked == [first, twin, first]
