"""Parse once, run every enabled rule in one batched visit, turn reports into diagnostics."""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import tokenize
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from ddpify.analysis.guards import Scope, judging_calls_with, rank_zero_scope, returns_rank_zero
from ddpify.analysis.model import ScriptModel, returned_callees
from ddpify.analysis.names import ImportMap
from ddpify.analysis.project import LocalClass, LocalFunction, LocalFunctions
from ddpify.analysis.tree import Tree
from ddpify.analysis.wrappers import DDP, FED_TYPES, WrapperFacts
from ddpify.diagnostics import Applicability, Diagnostic, Edit, Fix, Location, Severity
from ddpify.files import SourceError, decode_source
from ddpify.gc_tuning import fewer_collections
from ddpify.guarded import GaveUp, deep, guarded, python_rejects, risky
from ddpify.libcst_speed import parse_module
from ddpify.positions import Positions
from ddpify.rules.base import NodeFix, Report, Rule
from ddpify.walk import is_kind, new_generation, walk

PARSE_ERROR_CODE = "DDP000"
PARSE_ERROR_NAME = "syntax-error"

# (module, text, parents) -> the positions of its nodes: `Positions`, or the language
# server's, which carry positions over from its last lint (ddpify/carried_positions.py).
PositionsFactory = Callable[[cst.Module, str, Mapping[cst.CSTNode, cst.CSTNode]], Positions]

_NOQA = re.compile(r"#\s*noqa(?P<codes>:\s*[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*)?", re.IGNORECASE)


class Context:
    """What a rule may ask while it visits: imports, the script model, the ancestry."""

    def __init__(self, module: cst.Module, filename: str | None = None) -> None:
        self.module = module
        self.imports = ImportMap()
        self.model = ScriptModel(self.imports)
        # Which names hold the DDP wrapper where: fed by the engine's walk, read by rules.
        self.wrappers = WrapperFacts(self.imports, returns_ddp=self._returns_ddp)
        self.ancestors: list[cst.CSTNode] = []
        # The functions among the ancestors (the node being visited aside), innermost last:
        # "which function is this in" is asked for most calls a rule records.
        self.functions: list[cst.FunctionDef] = []
        # Functions this file imports from local modules (read only when a rule asks).
        self.local = LocalFunctions(filename)
        # What the local modules' helpers return, by helper (`returned_callees`).
        self._returned_by_local: dict[int, frozenset[str]] = {}
        self._judged: dict[int, Scope | None] = {}
        self._functions: dict[str, cst.FunctionDef] | None = None
        self._tree: Tree | None = None
        # Each node's parent, filled in by the engine's walk (pre-order).
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}

    @property
    def tree(self) -> Tree:
        """The file as `ddpify/analysis/` reads it for migrate too (roles, epochs, ...):
        a rule asks the one analysis over it instead of re-deriving a fact. Made on the
        first question, from the engine's walk once it is complete (in `leave_Module`:
        no second walk), so a file no rule asks about pays nothing for it."""
        if self._tree is None:
            walked = len(self.ancestors) <= 1 and (self.parents or not self.module.body)
            if walked:
                self._tree = Tree.from_walk(self.module, self.parents)
            else:  # asked in the middle of the walk: a walk of its own
                return Tree(self.module)
        return self._tree

    def _returns_ddp(self, call: cst.Call) -> bool:
        """`call` is `DistributedDataParallel(...)` or a helper returning one: of this file,
        or imported from a local module (`model = ddp_wrap(model, ctx)`)."""
        if self.model.call_returns(call, DDP):
            return True
        helper = self.local_callee(call.func) if self.imports.qualify_local(call.func) else None
        return type(helper) is LocalFunction and DDP in self._local_returns(helper)

    def _local_returns(self, helper: LocalFunction) -> frozenset[str]:
        found = self._returned_by_local.get(id(helper.node))
        if found is None:
            found = self._returned_by_local[id(helper.node)] = returned_callees(
                helper.node, helper.imports
            )
        return found

    def local_function(self, qualified: str) -> LocalFunction | None:
        """The definition of an imported helper (`utils.save_checkpoint`) in a local module
        of the project, or None (not local, not found, or no file to start from)."""
        return self.local.function(qualified)

    def local_callee(self, func: cst.BaseExpression) -> LocalFunction | LocalClass | None:
        """What a call's `func` names in a local module (absolute or relative import): the
        function, or the class it instantiates; None when it is not a local definition."""
        qualified = self.imports.qualify_local(func)
        if qualified is None:
            return None
        return self.local.function(qualified) or self.local.class_(qualified)

    def judge_guard_call(self, call: cst.Call) -> Scope | None:
        """`if check_primary():` where `check_primary` (in this file or a local module)
        returns a rank-0 test: a guard whatever its name (see `returns_rank_zero`)."""
        function = self._called_function(call.func)
        if function is None:
            return None
        if id(function) not in self._judged:
            self._judged[id(function)] = returns_rank_zero(function)
        return self._judged[id(function)]

    def _called_function(self, func: cst.BaseExpression) -> cst.FunctionDef | None:
        if isinstance(func, cst.Name) and func.value not in self.imports.aliases:
            if func.value in self.imports.relative:
                found = self.local.function(self.imports.relative[func.value])
                return found.node if found is not None else None
            return self._own_functions().get(func.value)
        qualified = self.imports.qualify_local(func)
        found = self.local.function(qualified) if qualified is not None else None
        return found.node if found is not None else None

    def _own_functions(self) -> dict[str, cst.FunctionDef]:
        if self._functions is None:
            self._functions = {
                statement.name.value: statement
                for statement in self.module.body
                if isinstance(statement, cst.FunctionDef)
            }
        return self._functions

    def distributed_importers(self) -> list[Path]:
        """The modules of the project that import this file and run distributed: what makes
        a helper module's code run on every rank (empty for a script nobody imports)."""
        return self.local.distributed_importers()

    def importing_modules(self) -> list[tuple[Path, cst.Module, ImportMap]]:
        """The modules of the project that import this file, parsed: where the calls of
        its functions are (recorded as dependencies of the result)."""
        return self.local.importing_modules()

    def ddp_wrapping_modules(self) -> list[Path]:
        """Other modules of the project that wrap a model in DistributedDataParallel."""
        return self.local.ddp_wrapping_modules()

    def local_table_functions(self, table: cst.BaseExpression) -> list[LocalFunction]:
        """The functions of an imported module-level table (`GETTERS[name](...)`)."""
        qualified = self.imports.qualify_local(table)
        return self.local.functions_in(qualified) if qualified is not None else []

    def qualify(self, expr: cst.BaseExpression) -> str | None:
        return self.imports.qualify(expr)

    def rank_zero_scope(self) -> Scope | None:
        """Whether the node being visited runs on rank 0 only, and which rank 0."""
        return rank_zero_scope(self.ancestors)

    def enclosing(self, *types: type) -> cst.CSTNode | None:
        if types == (cst.FunctionDef,):
            return self.functions[-1] if self.functions else None
        for node in reversed(self.ancestors[:-1]):
            if is_kind(node, types):
                return node
        return None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)


class _Dispatcher:
    """One traversal: keep the ancestry (and each node's parent, for positions and fixes
    later), feed the model, then every rule's handlers.

    A rule that raises is switched off for the rest of the file and its findings there
    dropped, so one rule's bug costs one rule, not the whole run; the crash is recorded.
    """

    def __init__(self, context: Context, rules: Sequence[Rule], crashes: list[str]) -> None:
        self.context = context
        self.crashes = crashes
        self.parents: dict[cst.CSTNode, cst.CSTNode] = context.parents
        # Node type name -> the handlers of the rules still running, bound to their rule.
        self.visitors: dict[str, list] = defaultdict(list)
        self.leavers: dict[str, list] = defaultdict(list)
        for rule in rules:
            for name, handler in rule.bound_handlers("visit_").items():
                self.visitors[name].append(handler)
            for name, handler in rule.bound_handlers("leave_").items():
                self.leavers[name].append(handler)

    def _call(self, handlers: list, node: cst.CSTNode) -> None:
        for handler in handlers:
            try:
                handler(node)
            except Exception as exc:  # noqa: BLE001 - isolate one rule's bug
                self._switch_off(handler.__self__, exc)

    def _switch_off(self, rule: Rule, exc: Exception) -> None:
        """Drop a rule that raised, and its findings in this file. The lists are replaced,
        not changed in place: the loop over the current node's handlers goes on."""
        for table in (self.visitors, self.leavers):
            for name, handlers in table.items():
                table[name] = [handler for handler in handlers if handler.__self__ is not rule]
        rule.reports.clear()
        self.crashes.append(f"rule {rule.CODE} failed: {type(exc).__name__}: {exc}")

    def enter(self, node: cst.CSTNode) -> None:
        ancestors = self.context.ancestors
        if ancestors:
            self.parents[node] = ancestors[-1]
        ancestors.append(node)
        self.context.model.visit(node)
        node_type = type(node)
        if node_type in FED_TYPES:
            self.context.wrappers.visit(node, ancestors)
        handlers = self.visitors.get(node_type.__name__)
        if handlers:  # most nodes (names, operators, whitespace) have none
            self._call(handlers, node)
        if node_type is cst.FunctionDef:
            self.context.functions.append(node)

    def leave(self, node: cst.CSTNode) -> None:
        node_type = type(node)
        if node_type is cst.FunctionDef:
            self.context.functions.pop()
        handlers = self.leavers.get(node_type.__name__)
        if handlers:
            self._call(handlers, node)
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
    # Other files the findings depend on (a helper's definition): path -> sha256.
    depends_on: dict[str, str] = field(default_factory=dict)
    # With `check_source(..., fixes=False)`: the findings' fixes, rendered when asked.
    pending_fixes: PendingFixes | None = None


def physical_lines(text: str) -> list[str]:
    """Lines as the parser counts them (str.splitlines also splits on form feeds)."""
    return re.split(r"\r\n|\r|\n", text)


def mentions_torch(text: str) -> bool:
    # An argparse module that declares the launcher's `--local_rank` is part of a DDP
    # script even when the torch code lives in another file.
    return "torch" in text or "--local_rank" in text or "--local-rank" in text


def parse_error(filename: str, message: str, row: int = 1, column: int = 1) -> Diagnostic:
    location = Location(row, column)
    return Diagnostic(
        PARSE_ERROR_CODE, PARSE_ERROR_NAME, Severity.ERROR, message, filename, location, location
    )


def parse(
    text: str, filename: str, parser: Callable[[str], cst.Module] | None = None
) -> cst.Module | Diagnostic:
    if risky(text):  # let CPython's bounded parser refuse what would crash libcst's
        error = python_rejects(text, filename)
        if error is not None:
            return parse_error(
                filename, f"cannot parse: {error.msg}", error.lineno or 1, error.offset or 1
            )
    try:
        return (parser or parse_module)(text)
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
    module: cst.Module,
    rule_types: Iterable[type[Rule]],
    crashes: list[str] | None = None,
    *,
    filename: str | None = None,
    depends_on: dict[str, str] | None = None,
) -> list[Report]:
    """Run the rules over `module`. Without a `crashes` list, a rule's exception propagates.
    With `filename`, rules may read helpers from the file's local modules; the files they
    read are added to `depends_on`."""
    return _run_rules(module, rule_types, crashes, filename, depends_on)[0]


def _run_rules(
    module: cst.Module,
    rule_types: Iterable[type[Rule]],
    crashes: list[str] | None,
    filename: str | None = None,
    depends_on: dict[str, str] | None = None,
) -> tuple[list[Report], dict[cst.CSTNode, cst.CSTNode]]:
    """The reports, and the parent of each node the walk saw."""
    new_generation()  # subtree answers of the last lint: kept for the nodes it reused
    context = Context(module, filename)
    _prescan_imports(module, context.imports)
    rules = [rule_type(context) for rule_type in rule_types]
    collected: list[str] = []
    dispatcher = _Dispatcher(context, rules, collected)
    with judging_calls_with(context.judge_guard_call):
        walk(module, dispatcher.enter, dispatcher.leave)
    if crashes is None and collected:
        raise RuntimeError("; ".join(collected))
    if crashes is not None:
        crashes.extend(collected)
    if depends_on is not None:
        depends_on.update(context.local.used)
    return [report for rule in rules for report in rule.reports], dispatcher.parents


def check_source(
    text: str,
    filename: str,
    rule_types: Sequence[type[Rule]],
    *,
    force: bool = False,
    parser: Callable[[str], cst.Module] | None = None,
    fixes: bool = True,
    positions: PositionsFactory | None = None,
) -> FileResult:
    """Lint one file's text. `force` parses even when the file never mentions torch;
    `parser` replaces `libcst.parse_module` (the language server re-parses only what an
    edit changed: ddpify/reparse.py); a syntax error still gets CPython's message.
    `fixes=False` leaves each diagnostic's `fix` empty and renders it only when asked,
    through `result.pending_fixes` (the language server publishes the findings at once
    and renders a fix when the editor asks for the actions at its range). `positions`
    replaces `Positions` (the language server carries positions over from its last lint).

    A file that crashes or stalls the parser becomes a DDP000 finding (see guarded.py)."""
    if not force and not mentions_torch(text):
        return FileResult(filename, skipped=True)
    try:
        return guarded(_check_text, text, filename, rule_types, parser, fixes, positions)
    except GaveUp as exc:
        return FileResult(filename, [parse_error(filename, f"cannot analyse: {exc}")])


def _check_text(
    text: str,
    filename: str,
    rule_types: Sequence[type[Rule]],
    parser: Callable[[str], cst.Module] | None = None,
    fixes: bool = True,
    positions: PositionsFactory | None = None,
) -> FileResult:
    with fewer_collections():
        module = parse(text, filename, parser)
        if isinstance(module, Diagnostic):
            return FileResult(filename, [module])
        return check_module(module, text, filename, rule_types, fixes=fixes, positions=positions)


def check_module(
    module: cst.Module,
    text: str,
    filename: str,
    rule_types: Sequence[type[Rule]],
    *,
    fixes: bool = True,
    positions: PositionsFactory | None = None,
) -> FileResult:
    """Lint a module already parsed from `text` (whose code it is): what `check_source`
    finds in `text`, without parsing it again (migrate's gates parse the output once)."""
    result = FileResult(filename)
    reports, parents = _run_rules(
        module, rule_types, result.crashes, filename, depends_on=result.depends_on
    )
    if reports:
        lines = physical_lines(text)
        renderer = _FixRenderer(module, text, parents, positions or Positions)
        pending: dict[Diagnostic, NodeFix] | None = None if fixes else {}
        diagnostics = _to_diagnostics(reports, filename, lines, renderer, pending)
        result.diagnostics = _filter_noqa(diagnostics, text, lines)
        if pending:
            result.pending_fixes = PendingFixes(pending, renderer)
    return result


def check_bytes(data: bytes, filename: str, rule_types: Sequence[type[Rule]]) -> FileResult:
    try:
        source = decode_source(data, filename)
    except SourceError as exc:
        return FileResult(filename, [parse_error(filename, f"cannot read file: {exc}")])
    return check_source(source.text, filename, rule_types)


def _to_diagnostics(
    reports: list[Report],
    filename: str,
    lines: list[str],
    renderer: _FixRenderer,
    pending: dict[Diagnostic, NodeFix] | None = None,
) -> list[Diagnostic]:
    """The reports as diagnostics. With `pending`, fixes are not rendered: each fixable
    diagnostic (without its fix) is mapped there to the replacement to render later."""
    out = []
    # One finding per rule, span and message: a rule that meets the same problem by two
    # routes (a `set_device` after each of two `init_process_group` branches) says it once.
    said: set[tuple] = set()
    for report in reports:
        span = renderer.positions[report.node]
        start = Location(span.start.line, span.start.column + 1)
        end = Location(span.end.line, span.end.column + 1)
        key = (report.rule.CODE, start, end, report.message)
        if key in said:
            continue
        said.add(key)
        fix = None
        if report.fix is not None and pending is None:
            fix = renderer.fix(report.fix)
        rule = report.rule
        diagnostic = Diagnostic(
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
        if report.fix is not None and pending is not None:
            pending.setdefault(diagnostic, report.fix)
        out.append(diagnostic)
    out.sort(key=lambda d: (d.location, d.code))
    return out


class _Replace(cst.CSTTransformer):
    def __init__(self, replacements: dict[cst.CSTNode, cst.CSTNode]) -> None:
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        return self.replacements.get(original_node, updated_node)


def _with_child(parent: cst.CSTNode, child: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    for attribute in dataclasses.fields(parent):
        value = getattr(parent, attribute.name)
        if value is child:
            return parent.with_changes(**{attribute.name: new})
        if isinstance(value, (tuple, list)) and any(item is child for item in value):
            items = [new if item is child else item for item in value]
            items = [item for item in items if item is not cst.RemovalSentinel.REMOVE]
            return parent.with_changes(**{attribute.name: type(value)(items)})
    raise ValueError(f"{type(child).__name__} is not a child of {type(parent).__name__}")


def _replace_along_path(
    top: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode, parents: Mapping
) -> cst.CSTNode:
    """`top` with `old` replaced, rebuilding only the nodes between them (a transformer
    would rebuild the whole statement)."""
    while old is not top:
        parent = parents[old]
        old, new = parent, _with_child(parent, old, new)
    return new


class _FixRenderer:
    """Turns node replacements into one text edit each, rendered in place.

    A replacement is rendered inside its top-level statement (or the whole module), so
    it picks up the indentation of the block it lands in; the edit is the region where
    that rendering differs from the original text.
    """

    def __init__(
        self, module: cst.Module, text: str, parents: Mapping, positions: PositionsFactory
    ) -> None:
        self.module = module
        self.text = text
        self.positions = positions(module, text, parents)  # the findings' positions too
        self.parents = parents

    @functools.cached_property
    def row_offsets(self) -> list[int]:  # only fixes need them: rendered lazily in the LSP
        return [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", self.text)]

    @functools.cached_property
    def body_index(self) -> dict[int, int]:
        return {id(statement): i for i, statement in enumerate(self.module.body)}

    def fix(self, fix: NodeFix) -> Fix | None:
        edit = self.edit(fix)
        return None if edit is None else Fix(fix.message, fix.applicability, (edit,))

    def edit(self, fix: NodeFix) -> Edit | None:
        replacements = dict(fix.replacements)
        tops = {self._top_level(old) for old in replacements}
        statement = tops.pop() if len(tops) == 1 else None
        if statement is None:
            return _diff(self.text, self.module.visit(_Replace(replacements)).code, 1)
        if len(replacements) == 1:
            [(old, new)] = replacements.items()
            rendered = _replace_along_path(statement, old, new, self.parents)
        else:
            rendered = statement.visit(_Replace(replacements))
        index = self.body_index[id(statement)]
        row = self._first_row(index)
        start = self.row_offsets[row - 1]
        end = self._end_offset(index)
        return _diff(self.text[start:end], self.module.code_for_node(rendered), row)

    def _top_level(self, node: cst.CSTNode) -> cst.CSTNode | None:
        while node in self.parents:
            parent = self.parents[node]
            if parent is self.module:
                return node
            node = parent
        return None

    def _first_row(self, index: int) -> int:
        """Row where statement `index`'s code starts: its comments and blank lines count."""
        statement = self.module.body[index]
        decorators = getattr(statement, "decorators", ())
        first = decorators[0] if decorators else statement
        return self.positions.start(first).line - len(statement.leading_lines)

    def _end_offset(self, index: int) -> int:
        if index + 1 < len(self.module.body):
            return self.row_offsets[self._first_row(index + 1) - 1]
        footer = "".join(self.module.code_for_node(line) for line in self.module.footer)
        return len(self.text) - len(footer)


class PendingFixes:
    """Fixes rendered on demand: `fix(diagnostic)` is the `fix` that `check_source` with
    fixes rendered gives that diagnostic (each rendered once)."""

    def __init__(self, pending: dict[Diagnostic, NodeFix], renderer: _FixRenderer) -> None:
        self._pending = pending
        self._renderer = renderer
        self._rendered: dict[Diagnostic, Fix | None] = {}

    def applicability(self, diagnostic: Diagnostic) -> Applicability | None:
        """How safe the diagnostic's fix would be, without rendering it (None: no fix)."""
        node_fix = self._pending.get(dataclasses.replace(diagnostic, fix=None))
        return None if node_fix is None else node_fix.applicability

    def fix(self, diagnostic: Diagnostic) -> Fix | None:
        key = dataclasses.replace(diagnostic, fix=None)
        if key not in self._rendered:
            node_fix = self._pending.get(key)
            # Deep statements render in the big-stack thread, as the lint did.
            rendered = None if node_fix is None else deep(self._renderer.fix, node_fix)
            self._rendered[key] = rendered
        return self._rendered[key]

    def __reduce__(self):
        # Out of a forked child (guarded.py) the tree stays behind: send the fixes rendered.
        rendered = {key: self.fix(key) for key in self._pending}
        return (_RenderedFixes, (rendered,))


class _RenderedFixes(PendingFixes):
    def __init__(self, rendered: dict[Diagnostic, Fix | None]) -> None:
        self._pending = {}
        self._rendered = rendered

    def applicability(self, diagnostic: Diagnostic) -> Applicability | None:
        fix = self.fix(diagnostic)
        return None if fix is None else fix.applicability

    def fix(self, diagnostic: Diagnostic) -> Fix | None:
        return self._rendered.get(dataclasses.replace(diagnostic, fix=None))


def _diff(before: str, after: str, row: int) -> Edit | None:
    """The edit turning `before` (which starts at column 1 of `row`) into `after`."""
    if before == after:
        return None
    prefix = 0
    limit = min(len(before), len(after))
    while prefix < limit and before[prefix] == after[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and before[-1 - suffix] == after[-1 - suffix]:
        suffix += 1
    return Edit(
        after[prefix : len(after) - suffix],
        _location_in(before, prefix, row),
        _location_in(before, len(before) - suffix, row),
    )


def _location_in(text: str, offset: int, first_row: int) -> Location:
    """Row and column of `offset` in `text`, which starts at column 1 of `first_row`."""
    rows = re.split(r"\r\n|\r|\n", text[:offset])
    return Location(first_row + len(rows) - 1, len(rows[-1]) + 1)


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
