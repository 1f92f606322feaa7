"""A large module parsed in two parts at once: its tail in a forked child, its head here.

libcst parses 100k lines in about ten seconds on one core. The text is cut between a
line of code and a top-level statement that only blank lines separate from it; the
child parses the tail and sends it pickled, this process parses the head, and the two
bodies are joined.

Why the joined module is the one a whole parse makes: a top-level statement parses the
same alone as in its module (its tokens, its indentation), given the module's
indentation and newline. The blank lines before it are the statement's `leading_lines`
in a whole parse and the tail's `header` in a parse of the tail: they are moved back.
Comments there are not (a whole parse may give them to the block above), so the cut is
never made after one. The parts are joined only when the head has no footer and both
found the same indentation and newline. Anything else, a cut that does not parse alone
included, parses the whole text here, as `parse_module` does. Migrate also checks that
the module renders back to the text byte for byte (its round-trip gate).
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import io
import pickle
import re

import libcst as cst
from libcst._nodes.base import CSTNode

from ddpify.guarded import Beside, can_fork
from ddpify.libcst_speed import field_names, parse_module

# The share of the text parsed here: the child also pickles its part (about half a
# parse's cost) and this process unpickles it (about a quarter).
HEAD_SHARE = 0.6

# A line that can begin a top-level statement of its own: not indented, not a comment,
# not a clause of the compound statement above it, not a closing bracket or a string.
_STATEMENT_START = re.compile(r"(?!(?:else|elif|except|finally|case)\b)[A-Za-z_]")


def parse_in_two(text: str) -> cst.Module:
    """`parse_module(text)`, the tail parsed in a forked child; raises what it raises."""
    cut = statement_cut(text, int(len(text) * HEAD_SHARE)) if can_fork() else None
    if cut is None:
        return parse_module(text)
    parsing = Beside(_pickled_parse, text[cut:])
    try:
        head = parse_module(text[:cut])
        tail = pickle.loads(parsing.result())
    except Exception:  # noqa: BLE001 - the cut did not parse alone: parse it whole
        return parse_module(text)
    finally:
        parsing.close()
    return joined(head, tail) or parse_module(text)


def statement_cut(text: str, near: int) -> int | None:
    """Where to cut `text`, at or after `near`: right after a line of code (not a comment,
    a decorator or a line continued with a backslash) that only blank lines separate
    from a line that can begin a top-level statement; None when there is no such place."""
    newline = text.find("\n", near)
    while 0 <= newline < len(text) - 1:
        start = newline + 1
        if _STATEMENT_START.match(text, start):
            cut = _after_code_line(text, start)
            if cut is not None and cut >= near:
                return cut
        newline = text.find("\n", start)
    return None


def _after_code_line(text: str, start: int) -> int | None:
    """The end of the last line before `start` that is not blank, when it is code."""
    end = start
    while end > 0:
        line_start = text.rfind("\n", 0, end - 1) + 1
        line = text[line_start:end].rstrip("\r\n")
        if line.strip():
            if line.lstrip().startswith(("#", "@")) or line.endswith("\\"):
                return None
            return end
        end = line_start
    return None


def joined(head: cst.Module, tail: cst.Module) -> cst.Module | None:
    """The module of `head`'s text followed by `tail`'s, or None when the two parts were
    not parsed alike (see the module's docstring). The blank lines that begin the tail
    are its header in a parse of the tail, and its first statement's in a whole parse."""
    if (
        head.footer
        or not head.has_trailing_newline
        or any(line.comment is not None for line in tail.header)
        or (head.default_indent, head.default_newline)
        != (tail.default_indent, tail.default_newline)
    ):
        return None
    body = list(tail.body)
    if tail.header:
        first = body[0]
        body[0] = first.with_changes(leading_lines=[*tail.header, *first.leading_lines])
    return head.with_changes(
        body=[*head.body, *body],
        footer=tail.footer,
        has_trailing_newline=tail.has_trailing_newline,
    )


def _pickled_parse(text: str) -> bytes:
    """The parse of `text`, pickled with a reducer per node class (libcst's own
    `__getstate__` asks `dataclasses.fields` for every node: twice as slow)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _reducers()
    pickler.dump(parse_module(text))
    return buffer.getvalue()


@functools.cache
def _reducers() -> dict[type, object]:
    """A reducer for each node class: a new object, then libcst's `__setstate__` with
    its fields (what its own `__getstate__` gives, read without `dataclasses.fields`)."""
    reducers: dict[type, object] = {}
    pending = list(CSTNode.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if dataclasses.is_dataclass(cls):
            reducers[cls] = functools.partial(_reduce, cls, field_names(cls))
    return reducers


def _reduce(cls: type, names: tuple[str, ...], node: CSTNode):
    return copyreg.__newobj__, (cls,), {name: getattr(node, name) for name in names}
