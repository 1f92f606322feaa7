"""Removing and replacing call arguments without moving any other argument's meaning.

Python binds positional arguments by their place: deleting `True` from
`DataLoader(ds, 8, True, sampler)` moves `sampler` into the `shuffle` slot. So every
edit that drops a positional argument, or puts a keyword in its place, rewrites the
positional arguments after it by keyword (when the caller knows the parameter names),
or refuses (returns None). Rules and migrate passes go through these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst


def keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
    )


def _is_positional(arg: cst.Arg) -> bool:
    return arg.keyword is None and not arg.star


def _by_keyword(
    args: list[cst.Arg], start: int, parameters: Sequence[str] | None, first_slot: int
) -> list[cst.Arg] | None:
    """`args[start:]` with every positional argument given by keyword instead; None when
    one of them has no known name or a `*args` could shift the slots."""
    slot = first_slot
    result = list(args[:start])
    for arg in args[start:]:
        if arg.star == "*":
            return None  # its length is unknown: later slots cannot be named
        if _is_positional(arg):
            if parameters is None or slot >= len(parameters):
                return None
            arg = arg.with_changes(
                keyword=cst.Name(parameters[slot]),
                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
            )
            slot += 1
        result.append(arg)
    return result


def _slot(args: list[cst.Arg], index: int) -> int:
    """The positional slot of `args[index]` (its place among the positional arguments)."""
    return sum(1 for arg in args[:index] if _is_positional(arg))


def _has_positional_after(args: list[cst.Arg], index: int) -> bool:
    return any(_is_positional(arg) or arg.star == "*" for arg in args[index + 1 :])


def drop_arg(
    call: cst.Call, removed: cst.Arg, parameters: Sequence[str] | None = None
) -> cst.Call | None:
    """`call` without `removed`. Positional arguments after a removed positional one are
    given by keyword, named from `parameters` (the callee's positional parameter names,
    in order); None when they cannot be named."""
    args = list(call.args)
    index = args.index(removed)
    if _is_positional(removed) and _has_positional_after(args, index):
        renamed = _by_keyword(args, index + 1, parameters, _slot(args, index) + 1)
        if renamed is None:
            return None
        args = renamed
    del args[index]
    if args and index == len(args):  # removed the last one: the new last takes its comma
        args[-1] = args[-1].with_changes(comma=removed.comma)
    return call.with_changes(args=args)


def replace_with_keyword(
    call: cst.Call, old: cst.Arg, new: cst.Arg, parameters: Sequence[str] | None = None
) -> cst.Call | None:
    """Put the keyword argument `new` where `old` was. A keyword may not precede a
    positional argument, so positional arguments after `old` are given by keyword
    (named from `parameters`), or None when they cannot be named."""
    args = list(call.args)
    index = args.index(old)
    if _has_positional_after(args, index):
        renamed = _by_keyword(args, index + 1, parameters, _slot(args, index) + 1)
        if renamed is None:
            return None
        args = renamed
    args[index] = new.with_changes(comma=old.comma)
    return call.with_changes(args=args)


def insert_keyword_after(call: cst.Call, anchor: cst.Arg, new: cst.Arg) -> cst.Call:
    """Insert the keyword argument `new` after `anchor`, or after the last positional
    argument when positional ones follow `anchor` (a keyword may not precede them)."""
    args = list(call.args)
    index = args.index(anchor)
    while index + 1 < len(args) and (
        _is_positional(args[index + 1]) or args[index + 1].star == "*"
    ):
        index += 1
    before = args[index]
    if before.comma is cst.MaybeSentinel.DEFAULT:  # the last argument, no trailing comma
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return call.with_changes(
            args=[*args[:index], before.with_changes(comma=comma), new, *args[index + 1 :]]
        )
    return call.with_changes(
        args=[*args[: index + 1], new.with_changes(comma=before.comma), *args[index + 1 :]]
    )
