"""Parse a document again after an edit, re-parsing only the top-level statements that
changed (the language server's round trip on every keystroke).

libcst's nodes are immutable, so the statements before and after the edit are reused
as they are, and only the region between them goes through the parser. The result is
the module a full parse gives, checked: the region is widened by one statement on each
side (an edit next to a block can move comment lines in or out of it), the region must
parse on its own with nothing left over, the indentation and newline the module infers
must not change, and the rebuilt module must render to the new text byte for byte.
When any of that fails, the document is parsed whole.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import libcst as cst

from ddpify.carried_positions import CarriedPositions, Relative
from ddpify.codegen import ModuleText
from ddpify.libcst_speed import parse_module
from ddpify.positions import Positions


class Reparser:
    """One document's last parse, and how to get the next one cheaply."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.module: cst.Module | None = None
        self.starts: list[int] = []  # offset of each top-level statement's code (comments first)
        self.first_rows: dict[cst.CSTNode, int] = {}  # each top-level statement -> that row
        self.render = ModuleText()
        self.reused = 0  # statements reused by the last parse (for tests and benchmarks)
        self._positions: CarriedPositions | None = None  # the last lint's positions

    def parse(self, text: str) -> cst.Module:
        """The module of `text`; raises libcst's ParserSyntaxError like `parse_module`."""
        module = None
        if self.module is not None and self.text is not None:
            module = self._incremental(text)
        if module is None:
            self.reused = 0
            self.render = ModuleText()  # forget the old statements
            module = parse_module(text)
        self._remember(text, module)
        return module

    def forget(self) -> None:
        self.__init__()

    def positions(
        self, module: cst.Module, text: str, parents: Mapping[cst.CSTNode, cst.CSTNode]
    ) -> Positions:
        """Positions in the last parse, carried over from the last lint's for the nodes
        of the statements this parse reused (see ddpify/carried_positions.py)."""
        if module is not self.module or text != self.text:
            return Positions(module, text, parents)
        carried: Relative = {}
        last = self._positions
        if last is not None:
            for statement in module.body:
                found = {**last.carried.get(statement, {}), **last.recorded.get(statement, {})}
                if found:
                    carried[statement] = found
        self._positions = CarriedPositions(
            module,
            text,
            parents,
            self.first_rows,
            carried,
            lambda statement: self.render.code_of(module, statement),
        )
        return self._positions

    def _remember(self, text: str, module: cst.Module) -> None:
        self.text, self.module = text, module
        header = "".join(self.render.code_of(module, line) for line in module.header)
        offset, row = len(header), 1 + _line_breaks(header)
        self.starts, self.first_rows = [], {}
        for statement in module.body:
            self.starts.append(offset)
            self.first_rows[statement] = row
            code = self.render.code_of(module, statement)
            offset += len(code)
            row += _line_breaks(code)
        self.render.keep_only(module)

    def _incremental(self, text: str) -> cst.Module | None:
        old, old_text, starts = self.module, self.text, self.starts
        assert old is not None and old_text is not None
        if not old.body or not old.has_trailing_newline:
            return None
        prefix = _common_prefix(old_text, text)
        suffix = _common_suffix(old_text, text, prefix)
        old_end = len(old_text) - suffix  # the edit replaced old_text[prefix:old_end]
        # Statements that end before the edit: all but the last of them are kept.
        ends = starts[1:] + [len(old_text) - self._footer_length(old)]
        first = max(bisect.bisect_right(ends, prefix) - 1, 0)
        # Statements that start after the edit (one it starts at is edited): all but the
        # first of them are kept.
        after = bisect.bisect_right(starts, old_end)
        last = min(after + 1, len(starts))
        inside = self._inside_one(prefix, old_end)
        if inside is not None:
            first, last = inside, inside + 1
        start = starts[first] if first > 0 else 0
        stop_old = starts[last] if last < len(starts) else len(old_text)
        stop_new = stop_old - len(old_text) + len(text)
        if stop_new < start:
            return None
        try:
            region = parse_module(text[start:stop_new])
        except (cst.ParserSyntaxError, RecursionError, ValueError):
            return None
        at_end = last == len(starts)
        if not self._fits(old, region, text[:start], first == 0, at_end):
            return None
        body = list(region.body)
        header = list(old.header)
        if first == 0:
            header = list(region.header)
        elif region.header:
            lines = [*region.header, *body[0].leading_lines]
            body[0] = body[0].with_changes(leading_lines=lines)
        module = old.with_changes(
            header=header,
            body=[*old.body[:first], *body, *old.body[last:]],
            footer=region.footer if at_end else old.footer,
            encoding=region.encoding if first == 0 else old.encoding,
            has_trailing_newline=region.has_trailing_newline if at_end else True,
        )
        if self.render.code(module) != text:
            return None
        self.reused = first + len(old.body) - last
        return module

    def _inside_one(self, prefix: int, old_end: int) -> int | None:
        """The statement an edit lies inside, when it alone needs parsing again: the edit
        leaves its first character (where its code starts, after its leading lines)
        and everything from the next statement's leading lines on, and those lines are
        not indented. Lines move between statements only through indented lines: a
        block's footer takes the lines after it up to the last one indented at its
        level, and its own trailing lines are parsed with it (left over, they land in
        the region's footer, which `_fits` refuses)."""
        old, starts = self.module, self.starts
        assert old is not None
        k = bisect.bisect_right(starts, prefix) - 1
        if k < 0:
            return None
        statement = old.body[k]
        leading = sum(len(self.render.code_of(old, line)) for line in statement.leading_lines)
        if prefix <= starts[k] + leading:
            return None
        if k + 1 < len(starts):
            if old_end > starts[k + 1]:
                return None
            if any(line.whitespace.value for line in old.body[k + 1].leading_lines):
                return None
        return k

    def _footer_length(self, module: cst.Module) -> int:
        return sum(len(self.render.code_of(module, line)) for line in module.footer)

    @staticmethod
    def _fits(old, region, before: str, at_start: bool, at_end: bool) -> bool:
        """Whether the region, parsed alone, is what a whole parse would make of it."""
        if not region.body:
            return False
        if region.footer and not at_end:
            return False  # lines the next statement (or a block) would own
        if region.default_newline != old.default_newline:
            return False
        if region.default_indent != old.default_indent and not _indented(before):
            return False
        return at_start or "\n" in before or "\r" in before


def _line_breaks(code: str) -> int:
    """Line breaks as the parser counts them: \\n, \\r\\n and a lone \\r."""
    return code.count("\n") + code.count("\r") - code.count("\r\n")


def _indented(text: str) -> bool:
    """Whether an indented line comes first in `text`: the module's indentation is that
    line's, whatever the region after it holds."""
    return any(line[:1] in (" ", "\t") and line.strip() for line in text.splitlines())


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    low, high = 0, limit
    while low < high:  # binary search with slice compares: C speed on long documents
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str, prefix: int) -> int:
    limit = min(len(a), len(b)) - prefix
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle :] == b[len(b) - middle :]:
            low = middle
        else:
            high = middle - 1
    return low
