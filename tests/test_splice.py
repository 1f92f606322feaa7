"""The output's parse spliced from the input's (ddpify/splice.py) is the module a full
parse of the output gives: same code byte for byte, deep-equal nodes, same indentation
and newline, on migrations of our fixtures, on a generated script, and on random
statement-level rewrites of scripts full of comments in awkward places."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import libcst as cst
import pytest

from ddpify import splice
from ddpify.analysis.tree import Tree
from ddpify.gates import GateError
from ddpify.migrate import migrate_source
from ddpify.migrate.edits import Edits

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scaling import script  # noqa: E402

FIXTURES = sorted((ROOT / "fixtures" / "migrate").glob("*/before.py"))

# Comments and blank lines where the parser has choices to make: at a block's end, at
# the indentation of an outer block, before a dedent, after a decorator, at the end.
AWKWARD = '''\
# a header comment

import os
import torch


def train(model, loader, steps=10):
    # before the first statement
    for step, (x, y) in enumerate(loader):
        loss = model(x, y)
        loss.backward()
        # at the loop's end, indented with the loop body
    # after the loop, at the function's indentation
        # deeper than the next statement
    if step > steps:
        print("done", step)  # trailing
# at column 0 inside the function
    torch.save(model.state_dict(), "model.pt")
    return loss
    # the function's last line


@torch.no_grad()
# between decorator and def
def evaluate(model, loader, device="cuda"):
    total = 0
    with torch.autocast("cuda"):
        for x, y in loader:
            total += model(x.to(device)).sum().item()

            # blank line above, end of the inner loop
    print("total", total)
    return total


class Trainer:
    """A trainer."""

    def __init__(self, model):
        self.model = model
        self.step = 0

    # between methods

    def fit(self, loader):
        while self.step < 10:
            self.step += 1
            if self.step % 2:
                print(self.step)
        torch.save(self.model, "trainer.pt")


if __name__ == "__main__":
    train(None, [])
    evaluate(None, [])
# the file's last comment
'''


# The same, in the blocks of clauses: elif/else chains, for-else, try with several except
# clauses, else and finally, comments at each clause's edge and at odd indentations.
AWKWARD_CLAUSES = """\
import torch


def train(model, loader, rank, steps=10):
    try:
        for step, (x, y) in enumerate(loader):
            loss = model(x, y)
            loss.backward()
            # the loop body's last comment
        else:
            print("epoch done")
        # before the first except, at the try's indentation
    except KeyboardInterrupt:
        print("interrupted")
            # deeper than the except's body
    except (RuntimeError, ValueError) as error:  # trailing on the except
        print("failed", error)
        raise
    else:
        torch.save(model.state_dict(), "model.pt")
    # before finally
    finally:
        print("closing")
    if rank == 0:
        print("rank zero")
    elif rank == 1:
        # first in an elif
        print("rank one")

    elif rank > 1:
        print("another rank")
    else:
        print("no rank")
        # the else's end
# column 0 before the while
    while steps > 0:
        steps -= 1
        if steps % 2:
            continue
    else:
        print("counted down")
    return loss


class Runner:
    def run(self, loader):
        for batch in loader:
            if batch is None:
                break
            elif len(batch) == 1:
                print("one")
            else:
                try:
                    self.step(batch)
                except StopIteration:
                    pass
        else:
            print("all batches")


if __name__ == "__main__":
    try:
        train(None, [], 0)
    except Exception:
        print("failed")
    else:
        print("ok")
"""


def _assert_parse_of(module: cst.Module, text: str) -> None:
    full = cst.parse_module(text)
    assert module.code == text
    assert (module.default_indent, module.default_newline) == (
        full.default_indent,
        full.default_newline,
    )
    assert module.deep_equals(full)


def _migrations(texts: list[str], monkeypatch) -> list[tuple[cst.Module, cst.Module, str]]:
    """(input's parse, migrated module, output) for every migration the pipeline splices."""
    seen: list[tuple[cst.Module, cst.Module, str]] = []
    real = splice.splice_parse

    def spy(old, new, text):
        seen.append((old, new, text))
        return real(old, new, text)

    monkeypatch.setattr(splice, "splice_parse", spy)
    for text in texts:
        try:
            migrate_source(text, "train.py")
        except GateError:
            pass
    monkeypatch.undo()
    return seen


def _rewrites(text: str, seed: int, count: int) -> list[tuple[cst.Module, cst.Module, str]]:
    """Random rewrites the way migrate passes make them (ddpify/migrate/edits.py): simple
    statements wrapped in an `if`, removed, or given a new statement before or after,
    and literals changed (in headers as well as bodies)."""
    rng = random.Random(seed)
    old = cst.parse_module(text)
    tree = Tree(old, text)
    lines = [n for n in tree.nodes if isinstance(n, cst.SimpleStatementLine)]
    literals = [n for n in tree.nodes if isinstance(n, (cst.Integer, cst.SimpleString))]
    out = []
    for _ in range(count):
        edits = Edits()
        for line in rng.sample(lines, k=min(3, len(lines))):
            choice = rng.randrange(4)
            if choice == 0:
                wrapped = cst.parse_statement("if RANK == 0:\n    pass\n")
                edits.replace(
                    line,
                    lambda new, w=wrapped: w.with_changes(body=w.body.with_changes(body=[new])),
                )
            elif choice == 1:
                edits.removed.add(line)
            elif choice == 2:
                edits.before[line].append(cst.parse_statement("dist.barrier()  # wait\n"))
            else:
                edits.after[line].append(cst.parse_statement("if RANK == 0:\n    log()\n"))
        for literal in rng.sample(literals, k=min(2, len(literals))):
            edits.replace(literal, cst.Integer("7"))
        new = edits.apply(old, tree.parent)
        out.append((old, new, new.code))
    return out


def _check_all(cases) -> int:
    """Assert every splice; the number of cases that spliced (not parsed whole)."""
    spliced = 0
    for old, new, text in cases:
        module = splice.splice_parse(old, new, text)
        if module is not None:
            _assert_parse_of(module, text)
            spliced += 1
    return spliced


def test_migrations_of_the_fixtures_and_a_generated_script_splice_to_a_full_parse(monkeypatch):
    texts = [path.read_text() for path in FIXTURES] + [script(300)]
    cases = _migrations(texts, monkeypatch)
    assert len(cases) >= len(texts) // 2
    assert _check_all(cases) == len(cases)


@pytest.mark.parametrize(
    "variant",
    ["as written", "CRLF", "tabs", "two spaces", "no last line break"],
)
def test_random_rewrites_splice_to_a_full_parse(variant):
    text = AWKWARD
    if variant == "CRLF":
        text = text.replace("\n", "\r\n")
    elif variant == "tabs":
        text = text.replace("    ", "\t")
    elif variant == "two spaces":
        text = text.replace("    ", "  ")
    elif variant == "no last line break":
        text = text.rstrip("\n")
    cases = _rewrites(text, seed=len(variant), count=30)
    assert _check_all(cases) >= 20  # most rewrites splice; the rest are parsed whole


def test_a_rewrite_inside_a_function_reparses_only_around_it():
    old = cst.parse_module(AWKWARD)
    tree = Tree(old, AWKWARD)
    target = next(
        n
        for n in tree.nodes
        if isinstance(n, cst.SimpleStatementLine) and "self.step += 1" in old.code_for_node(n)
    )
    edits = Edits()
    edits.after[target].append(cst.parse_statement("dist.barrier()\n"))
    new = edits.apply(old, tree.parent)
    parsed: list[str] = []
    real = cst.parse_module

    def counting(source: str) -> cst.Module:
        parsed.append(source)
        return real(source)

    splice.cst.parse_module = counting  # type: ignore[attr-defined]
    try:
        module = splice.splice_parse(old, new, new.code)
    finally:
        splice.cst.parse_module = real  # type: ignore[attr-defined]
    assert module is not None
    _assert_parse_of(module, new.code)
    # Only the loop's body went through the parser (in its scaffold), and every other
    # top-level statement is the input's own object.
    assert sum(len(source) for source in parsed) < 200
    assert sum(a is b for a, b in zip(module.body, old.body)) == len(old.body) - 1


@pytest.mark.parametrize("variant", ["as written", "CRLF", "tabs"])
def test_random_rewrites_in_else_and_except_blocks_splice_to_a_full_parse(variant):
    text = AWKWARD_CLAUSES
    if variant == "CRLF":
        text = text.replace("\n", "\r\n")
    elif variant == "tabs":
        text = text.replace("    ", "\t")
    cases = _rewrites(text, seed=len(variant), count=40)
    assert _check_all(cases) >= 25  # most rewrites splice; the rest are parsed whole


def test_a_rewrite_in_an_except_block_reparses_only_around_it():
    """A statement added in the second `except` of a try that has else and finally
    clauses: only that block goes through the parser; the try's other blocks and the
    function's other statements are the input's objects."""
    old = cst.parse_module(AWKWARD_CLAUSES)
    tree = Tree(old, AWKWARD_CLAUSES)
    target = next(
        n
        for n in tree.nodes
        if isinstance(n, cst.SimpleStatementLine)
        and 'print("failed", error)' in old.code_for_node(n)
    )
    edits = Edits()
    edits.after[target].append(cst.parse_statement("dist.barrier()\n"))
    new = edits.apply(old, tree.parent)
    parsed: list[str] = []
    real = cst.parse_module

    def counting(source: str) -> cst.Module:
        parsed.append(source)
        return real(source)

    splice.cst.parse_module = counting  # type: ignore[attr-defined]
    try:
        module = splice.splice_parse(old, new, new.code)
    finally:
        splice.cst.parse_module = real  # type: ignore[attr-defined]
    assert module is not None
    _assert_parse_of(module, new.code)
    assert sum(len(source) for source in parsed) < 200
    old_try, new_try = old.body[1].body.body[0], module.body[1].body.body[0]
    assert new_try.body.body[0] is old_try.body.body[0]  # the loop in the try's body
    assert new_try.finalbody is old_try.finalbody and new_try.orelse is old_try.orelse
    assert new_try.handlers[0] is old_try.handlers[0]
    assert new_try.handlers[1] is not old_try.handlers[1]


def test_a_statement_that_becomes_the_first_is_parsed_again():
    """With the statement before it removed, the module's header may take the blank
    lines above the (unchanged) class: the class is parsed again, not reused."""
    text = "# licence\n\nimport enum\n\nclass Kind(enum.Enum):\n    a = 1\n\nb = 2\n"
    old = cst.parse_module(text)
    tree = Tree(old, text)
    edits = Edits()
    edits.removed.add(old.body[0])
    new = edits.apply(old, tree.parent)
    assert new.body[0] is old.body[1]
    module = splice.splice_parse(old, new, new.code)
    assert module is not None
    _assert_parse_of(module, new.code)


def test_the_checks_catch_a_splice_with_an_off_by_one(monkeypatch):
    """A test double of `_descend` with an off-by-one (it takes a block's footer from the
    region that ends one statement before the block's end) must fail the checks above:
    they can see a bad splice."""

    def off_by_one(new, old, indents, style, following):
        block, old_block = new.body, old.body
        inner = (*indents, style.indent if block.indent is None else block.indent)
        body, regions = splice._spliced_body(block, old_block, inner, style, following)
        if regions and regions[-1].stop == len(block.body) - 1:  # planted: not `- 1`
            footer = regions[-1].footer
        else:
            footer = old_block.footer
        shell = old if splice._same_header(new, old) else splice._parse_header(new, indents, style)
        return shell.with_changes(body=shell.body.with_changes(body=body, footer=footer))

    monkeypatch.setattr(splice, "_descend", off_by_one)
    with pytest.raises(AssertionError):
        _check_all(_rewrites(AWKWARD, seed=0, count=40))


def test_a_splice_that_does_not_render_to_the_output_is_not_used(monkeypatch):
    """The pipeline renders the spliced module and parses the output whole when it is not
    the output's code: a wrong splice costs time, never a wrong gate."""
    text = FIXTURES[0].read_text()
    expected = migrate_source(text, "train.py").output
    monkeypatch.setattr(splice, "splice_parse", lambda old, new, output: old)
    assert migrate_source(text, "train.py").output == expected


def test_same_tree_answers_as_deep_equals():
    pairs = [
        ("x = f(a, b)\n", "x = f(a, b)\n"),
        ("x = f(a, b)\n", "x = f(a,b)\n"),  # whitespace is part of the tree
        ("x = a * (b + c)\n", "x = a * b + c\n"),
        ("if a:\n    pass\n", "if a:\n    pass\nelse:\n    pass\n"),
        ("def f():\n    return 1  # one\n", "def f():\n    return 1  # one\n"),
        ("def f():\n    return 1  # one\n", "def f():\n    return 1  # two\n"),
    ]
    for first, second in pairs:
        a, b = cst.parse_module(first), cst.parse_module(second)
        assert splice.same_tree(a, b) == a.deep_equals(b), (first, second)


def test_same_tree_tells_a_built_tree_from_the_parse_of_its_code():
    # Built without parentheses, `a * (b + c)` renders as `a * b + c`, which parses as
    # `(a * b) + c`: the same text, another tree (another meaning).
    inner = cst.BinaryOperation(cst.Name("b"), cst.Add(), cst.Name("c"))
    built = cst.Module(
        [
            cst.SimpleStatementLine(
                [cst.Expr(cst.BinaryOperation(cst.Name("a"), cst.Multiply(), inner))]
            )
        ]
    )
    parsed = cst.parse_module(built.code)
    assert built.code == parsed.code
    assert not splice.same_tree(built, parsed)


def test_same_tree_does_not_recurse_with_the_depth_of_the_code():
    def nested(depth: int) -> cst.BaseExpression:
        node: cst.BaseExpression = cst.Name("x")
        for _ in range(depth):
            node = cst.UnaryOperation(cst.Minus(), node)
        return node

    depth = sys.getrecursionlimit() * 4
    assert splice.same_tree(nested(depth), nested(depth))
    assert not splice.same_tree(nested(depth), nested(depth + 1))
