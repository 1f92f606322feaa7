"""Safety gates every rewrite passes before anything is written (migrate and --fix alike).

A failed gate raises GateError naming the pass that produced the bad output; callers
then write nothing and report the error.
"""

from __future__ import annotations

import io
import tokenize
from collections import Counter
from typing import Callable

import libcst as cst

from ddpify.guarded import PARALLEL_CHARS, Beside, python_rejects
from ddpify.libcst_speed import parse_module
from ddpify.split_parse import parse_in_two


class GateError(Exception):
    def __init__(self, pass_name: str, reason: str) -> None:
        super().__init__(f"{pass_name}: {reason}")
        self.pass_name = pass_name
        self.reason = reason

    def __reduce__(self):  # crosses back from an isolated child (guarded.py)
        return (GateError, (self.pass_name, self.reason))


def check_roundtrip(text: str, render: Callable[[cst.Module], str] | None = None) -> cst.Module:
    """The input must be Python that CPython compiles, and come back from libcst byte for
    byte, or we must not touch it. `render` renders the module (default `Module.code`)."""
    module = parse_input(text)
    require_roundtrip(module.code if render is None else render(module), text)
    return module


def require_roundtrip(code: str, text: str) -> None:
    """`code`, the parse of `text` rendered, must be `text` byte for byte."""
    if code != text:
        raise GateError("parse", "input does not round-trip through libcst unchanged")


def parse_input(text: str, compiled: bool = True) -> cst.Module:
    """The first half of `check_roundtrip`: the parse of a text CPython compiles. A large
    text is parsed in two parts at once (split_parse.py), and compiled in a forked child
    meanwhile; `compiled=False`: the caller has the compile checked later
    (`compile_verdict`, `require_compiles`), save for a text libcst rejects, whose error
    is CPython's when CPython rejects it too."""
    large = len(text) >= PARALLEL_CHARS
    compiling = Beside(compile_verdict, text) if large and compiled else None
    if compiled and not large:
        require_compiles(compile_verdict(text))
    try:
        module = parse_in_two(text) if large else parse_module(text)
        if compiling is not None:
            require_compiles(compiling.result())
    except cst.ParserSyntaxError as exc:
        # CPython's message first, as for a small text
        require_compiles(compiling.result() if compiling is not None else compile_verdict(text))
        raise GateError("parse", f"input does not parse: {exc.message}") from None
    finally:
        if compiling is not None:
            compiling.close()
    return module


def compile_verdict(text: str) -> SyntaxError | None:
    return python_rejects(text, "<input>", whole=True)


def require_compiles(error: SyntaxError | None) -> None:
    if error is not None:
        where = f" (line {error.lineno})" if error.lineno else ""
        raise GateError("parse", f"input does not parse: {error.msg}{where}")


def check_compiles(
    text: str,
    pass_name: str,
    filename: str = "<output>",
    parse: Callable[[str], cst.Module] = parse_module,
    compiled: bool = False,
) -> cst.Module:
    """The output must parse (libcst) and compile (CPython); returns the parsed module, so
    that later gates (idempotency, check) need not parse it again. `parse` parses the
    text as `cst.parse_module` does (migrate re-parses only what the passes changed);
    `compiled`: the caller has compiled it already."""
    try:
        module = parse(text)
        if not compiled:
            compile(text, filename, "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError, ValueError) as exc:
        raise GateError(pass_name, f"output does not compile: {exc}") from None
    return module


def comments(text: str) -> Counter[str]:
    """Every comment of `text`, as written (trailing spaces aside), with its count."""
    found: Counter[str] = Counter()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                found[token.string.rstrip()] += 1
    except (tokenize.TokenError, SyntaxError):
        pass  # only text that compiled reaches the gates
    return found


def check_comments_kept(before: str, after: str, pass_name: str) -> None:
    """A rewrite may move or add comments, never drop one."""
    lost = comments(before) - comments(after)
    if lost:
        shown = ", ".join(repr(comment) for comment in list(lost)[:3])
        raise GateError(pass_name, f"would drop {sum(lost.values())} comment(s): {shown}")


def check_idempotent(transform: Callable[[str], str], output: str, pass_name: str) -> None:
    """Running the rewrite again on its own output must change nothing."""
    again = transform(output)
    if again != output:
        raise GateError(pass_name, "not idempotent: a second run changes the output again")
