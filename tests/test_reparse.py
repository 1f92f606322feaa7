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
    assert reparser.reused >= statements - 3
    # The statements away from the edit are the very same objects (the one on each side
    # of the edited function is parsed again: an edit can move comment lines across).
    assert all(new is old for new, old in zip(module.body[:-3], first.body[:-3]))


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
