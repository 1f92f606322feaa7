"""A large module parsed in two parts at once (ddpify/split_parse.py) is the module libcst
parses from the whole text: node for node, at every place the cut may fall in the
fixtures, with blank lines, comments, decorators, tabs and CRLF around the cut; a cut
that does not parse alone falls back to the whole parse, errors included."""

from __future__ import annotations

import os

import libcst as cst
import pytest

from ddpify import split_parse
from tests.helpers import FIXTURES

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

PARTS = """\
import torch


def first(x):
    return x + 1
# a comment the block above may own

def second(x):
    if x:
        return x

    return 0
@torch.no_grad()
def third(x):
    return x * 2
total = first(1) + \\
    second(2)
LIMIT = 3


class Model(torch.nn.Module):
    pass
try:
    LIMIT = 4
except ValueError:
    pass
else:
    LIMIT = 5
TEXT = '''
inside = "a string"
'''
last = 1
"""


def _every_cut(text: str):
    near = 0
    while (cut := split_parse.statement_cut(text, near)) is not None:
        yield cut
        near = cut + 1


def _joined_at(text: str, cut: int) -> cst.Module | None:
    try:
        head, tail = cst.parse_module(text[:cut]), cst.parse_module(text[cut:])
    except cst.ParserSyntaxError:
        return None
    return split_parse.joined(head, tail)


def test_the_cuts_fall_after_code_before_a_top_level_statement():
    starts = [next(ln for ln in PARTS[cut:].split("\n") if ln.strip()) for cut in _every_cut(PARTS)]
    assert starts == [
        "def first(x):",
        "total = first(1) + \\",
        "LIMIT = 3",
        "class Model(torch.nn.Module):",
        "try:",
        "TEXT = '''",
        'inside = "a string"',  # inside a string: the head does not parse alone
        "last = 1",
    ]


@pytest.mark.parametrize("variant", ["as written", "tabs", "CRLF", "spaces on blank lines"])
def test_every_cut_joins_into_the_whole_parse(variant):
    text = PARTS
    if variant == "tabs":
        text = text.replace("    ", "\t")
    elif variant == "CRLF":
        text = text.replace("\n", "\r\n")
    elif variant == "spaces on blank lines":
        text = text.replace("\n\n", "\n  \n")
    whole = cst.parse_module(text)
    joined = [_joined_at(text, cut) for cut in _every_cut(text)]
    # With tabs a tail without a block of its own finds libcst's default indentation.
    assert sum(module is not None for module in joined) >= (3 if variant == "tabs" else 6)
    for module in joined:
        assert module is None or module.deep_equals(whole)


def test_every_cut_of_every_fixture_joins_into_the_whole_parse():
    compared = 0
    for path in sorted(FIXTURES.rglob("*.py"))[::7]:  # a seventh of them: each cut parses
        text = path.read_text()
        try:
            whole = cst.parse_module(text)
        except cst.ParserSyntaxError:
            continue
        for cut in _every_cut(text):
            module = _joined_at(text, cut)
            if module is not None:
                assert module.deep_equals(whole), (path, text[cut : cut + 40])
                compared += 1
    assert compared > 100


def test_parts_that_found_another_indentation_are_not_joined():
    text = "def f():\n\treturn 1\nx = 1\n\n\ndef g():\n    return 2\n"
    cut = split_parse.statement_cut(text, text.index("x = 1") + 1)
    head, tail = cst.parse_module(text[:cut]), cst.parse_module(text[cut:])
    assert head.default_indent != tail.default_indent
    assert split_parse.joined(head, tail) is None


@needs_fork
@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])
def test_parse_in_two_is_the_whole_parse(share, monkeypatch):
    monkeypatch.setattr(split_parse, "HEAD_SHARE", share)
    text = (FIXTURES / "migrate" / "single_main_argparse" / "before.py").read_text()
    assert split_parse.statement_cut(text, int(len(text) * share)) is not None
    assert split_parse.parse_in_two(text).deep_equals(cst.parse_module(text))


@needs_fork
def test_a_cut_that_does_not_parse_alone_falls_back_to_the_whole_parse(monkeypatch):
    # The only cut after the middle is inside the string: neither part parses alone.
    text = "x = 1\nTEXT = '''\n\nvalue = 2\n'''\n"
    monkeypatch.setattr(split_parse, "HEAD_SHARE", 0.5)
    assert split_parse.statement_cut(text, len(text) // 2) == text.index("\n\nvalue") + 1
    assert split_parse.parse_in_two(text).deep_equals(cst.parse_module(text))


@needs_fork
def test_a_text_that_does_not_parse_raises_libcsts_error(monkeypatch):
    monkeypatch.setattr(split_parse, "HEAD_SHARE", 0.5)
    text = "x = 1\n\ny = (\n\nz = 3\n"
    with pytest.raises(cst.ParserSyntaxError) as whole:
        cst.parse_module(text)
    with pytest.raises(cst.ParserSyntaxError) as in_two:
        split_parse.parse_in_two(text)
    assert str(in_two.value) == str(whole.value)
