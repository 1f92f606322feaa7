"""Re-parsing only what an edit changed (the language server's parser) gives the module
a full parse gives, and reuses the statements the edit did not touch."""

from __future__ import annotations

import random
from pathlib import Path

import libcst as cst
import pytest

from ddpify.reparse import Reparser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "fixtures" / "examples" / "buggy_train.py").read_text()
PIECES = [
    "x = 1\n",
    "    y = 2\n",
    "# c\n",
    "    # indented comment\n",
    "\n",
    "def g():\n    return 1\n",
    "if a:\n",
    "(",
    "'''",
    "else:\n    pass\n",
    "@decorator\n",
    "\t",
]


def _same(module: cst.Module, text: str) -> None:
    full = cst.parse_module(text)
    assert module.deep_equals(full)
    assert (module.default_indent, module.default_newline) == (
        full.default_indent,
        full.default_newline,
    )
    assert module.code == full.code


def test_an_edit_inside_a_function_reparses_only_around_it():
    reparser = Reparser()
    first = reparser.parse(SCRIPT)
    edited = SCRIPT.replace("lr=args.lr)", "lr=args.lr * 2)")
    module = reparser.parse(edited)
    _same(module, edited)
    statements = len(module.body)
    # An edit inside one function parses that function alone: every other statement is
    # the very same object.
    assert reparser.reused == statements - 1
    assert sum(new is not old for new, old in zip(module.body, first.body)) == 1


def test_an_edit_next_to_indented_comment_lines_reparses_the_statements_around_it():
    """Indented comment lines between two functions may move into the block above them
    when an edit changes its indentation: the neighbours are parsed with the edit."""
    text = "def f():\n    x = 1\n  # between\ndef g():\n    pass\n\n\ndef h():\n    pass\n"
    reparser = Reparser()
    first = reparser.parse(text)
    edited = text.replace("    x = 1", "  x = 1")  # the comment now belongs to f's block
    module = reparser.parse(edited)
    _same(module, edited)
    assert module.body[1] is not first.body[1]  # g: its leading comment moved into f


@pytest.mark.parametrize("seed", [0])
def test_random_edits_give_the_module_a_full_parse_gives(seed):
    rng = random.Random(seed)
    reparser = Reparser()
    text = SCRIPT
    reparser.parse(text)
    reused = 0
    for _ in range(30):
        lines = text.splitlines(keepends=True)
        at = rng.randrange(len(lines))
        choice = rng.random()
        if choice < 0.4:
            lines.insert(at, rng.choice(PIECES))
        elif choice < 0.7:
            del lines[at]
        else:
            column = rng.randrange(len(lines[at]) + 1)
            lines[at] = lines[at][:column] + rng.choice(PIECES) + lines[at][column:]
        edited = "".join(lines)
        try:
            cst.parse_module(edited)
        except cst.ParserSyntaxError:
            with pytest.raises(cst.ParserSyntaxError):
                reparser.parse(edited)
            continue  # the reparser keeps its last good parse; so does the editor's text
        module = reparser.parse(edited)
        _same(module, edited)
        reused += reparser.reused > 0
        text = edited
    assert reused >= 5  # most valid edits reused statements


def test_an_edit_at_the_start_of_a_statement_reparses_the_one_after_it_too():
    """Indenting `if a:` makes it part of `f`, and the indented comment line after it
    (in `g`'s leading lines until then) a line of `f`'s block: `g` is parsed again."""
    text = (
        "def f(a):\n    return a\nif a:\n        pass\n# c\n    # indented\ndef g(a):\n    pass\n"
    )
    reparser = Reparser()
    reparser.parse(text)
    edited = text.replace("\nif a:", "\n    if a:")
    _same(reparser.parse(edited), edited)
