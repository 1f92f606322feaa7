"""Adding and replacing call arguments without disturbing the call's layout."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import find_arg


def keyword(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
    )


def append_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """Add `arg` last; a multi-line call keeps one argument per line and its trailing comma."""
    args = list(call.args)
    if not args:
        return call.with_changes(args=[arg])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):
        between = (
            args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else None
        )
        if between is None:
            between = cst.Comma(whitespace_after=_as_whitespace(call.whitespace_before_args))
        args[-1] = last.with_changes(comma=between)
        args.append(arg.with_changes(comma=last.comma))
    elif isinstance(last.whitespace_after_arg, cst.ParenthesizedWhitespace):
        # The closing parenthesis on a line of its own: the new argument goes on a line of
        # its own too, before that line break, like the arguments above it.
        between = (
            args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else None
        )
        if between is None:
            between = cst.Comma(whitespace_after=_as_whitespace(call.whitespace_before_args))
        args[-1] = last.with_changes(comma=between, whitespace_after_arg=cst.SimpleWhitespace(""))
        args.append(arg.with_changes(whitespace_after_arg=last.whitespace_after_arg))
    else:
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(arg)
    return call.with_changes(args=args)


def _as_whitespace(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    if isinstance(ws, cst.SimpleWhitespace) and not ws.value:
        return cst.SimpleWhitespace(" ")
    return ws


def replace_arg(call: cst.Call, old: cst.Arg, new: cst.Arg) -> cst.Call:
    """Put `new` where `old` was, with `old`'s comma and surrounding whitespace."""
    args = [new.with_changes(comma=a.comma) if a is old else a for a in call.args]
    return call.with_changes(args=args)


def replace_keyword(
    call: cst.Call, name: str, new: cst.Arg, position: int | None = None
) -> cst.Call:
    """Replace the argument `name` (or the positional one at `position`) if present, else add."""
    found = find_arg(call, name, position)
    if found is None:
        return append_arg(call, new)
    return replace_arg(call, found, new)


def remove_arg(call: cst.Call, old: cst.Arg) -> cst.Call:
    args = list(call.args)
    index = args.index(old)
    del args[index]
    if args and index == len(args):  # removed the last one: the new last takes its comma
        args[-1] = args[-1].with_changes(comma=old.comma)
    return call.with_changes(args=args)


def parenthesize(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` safe as the left operand of `*` or `//`."""
    if (
        isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float))
        or expr.lpar
    ):
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
