"""Rendering that reuses the code of statements already rendered (codegen.StatementCodes,
what migrate renders with) gives `Module.code` byte for byte: after random rewrites
that move statements into new blocks, in else/elif/except/finally/match clauses, with
tabs, CRLF, and when one statement object is rendered at two depths."""

from __future__ import annotations

import os

import libcst as cst
import pytest

from ddpify.analysis.tree import Tree
from ddpify.codegen import ModuleText
from tests.helpers import FIXTURES
from tests.test_splice import AWKWARD, _rewrites

CLAUSES = """\
import torch


def step(model, batch, flag):
    if flag:  # the if
        loss = model(batch)
    elif flag is None:
        # before the elif's statement
        loss = model(batch) * 2
    else:
        loss = None

    try:
        loss.backward()
    except RuntimeError as error:
        print("failed", error)
    finally:
        torch.save(model, "m.pt")
    try:
        print("grouped")
    except* ValueError:
        print("in a group")
    for _ in range(2):
        print("again")
    else:
        print("done")
    while flag:
        flag = False
    else:
        print("stopped")
    match flag:
        case None:
            print("none")
        case _:
            print("other")
    with torch.no_grad():
        print("no grad")
    return loss
"""


def _guard_prints(module: cst.Module) -> cst.Module:
    """Every `print(...)` line in a block's body wrapped in `if RANK == 0:`: the same
    statement object, one block deeper (the clauses around are kept as they are)."""
    wrapper = cst.parse_statement("if RANK == 0:\n    pass\n")

    def guarded(statement):
        if isinstance(statement, cst.SimpleStatementLine):
            if "print(" not in cst.Module([]).code_for_node(statement):
                return statement
            return wrapper.with_changes(body=wrapper.body.with_changes(body=[statement]))
        block = getattr(statement, "body", None)
        if not isinstance(block, cst.IndentedBlock):
            return statement
        body = [guarded(inner) for inner in block.body]
        if all(a is b for a, b in zip(body, block.body)):
            return statement
        return statement.with_changes(body=block.with_changes(body=body))

    return module.with_changes(body=[guarded(statement) for statement in module.body])


@pytest.mark.parametrize("text", [CLAUSES, AWKWARD], ids=["clauses", "awkward"])
@pytest.mark.parametrize("variant", ["as written", "tabs", "CRLF"])
def test_a_statement_moved_into_a_new_block_renders_at_its_new_depth(text, variant):
    if variant == "tabs":
        text = text.replace("    ", "\t")
    elif variant == "CRLF":
        text = text.replace("\n", "\r\n")
    old = cst.parse_module(text)
    new = _guard_prints(old)
    assert new.code != text  # the rewrite did move statements
    render = ModuleText(inner=True)
    assert render.code(old) == text  # fills the codes at the old depths
    assert render.code(new) == new.code
    assert render.code(old) == text  # and the old depths are still right


def test_random_rewrites_render_as_libcst_renders_them():
    render = ModuleText(inner=True)
    for old, new, text in _rewrites(AWKWARD, seed=3, count=40):
        assert render.code(old) == old.code
        assert render.code(new) == text


def _rendered_from_now(monkeypatch) -> list[cst.CSTNode]:
    """The statements rendered from now on (not taken from the codes)."""
    from ddpify import codegen

    found: list[cst.CSTNode] = []
    real = codegen._through_codes

    def spy(node):
        found.append(node)
        return real(node)

    monkeypatch.setattr(codegen, "_through_codes", spy)
    return found


def _kept_by_guard_prints(old: cst.Module) -> set[int]:
    """The statements with no print in them: `_guard_prints` neither moves nor rebuilds
    them."""
    tree = Tree(old)
    return {id(n) for n in tree.find(cst.BaseStatement) if "print(" not in tree.code(n)}


def test_the_codes_are_reused_for_the_statements_a_rewrite_kept(monkeypatch):
    """Rendering the rewritten module renders only what the rewrite built: the statements
    it kept inside the functions it rebuilt come from the codes."""
    old = cst.parse_module(CLAUSES)
    new = _guard_prints(old)
    render = ModuleText(inner=True)
    render.code(old)
    rendered = _rendered_from_now(monkeypatch)
    assert render.code(new) == new.code
    tree = Tree(old)
    kept = _kept_by_guard_prints(old)
    again = [n for n in rendered if id(n) in kept]
    assert not again, [tree.code(n)[:40] for n in again]
    assert len(rendered) > 10  # the wrappers, the moved lines and the rebuilt blocks were


def test_every_fixture_renders_as_libcst_renders_it():
    for path in sorted(FIXTURES.rglob("*.py")):
        try:
            module = cst.parse_module(path.read_text())
        except cst.ParserSyntaxError:
            continue
        assert ModuleText(inner=True).code(module) == module.code, path


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


@needs_fork
@pytest.mark.parametrize("text", [CLAUSES, AWKWARD], ids=["clauses", "awkward"])
def test_a_module_rendered_beside_renders_here_from_the_childs_codes(text, monkeypatch):
    """`code_beside` renders in a forked child; this process then renders the rewritten
    module from the child's codes: byte for byte what libcst renders, and without
    rendering again a statement the rewrite kept."""
    old = cst.parse_module(text)
    new = _guard_prints(old)
    render = ModuleText(inner=True)
    assert render.code_beside(old)() == (text, None)
    rendered = _rendered_from_now(monkeypatch)
    assert render.code(old) == text and not rendered  # every code came from the child
    assert render.code(new) == new.code
    kept = _kept_by_guard_prints(old)
    assert rendered and not [n for n in rendered if id(n) in kept]


@needs_fork
def test_an_input_rendered_beside_that_does_not_round_trip_is_refused(monkeypatch):
    """Migrate renders a large input beside its analysis; a render that differs from the
    text fails the parse gate as it does when rendered here, before any other verdict."""
    from ddpify import codegen
    from ddpify.gates import GateError
    from ddpify.migrate import migrate_source, pipeline

    monkeypatch.setattr(pipeline, "PARALLEL_CHARS", 0)
    monkeypatch.setattr(codegen, "_rendered_statements", lambda module: ("other\n", [], {}))
    text = (FIXTURES / "migrate" / "single_main_argparse" / "before.py").read_text()
    with pytest.raises(GateError) as refused:
        migrate_source(text, "train.py")
    assert refused.value.pass_name == "parse" and "round-trip" in refused.value.reason
