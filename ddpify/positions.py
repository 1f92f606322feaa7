"""Line and column of the nodes that get a finding, without a whole-module position pass.

libcst's PositionProvider regenerates the code of the whole module, tracking every token:
it costs more than parsing the file, while a file has a handful of findings. Here a
node's position comes from rendering only the statement line that holds it (for a node
in the header of a block statement, `for ... :` or `def ...:`, the header alone), placed
at the line that CPython's own parser (`ast`, written in C: about a tenth of libcst's
parse time) gives that statement. Each rendering must reproduce the source text at that
line, or the whole-module pass answers instead: positions are always the ones
PositionProvider gives.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Mapping

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

try:
    from libcst.metadata import CodePosition
    from libcst.metadata.position_provider import PositionProvidingCodegenState
except ImportError:  # pragma: no cover - libcst internals moved: every lookup falls back
    PositionProvidingCodegenState = None  # type: ignore[assignment,misc]

from ddpify.walk import children

_NEWLINE = re.compile(r"\r\n?|\n")  # what libcst and CPython count as a line break

# Block statements whose header can be rendered alone, with an empty body.
_HEADER_ONLY = (cst.For, cst.While, cst.If, cst.With, cst.FunctionDef, cst.ClassDef)
# Nodes between a block statement and the statements of its blocks.
_CLAUSES = (
    cst.IndentedBlock,
    cst.SimpleStatementSuite,
    cst.SimpleStatementLine,
    cst.Else,
    cst.Finally,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.MatchCase,
)


def whole_module(module: cst.Module) -> dict[cst.CSTNode, CodeRange]:
    """PositionProvider's result for every node. Called directly: MetadataWrapper first
    walks the whole tree for batchable providers, of which there are none here."""
    provider = PositionProvider()
    try:
        provider._gen_impl(module)
        return provider._computed
    except AttributeError:  # libcst internals moved: take the public road
        return dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))


class _Sink:
    """What a codegen state records positions into (a provider's `_computed`)."""

    def __init__(self) -> None:
        self._computed: dict[cst.CSTNode, CodeRange] = {}


class Positions(Mapping):
    """`positions[node]` -> CodeRange, computed on first use for the statement holding it.

    `parents` maps each node to its parent, as far as the lint walk went; a node outside
    it (or any doubt on the way) falls back to the whole-module pass, computed once.
    """

    def __init__(
        self, module: cst.Module, text: str, parents: Mapping[cst.CSTNode, cst.CSTNode]
    ) -> None:
        self.module = module
        self.text = text
        self.parents = parents
        self._found: dict[cst.CSTNode, CodeRange] = {}
        self._starts: dict[cst.CSTNode, CodePosition] = {}  # block statements' headers
        self._whole: dict[cst.CSTNode, CodeRange] | None = None
        self._rows: list[int] | None = None  # offset where each row starts
        self._ast_rows: list[int] | None = None  # first row of each statement, source order
        self._order: dict[cst.CSTNode, int] | None = None  # statement -> its index there

    # -- Mapping -------------------------------------------------------------------------

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        found = self._found.get(node)
        if found is None:
            if self._whole is None:
                self._locate(node, header_start=False)
            found = self._found.get(node)
            if found is None:
                found = self._whole_module()[node]
        return found

    def __iter__(self):  # the whole-module answer: only for callers that want them all
        return iter(self._whole_module())

    def __len__(self) -> int:
        return len(self._whole_module())

    def start(self, node: cst.CSTNode) -> CodePosition:
        """Where `node` starts; for a block statement, without rendering its body."""
        if node in self._starts:
            return self._starts[node]
        if node not in self._found and self._whole is None:
            self._locate(node, header_start=True)
            if node in self._starts:
                return self._starts[node]
        return self[node].start

    # -- locating ------------------------------------------------------------------------

    def _whole_module(self) -> dict[cst.CSTNode, CodeRange]:
        if self._whole is None:
            self._whole = whole_module(self.module)
            self._found = self._whole
        return self._whole

    def _chain(self, node: cst.CSTNode) -> list[cst.CSTNode] | None:
        """`node` and its ancestors up to the module, or None if the walk never saw it."""
        chain = [node]
        while node is not self.module:
            node = self.parents.get(node)  # type: ignore[assignment]
            if node is None:
                return None
            chain.append(node)
        return chain

    def _locate(self, node: cst.CSTNode, header_start: bool) -> None:
        chain = self._chain(node) if PositionProvidingCodegenState is not None else None
        if chain is None or len(chain) < 2:
            self._whole_module()
            return
        # The innermost statement line holding `node`: a child of the module or of a block.
        for depth in range(len(chain) - 1):
            if type(chain[depth + 1]) in (cst.Module, cst.IndentedBlock):
                break
        statement, inner = chain[depth], (chain[depth - 1] if depth else None)
        in_header = header_start if inner is None else _in_header(statement, inner)
        header = (
            in_header
            and isinstance(statement, _HEADER_ONLY)
            and isinstance(statement.body, cst.IndentedBlock)
        )
        if not self._render(statement, chain[depth + 1 :], header):
            self._whole_module()

    def _render(self, statement: cst.BaseStatement, above: list[cst.CSTNode], header: bool) -> bool:
        """Render `statement` (or its header), place it, check it against the text."""
        indents = self._indents(above)
        target = _header_copy(statement) if header else statement
        sink = _Sink()
        state = PositionProvidingCodegenState(
            default_indent=self.module.default_indent,
            default_newline=self.module.default_newline,
            provider=sink,
            indent_tokens=list(indents),
        )
        target._codegen(state)
        code = "".join(state.tokens)
        if header:
            block_indent = statement.body.indent  # type: ignore[attr-defined]
            body = "".join(
                indents
                + [self.module.default_indent if block_indent is None else block_indent]
                + ["pass", self.module.default_newline]
            )
            if not code.endswith(body):
                return False
            code = code[: -len(body)]
        row = self._statement_row(statement)
        if row is None:
            return False
        shift = row - sink._computed[target].start.line
        rows = self._row_offsets()
        if not 0 <= shift < len(rows) or not _matches(self.text, rows[shift], code):
            return False
        for node, span in sink._computed.items():
            moved = CodeRange(
                CodePosition(span.start.line + shift, span.start.column),
                CodePosition(span.end.line + shift, span.end.column),
            )
            if node is target and header:
                self._starts[statement] = moved.start
            elif not header or node is not target.body:  # type: ignore[attr-defined]
                self._found[node] = moved
        return True

    def _indents(self, above: list[cst.CSTNode]) -> list[str]:
        """The indentation the blocks around a statement add, outermost first."""
        default = self.module.default_indent
        indents = []
        for node in reversed(above):
            if isinstance(node, (cst.IndentedBlock, cst.Match)):
                indents.append(default if node.indent is None else node.indent)
        return indents

    def _statement_row(self, statement: cst.BaseStatement) -> int | None:
        """The row CPython gives the statement's first token (past decorators, comments)."""
        if self._ast_rows is None:
            self._ast_rows = ast_statement_rows(self.text)
            self._order = statement_order(self.module)
            if self._ast_rows is None or len(self._ast_rows) != len(self._order):
                self._ast_rows = []
                return None
        first = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else statement
        index = self._order.get(first)  # type: ignore[union-attr]
        return None if index is None or index >= len(self._ast_rows) else self._ast_rows[index]

    def _row_offsets(self) -> list[int]:
        """`rows[n]` is the offset in the text where row n + 1 starts."""
        if self._rows is None:
            self._rows = [0] + [m.end() for m in _NEWLINE.finditer(self.text)]
        return self._rows


def _in_header(statement: cst.BaseCompoundStatement, inner: cst.CSTNode) -> bool:
    """`inner` (a child of `statement`) is in the header, not in a block or an else."""
    return inner is not statement.body and inner is not getattr(statement, "orelse", None)


def _header_copy(statement: cst.BaseCompoundStatement) -> cst.BaseCompoundStatement:
    """The statement with an empty body and no else: renders as its header + `pass`."""
    body = statement.body
    empty = cst.IndentedBlock(body=(), header=body.header, indent=body.indent)  # type: ignore[attr-defined]
    changes: dict[str, object] = {"body": empty}
    if getattr(statement, "orelse", None) is not None:
        changes["orelse"] = None
    return statement.with_changes(**changes)


def _matches(text: str, offset: int, code: str) -> bool:
    """`code` is the text at `offset` (the last line may lack its newline at the end)."""
    if text.startswith(code, offset):
        return True
    newline = _NEWLINE.search(code[-2:])
    if newline is None or code[len(code) - 2 + newline.end() :]:
        return False
    stripped = code[: len(code) - 2 + newline.start()]
    return offset + len(stripped) == len(text) and text.startswith(stripped, offset)


def statement_order(module: cst.Module) -> dict[cst.CSTNode, int]:
    """Every small and block statement, numbered in source order as CPython's ast lists
    them (a line `a = 1; b = 2` is two statements)."""
    order: dict[cst.CSTNode, int] = {}

    def visit(node: cst.CSTNode) -> None:
        for child in children(node):
            if isinstance(child, cst.BaseSmallStatement):
                order[child] = len(order)
            elif isinstance(child, cst.BaseCompoundStatement):
                order[child] = len(order)
                visit(child)
            elif isinstance(child, _CLAUSES):
                visit(child)

    visit(module)
    return order


def ast_statement_rows(text: str) -> list[int] | None:
    """The row of every statement, in source order; None where CPython cannot parse it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    rows: list[int] = []

    def visit(body: list[ast.stmt]) -> None:
        for statement in body:
            rows.append(statement.lineno)
            for name in ("body", "handlers", "cases", "orelse", "finalbody"):
                for part in getattr(statement, name, ()):
                    if isinstance(part, ast.stmt):
                        visit([part])
                    else:  # an except handler or a match case
                        visit(part.body)

    visit(tree.body)
    return rows
