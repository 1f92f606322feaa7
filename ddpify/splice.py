"""The parse of a rewritten module's text, re-parsing only the statements the rewrite
changed, down to the statements inside functions, classes and blocks.

A migration rewrites a statement or two in many functions, so re-parsing whole top-level
statements (what reparse.py does for one edit) costs nearly a full parse. Here the
input's parse and the rewritten module are walked side by side, block by block:

* a statement the rewrite left alone (the same object: libcst nodes are immutable) is
  reused when its neighbours on both sides are the input's neighbours too, so the lines
  around it (comments, blank lines) divide between it and them as they did;
* a compound statement the rewrite rebuilt (a function whose body changed) keeps its
  header when the header is unchanged, or has its header parsed alone (with `pass` for
  a body), and its block is spliced in turn;
* every other run of statements is rendered and parsed in a scaffold that rebuilds its
  context: a first block that fixes the module's indentation, one `if 1:` per enclosing
  block at the enclosing indentation, then the run, then the lines that follow it up to
  the next statement kept, whose place a `pass` takes. The parse must put those lines
  where the kept statement has them, and leave nothing in the scaffold's own blocks.

When any condition fails the caller parses the text whole. The caller checks that the
spliced module renders to the text; tests check that it equals a full parse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import libcst as cst

from ddpify.codegen import node_code
from ddpify.libcst_speed import parse_module

# Compound statements whose blocks are spliced: the body, and those of the clauses that
# follow it (`elif`, `else`, `except`, `finally`).
_DESCENDED = (cst.FunctionDef, cst.ClassDef, cst.If, cst.For, cst.While, cst.With, cst.Try)
# The fields that link a statement to its clauses: not part of its header.
_CLAUSE_FIELDS = ("body", "orelse", "handlers", "finalbody")
_PASS = cst.SimpleStatementLine([cst.Pass()])


class _NoSplice(Exception):
    """The splice cannot vouch for a piece: parse it whole (or the module, at the top)."""


@dataclasses.dataclass(frozen=True)
class _Style:
    indent: str  # the module's default indentation, as the parser infers it from the text
    newline: str


@dataclasses.dataclass(frozen=True)
class _Next:
    """What follows a block: the next statement at `indents` and its leading lines."""

    indents: tuple[str, ...]
    leading: Sequence[cst.EmptyLine]


def splice_parse(old: cst.Module, new: cst.Module, text: str) -> cst.Module | None:
    """The module `cst.parse_module(text)` gives, where `old` is the parse of a text that
    a rewrite turned into `new`, whose code is `text`. None when the splice cannot
    vouch for some piece (parse the text whole then)."""
    if not new.body or not old.body:
        return None
    if not new.has_trailing_newline and not old.has_trailing_newline:
        # The parser reads a text without its last line break as the text with one,
        # and says so in this flag.
        unended = splice_parse(
            old.with_changes(has_trailing_newline=True),
            new.with_changes(has_trailing_newline=True),
            text + _first_newline(text),
        )
        return None if unended is None else unended.with_changes(has_trailing_newline=False)
    if not (new.has_trailing_newline and old.has_trailing_newline):
        return None
    style = _Style(_first_indent(new), _first_newline(text))
    if (style.indent, style.newline) != (old.default_indent, old.default_newline):
        return None  # every reused block's indentation and newline are relative to these
    try:
        return _splice_module(old, new, style)
    except (_NoSplice, cst.ParserSyntaxError, RecursionError):
        return None


def _splice_module(old: cst.Module, new: cst.Module, style: _Style) -> cst.Module:
    body, regions = _spliced_body(new, old, (), style, None)
    header, footer, encoding = old.header, old.footer, old.encoding
    if not regions or regions[0].start != 0:
        _require_same(new.header, old.header)
    if not regions or regions[-1].stop != len(new.body):
        _require_same(new.footer, old.footer)
    for region in regions:
        if region.start == 0:
            header, encoding = region.module.header, region.module.encoding
        if region.stop == len(new.body):
            footer = region.module.footer
    return old.with_changes(header=header, body=body, footer=footer, encoding=encoding)


@dataclasses.dataclass(frozen=True)
class _Region:
    start: int
    stop: int
    module: cst.Module  # the scaffold it was parsed in
    footer: Sequence[cst.EmptyLine]  # the footer of its block, for a region at its end


def _spliced_body(
    owner, old_owner, indents: tuple[str, ...], style: _Style, after: _Next | None
) -> tuple[list[cst.BaseStatement], list[_Region]]:
    """The statements of a block (or module) `owner` as the parser makes them, and the
    regions parsed, in order. `old_owner`: the block it was before the rewrite; `after`:
    what follows the block (None: nothing that can be told)."""
    new, old = owner.body, old_owner.body
    place = _places(new, old)
    out: list[cst.BaseStatement | None] = [None] * len(new)
    for index, statement in enumerate(new):
        j = place[index]
        if j is None or not (_closed(statement) or _aligned_after(place, index, len(old))):
            continue
        if index == 0 and j != 0:
            continue  # now first: the module's header may take its leading lines

        if statement is old[j]:
            out[index] = statement
            continue
        following = _Next(indents, new[index + 1].leading_lines) if index + 1 < len(new) else None
        try:
            out[index] = _descend(statement, old[j], indents, style, following)
        except _NoSplice:
            pass
    regions = []
    for start, stop in _runs(out):  # last first: a replacement keeps the earlier indices
        statements, region = _parse_region(owner, start, stop, indents, style, after)
        out[start:stop] = statements
        regions.append(region)
    return out, regions[::-1]  # type: ignore[return-value]


def _places(new, old) -> list[int | None]:
    """For each new statement, the index of the old statement it stands for: the same
    object, or the next one after its predecessor's, when it is a rebuilt compound
    statement of the same kind with the same leading lines."""
    index = {id(statement): j for j, statement in enumerate(old)}
    place: list[int | None] = []
    for i, statement in enumerate(new):
        j = index.get(id(statement))
        if j is None:
            expected = 0 if i == 0 else (place[-1] + 1 if place[-1] is not None else None)
            if expected is not None and expected < len(old) and _rebuilt(statement, old[expected]):
                j = expected
        place.append(j)
    return place


def _closed(statement: cst.BaseStatement) -> bool:
    """A simple statement line ends with its own line: the lines after it are the next
    statement's whatever that is (a compound statement's block might keep some)."""
    return isinstance(statement, cst.SimpleStatementLine)


def _aligned_after(place: list[int | None], i: int, old_length: int) -> bool:
    """Whether what follows the statement is what followed it before: its old next
    statement, or the end of the block for both. (What precedes it needs no check but
    at the start of a block: a statement before it that is reused is closed or aligned,
    and one that is parsed again is parsed with this statement's leading lines after
    it, see _parse_region.)"""
    j = place[i]
    assert j is not None
    if i == len(place) - 1:
        return j == old_length - 1
    return place[i + 1] == j + 1


def _rebuilt(new: cst.BaseStatement, old: cst.BaseStatement) -> bool:
    if type(new) is not type(old) or not isinstance(new, _DESCENDED):
        return False
    chain, old_chain = _clauses(new), _clauses(old)
    return (
        chain is not None
        and old_chain is not None
        and [type(c) for c in chain] == [type(c) for c in old_chain]
        and all(
            c.body.indent == o.body.indent and _same(c.body.header, o.body.header)
            for c, o in zip(chain, old_chain)
        )
        and _same(new.leading_lines, old.leading_lines)
    )


def _clauses(statement) -> list | None:
    """The statement, then each clause that follows its body (`elif` as the `If` it is,
    `else`, each `except`, `finally`), in the order of the text; None when a block is not
    an indented one (`else: pass` on one line)."""
    chain = [statement]
    if isinstance(statement, cst.Try):
        chain += list(statement.handlers)
        chain += [c for c in (statement.orelse, statement.finalbody) if c is not None]
    else:
        clause = getattr(statement, "orelse", None)
        while clause is not None:
            chain.append(clause)
            clause = clause.orelse if isinstance(clause, cst.If) else None
    if not all(isinstance(c.body, cst.IndentedBlock) for c in chain):
        return None
    return chain


def _descend(new, old, indents: tuple[str, ...], style: _Style, following: _Next | None):
    """A rebuilt compound statement as the parser makes it: its header, then each block
    (its body, then its clauses') spliced statement by statement. A block that a clause
    follows is spliced with the clause's leading lines where its end is checked."""
    chain, old_chain = _clauses(new), _clauses(old)
    assert chain is not None and old_chain is not None  # _rebuilt said so
    blocks = []
    for index, (clause, old_clause) in enumerate(zip(chain, old_chain)):
        if index + 1 < len(chain):
            after = _Next(indents, chain[index + 1].leading_lines)
        else:
            after = following
        if index > 0 and not _same_header(clause, old_clause):
            raise _NoSplice  # a clause's header cannot be parsed alone
        if clause.body is old_clause.body:
            blocks.append(old_clause.body)  # its text and what follows it are unchanged
            continue
        blocks.append(_spliced_block(clause.body, old_clause.body, indents, style, after))
    if _same_header(new, old):
        shell = old
    elif len(chain) == 1:
        shell = _parse_header(new, indents, style)
    else:
        raise _NoSplice
    return _relinked(shell, old_chain, blocks)


def _spliced_block(block, old_block, indents, style: _Style, after: _Next | None):
    inner = (*indents, style.indent if block.indent is None else block.indent)
    body, regions = _spliced_body(block, old_block, inner, style, after)
    if regions and regions[-1].stop == len(block.body):
        footer = regions[-1].footer
    else:
        _require_same(block.footer, old_block.footer)
        footer = old_block.footer
    return old_block.with_changes(body=body, footer=footer)


def _relinked(shell, old_chain: list, blocks: list):
    """`shell` (the statement as the parser makes its header) with the spliced blocks in
    the clauses of `old_chain` (the old statement's, whose headers are the new ones)."""
    clauses = [
        c if c.body is b else c.with_changes(body=b) for c, b in zip(old_chain[1:], blocks[1:])
    ]
    head = shell.with_changes(body=blocks[0])
    if isinstance(shell, cst.Try):
        handlers = clauses[: len(shell.handlers)]
        rest = clauses[len(shell.handlers) :]
        orelse = rest.pop(0) if shell.orelse is not None else None
        finalbody = rest.pop(0) if shell.finalbody is not None else None
        return head.with_changes(handlers=handlers, orelse=orelse, finalbody=finalbody)
    for index in range(len(clauses) - 2, -1, -1):  # an elif chain: from its end
        if clauses[index].orelse is not clauses[index + 1]:
            clauses[index] = clauses[index].with_changes(orelse=clauses[index + 1])
    return head.with_changes(orelse=clauses[0]) if clauses else head


def _same_header(new, old) -> bool:
    return all(
        _same(getattr(new, field.name), getattr(old, field.name))
        for field in dataclasses.fields(new)
        if field.name not in _CLAUSE_FIELDS
    )


def _parse_header(new, indents: tuple[str, ...], style: _Style):
    """The compound statement's header as the parser makes it: the statement with a
    `pass` body, parsed in a scaffold."""
    stub = new.with_changes(body=new.body.with_changes(body=[_PASS], footer=()))
    module = parse_module(_scaffold(indents, style) + _code(stub, indents, style))
    _require_style(module, style)
    body = _scaffold_body(module, True, len(indents))
    if len(body) != 1 or type(body[0]) is not type(new) or module.footer:
        raise _NoSplice
    return body[0]


def _parse_region(owner, start: int, stop: int, indents, style: _Style, after: _Next | None):
    """Statements start..stop of `owner`'s body parsed in a scaffold, checked: the
    scaffold holds them and the sentinel `pass` alone, the sentinel has the lines the
    kept statement after them has, and no scaffold block kept a line of the text. At
    the top, a region at the start is parsed after the module's header (the text's own
    beginning, no scaffold), and one at the end with the module's footer."""
    new, depth = owner.body, len(indents)
    at_end = stop == len(new)
    code = "".join(_code(statement, indents, style) for statement in new[start:stop])
    fixer = depth > 0 or start > 0
    prefix = _scaffold(indents, style) if fixer else _lines(owner.header, (), style)
    if at_end and depth == 0:
        module = parse_module(prefix + code + _lines(owner.footer, (), style))
        _require_style(module, style)
        return _nonempty(_scaffold_body(module, fixer, 0)), _Region(start, stop, module, ())
    if at_end:
        if after is None:
            raise _NoSplice
        # The block's footer, then what follows the block one level up.
        sentinel = after
        tail = _lines(owner.footer, indents, style)
    else:
        sentinel = _Next(indents, new[stop].leading_lines)
        tail = ""
    tail += _lines(sentinel.leading, sentinel.indents, style)
    tail += "".join(sentinel.indents) + "pass" + style.newline
    module = parse_module(prefix + code + tail)
    _require_style(module, style)
    if module.footer:
        raise _NoSplice
    holder = _scaffold_body(module, fixer, len(sentinel.indents))
    if len(holder) < 2 or not holder[-1].deep_equals(
        _PASS.with_changes(leading_lines=sentinel.leading)
    ):
        raise _NoSplice
    if not at_end:
        return _nonempty(holder[:-1]), _Region(start, stop, module, ())
    if len(holder) != 2 or not _is_scaffold(holder[0]):
        raise _NoSplice
    block = holder[0].body
    return _nonempty(block.body), _Region(start, stop, module, block.footer)


def _scaffold_body(module: cst.Module, fixer: bool, depth: int) -> list[cst.BaseStatement]:
    """The body `depth` scaffold blocks down, past the block that fixes the indentation
    (`fixer`); each scaffold block on the way holds one statement and no footer."""
    body = list(module.body)
    if fixer:
        if not body or not _is_scaffold(body[0]) or len(body[0].body.body) != 1:
            raise _NoSplice
        if body[0].body.footer:
            raise _NoSplice
        body = body[1:]
    for _ in range(depth):
        if len(body) != 1 or not _is_scaffold(body[0]) or body[0].body.footer:
            raise _NoSplice
        body = list(body[0].body.body)
    return body


def _is_scaffold(statement) -> bool:
    return (
        isinstance(statement, cst.If)
        and isinstance(statement.test, cst.Integer)
        and statement.test.value == "1"
        and statement.orelse is None
        and isinstance(statement.body, cst.IndentedBlock)
    )


def _nonempty(body: list) -> list:
    if not body:
        raise _NoSplice
    return body


def _require_style(module: cst.Module, style: _Style) -> None:
    if (module.default_indent, module.default_newline) != (style.indent, style.newline):
        raise _NoSplice


def _scaffold(indents: Sequence[str], style: _Style) -> str:
    """A first block that makes the parser infer the module's indentation, then one
    `if 1:` per enclosing block, each at its block's indentation."""
    text = "if 1:" + style.newline + style.indent + "pass" + style.newline
    for level in range(len(indents)):
        text += "".join(indents[:level]) + "if 1:" + style.newline
    return text


def _code(node: cst.CSTNode, indents: Sequence[str], style: _Style) -> str:
    """The node's code at the indentation of a block `indents` deep."""
    return node_code(node, style.indent, style.newline, indents)


def _lines(lines: Sequence[cst.EmptyLine], indents: Sequence[str], style: _Style) -> str:
    return "".join(_code(line, indents, style) for line in lines)


def _require_same(a, b) -> None:
    if not _same(a, b):
        raise _NoSplice


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, cst.CSTNode):
        return isinstance(b, cst.CSTNode) and a.deep_equals(b)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    return type(a) is type(b) and a == b


def same_tree(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """`a.deep_equals(b)` without recursion (input depth must not drive it), skipping the
    subtrees both share: a spliced parse holds the input's statements that a rewrite
    kept, as the rewritten module does, so this costs the statements it parsed again."""
    pending: list[tuple[object, object]] = [(a, b)]
    while pending:
        x, y = pending.pop()
        if x is y:
            continue
        if isinstance(x, cst.CSTNode):
            if type(x) is not type(y):
                return False
            pending.extend((getattr(x, name), getattr(y, name)) for name in _compared(type(x)))
        elif isinstance(x, (list, tuple)):
            if not isinstance(y, (list, tuple)) or len(x) != len(y):
                return False
            pending.extend(zip(x, y))
        elif type(x) is not type(y) or x != y:
            return False
    return True


_COMPARED: dict[type, tuple[str, ...]] = {}


def _compared(kind: type) -> tuple[str, ...]:
    """The fields `deep_equals` compares (not metadata), per node type."""
    names = _COMPARED.get(kind)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(kind) if f.compare)
        _COMPARED[kind] = names
    return names


def _runs(out: list) -> list[tuple[int, int]]:
    """Maximal runs of statements still to parse (None in `out`), last first."""
    runs, start = [], None
    for index, item in enumerate([*out, _PASS]):
        if item is None and start is None:
            start = index
        elif item is not None and start is not None:
            runs.append((start, index))
            start = None
    return runs[::-1]


def _first_indent(module: cst.Module) -> str:
    """The indentation the parser infers from the module's code: its first indented
    block's (libcst's default when it has none)."""
    for statement in module.body:
        body = getattr(statement, "body", None)
        if isinstance(body, cst.IndentedBlock):
            return module.default_indent if body.indent is None else body.indent
        if isinstance(statement, cst.BaseCompoundStatement):
            return ""  # a block in an else branch or a match case first: not worth it
    return module.default_indent


def _first_newline(text: str) -> str:
    for index, char in enumerate(text):
        if char == "\n":
            return "\n"
        if char == "\r":
            return "\r\n" if text[index + 1 : index + 2] == "\n" else "\r"
    return "\n"
