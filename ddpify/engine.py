"""Parse once, run every enabled rule in one batched visit, turn reports into diagnostics."""

from __future__ import annotations

import io
import re
import tokenize
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, WhitespaceInclusivePositionProvider

from ddpify.analysis.guards import Scope, rank_zero_scope
from ddpify.analysis.model import ScriptModel
from ddpify.analysis.names import ImportMap
from ddpify.diagnostics import Diagnostic, Edit, Fix, Location, Severity
from ddpify.files import SourceError, decode_source
from ddpify.rules.base import Report, Rule
from ddpify.walk import walk

PARSE_ERROR_CODE = "DDP000"
PARSE_ERROR_NAME = "syntax-error"

_NOQA = re.compile(r"#\s*noqa(?P<codes>:\s*[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*)?", re.IGNORECASE)


class Context:
    """What a rule may ask while it visits: imports, the script model, the ancestry."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.imports = ImportMap()
        self.model = ScriptModel(self.imports)
        self.ancestors: list[cst.CSTNode] = []

    def qualify(self, expr: cst.BaseExpression) -> str | None:
        return self.imports.qualify(expr)

    def rank_zero_scope(self) -> Scope | None:
        """Whether the node being visited runs on rank 0 only, and which rank 0."""
        return rank_zero_scope(self.ancestors)

    def enclosing(self, *types: type) -> cst.CSTNode | None:
        for node in reversed(self.ancestors[:-1]):
            if isinstance(node, types):
                return node
        return None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)


class _Dispatcher:
    """One traversal: keep the ancestry, feed the model, then every rule's handlers.

    A rule that raises is switched off for the rest of the file and its findings there
    dropped, so one rule's bug costs one rule, not the whole run; the crash is recorded.
    """

    def __init__(self, context: Context, rules: Sequence[Rule], crashes: list[str]) -> None:
        self.context = context
        self.crashes = crashes
        self.failed: set[Rule] = set()
        self.visitors: dict[str, list] = defaultdict(list)
        self.leavers: dict[str, list] = defaultdict(list)
        for rule in rules:
            for name, handler in rule.bound_handlers("visit_").items():
                self.visitors[name].append((rule, handler))
            for name, handler in rule.bound_handlers("leave_").items():
                self.leavers[name].append((rule, handler))

    def _call(self, handlers: list, node: cst.CSTNode) -> None:
        for rule, handler in handlers:
            if rule in self.failed:
                continue
            try:
                handler(node)
            except Exception as exc:  # noqa: BLE001 - isolate one rule's bug
                self.failed.add(rule)
                rule.reports.clear()
                self.crashes.append(f"rule {rule.CODE} failed: {type(exc).__name__}: {exc}")

    def enter(self, node: cst.CSTNode) -> None:
        self.context.ancestors.append(node)
        self.context.model.visit(node)
        self._call(self.visitors.get(type(node).__name__, ()), node)

    def leave(self, node: cst.CSTNode) -> None:
        self._call(self.leavers.get(type(node).__name__, ()), node)
        self.context.ancestors.pop()


def _prescan_imports(module: cst.Module, imports: ImportMap) -> None:
    """Top-level imports first, so names used above a late import still resolve."""
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    imports.add(small)


@dataclass
class FileResult:
    filename: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    skipped: bool = False  # never mentions torch: not parsed at all
    # Rules that raised on this file (a bug in ddpify): reported as internal errors.
    crashes: list[str] = field(default_factory=list)


def physical_lines(text: str) -> list[str]:
    """Lines as the parser counts them (str.splitlines also splits on form feeds)."""
    return re.split(r"\r\n|\r|\n", text)


def mentions_torch(text: str) -> bool:
    return "torch" in text


def parse_error(filename: str, message: str, row: int = 1, column: int = 1) -> Diagnostic:
    location = Location(row, column)
    return Diagnostic(
        PARSE_ERROR_CODE, PARSE_ERROR_NAME, Severity.ERROR, message, filename, location, location
    )


def parse(text: str, filename: str) -> cst.Module | Diagnostic:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        return _syntax_error(text, filename, exc)
    except (RecursionError, MemoryError, ValueError) as exc:
        return parse_error(filename, f"cannot parse: {type(exc).__name__}: {exc}")


def _syntax_error(text: str, filename: str, exc: cst.ParserSyntaxError) -> Diagnostic:
    """Prefer CPython's message and position: libcst's often point past the real error."""
    try:
        compile(text, filename, "exec", dont_inherit=True)
    except SyntaxError as py_exc:
        if py_exc.lineno:
            message = f"cannot parse: {py_exc.msg}"
            return parse_error(filename, message, py_exc.lineno, py_exc.offset or 1)
    except (ValueError, RecursionError, MemoryError):
        pass
    return parse_error(filename, f"cannot parse: {exc.message}", exc.raw_line, exc.raw_column + 1)


def run_rules(
    module: cst.Module, rule_types: Iterable[type[Rule]], crashes: list[str] | None = None
) -> list[Report]:
    """Run the rules over `module`. Without a `crashes` list, a rule's exception propagates."""
    context = Context(module)
    _prescan_imports(module, context.imports)
    rules = [rule_type(context) for rule_type in rule_types]
    collected: list[str] = []
    dispatcher = _Dispatcher(context, rules, collected)
    walk(module, dispatcher.enter, dispatcher.leave)
    if crashes is None and collected:
        raise RuntimeError("; ".join(collected))
    if crashes is not None:
        crashes.extend(collected)
    return [report for rule in rules for report in rule.reports]


def check_source(
    text: str, filename: str, rule_types: Sequence[type[Rule]], *, force: bool = False
) -> FileResult:
    """Lint one file's text. `force` parses even when the file never mentions torch."""
    result = FileResult(filename)
    if not force and not mentions_torch(text):
        result.skipped = True
        return result
    module = parse(text, filename)
    if isinstance(module, Diagnostic):
        result.diagnostics.append(module)
        return result
    reports = run_rules(module, rule_types, result.crashes)
    if reports:
        lines = physical_lines(text)
        diagnostics = _to_diagnostics(module, reports, filename, lines)
        result.diagnostics = _filter_noqa(diagnostics, text, lines)
    return result


def check_bytes(data: bytes, filename: str, rule_types: Sequence[type[Rule]]) -> FileResult:
    try:
        source = decode_source(data, filename)
    except SourceError as exc:
        return FileResult(filename, [parse_error(filename, f"cannot read file: {exc}")])
    return check_source(source.text, filename, rule_types)


def _to_diagnostics(
    module: cst.Module, reports: list[Report], filename: str, lines: list[str]
) -> list[Diagnostic]:
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    providers = [PositionProvider]
    if any(report.fix for report in reports):
        providers.append(WhitespaceInclusivePositionProvider)
    metadata = wrapper.resolve_many(providers)
    positions = metadata[PositionProvider]
    out = []
    for report in reports:
        span = positions[report.node]
        start = Location(span.start.line, span.start.column + 1)
        end = Location(span.end.line, span.end.column + 1)
        fix = None
        if report.fix is not None:
            inclusive = metadata[WhitespaceInclusivePositionProvider]
            edits = tuple(
                Edit(
                    module.code_for_node(new),
                    Location(inclusive[old].start.line, inclusive[old].start.column + 1),
                    Location(inclusive[old].end.line, inclusive[old].end.column + 1),
                )
                for old, new in report.fix.replacements
            )
            fix = Fix(report.fix.message, report.fix.applicability, edits)
        rule = report.rule
        out.append(
            Diagnostic(
                rule.CODE,
                rule.NAME,
                report.severity,
                report.message,
                filename,
                start,
                end,
                fix,
                tuple(lines[start.row - 1 : end.row]),
            )
        )
    out.sort(key=lambda d: (d.location, d.code))
    return out


def _logical_line_ends(text: str) -> dict[int, int]:
    """Physical row -> last row of its logical line (`foo(\n  x\n)  # noqa` spans three)."""
    ends: dict[int, int] = {}
    first_row = None
    layout = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NEWLINE and first_row is not None:
                for row in range(first_row, token.start[0] + 1):
                    ends[row] = token.start[0]
                first_row = None
            elif token.type not in layout and first_row is None:
                first_row = token.start[0]
    except (tokenize.TokenError, SyntaxError):
        pass
    return ends


def _filter_noqa(diagnostics: list[Diagnostic], text: str, lines: list[str]) -> list[Diagnostic]:
    """Drop findings under `# noqa` (all codes) or `# noqa: DDP022, DDP050` on the finding's
    first or last line, or at the end of the statement it belongs to."""
    if "noqa" not in text.lower():
        return diagnostics
    logical_end = _logical_line_ends(text)
    return [d for d in diagnostics if not _suppressed(d, lines, logical_end)]


def _suppressed(diagnostic: Diagnostic, lines: list[str], logical_end: dict[int, int]) -> bool:
    start, end = diagnostic.location.row, diagnostic.end_location.row
    for row in {start, end, logical_end.get(start, start)}:
        if row > len(lines):
            continue
        match = _NOQA.search(lines[row - 1])
        if match is None:
            continue
        codes = match.group("codes")
        if codes is None:
            return True
        if diagnostic.code in re.findall(r"[A-Z]+[0-9]+", codes.upper()):
            return True
    return False
