"""The language server (`ddpify lsp`, extra `lsp`): diagnostics, quick fixes, rule pages.

Diagnostics are published on open, change and save; each fixable finding offers a
quick fix, and a `source.fixAll.ddpify` action applies every safe fix through the same
bounded, gated loop as `ddpify check --fix`. Hovering a finding shows its rule page.

Positions: ddpify counts columns in code points; LSP clients count in the negotiated
position encoding (UTF-16 unless the client offers another), so every range is
converted against the text of its line.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

from lsprotocol import types as lsp

from ddpify import __version__, engine
from ddpify.config import Config, ConfigError, load_config
from ddpify.diagnostics import Applicability, Diagnostic, Edit, Fix, Location, Severity
from ddpify.docs import rule_page
from ddpify.fixes import fix_until_stable
from ddpify.gates import GateError
from ddpify.output.links import rule_url
from ddpify.reparse import Reparser

try:  # pygls 2
    from pygls.lsp.server import LanguageServer
except ImportError:  # pragma: no cover - pygls 1.x
    from pygls.server import LanguageServer

FIX_ALL_KIND = f"{lsp.CodeActionKind.SourceFixAll.value}.ddpify"
_SEVERITY = {
    Severity.ERROR: lsp.DiagnosticSeverity.Error,
    Severity.WARNING: lsp.DiagnosticSeverity.Warning,
    Severity.INFO: lsp.DiagnosticSeverity.Information,
}
log = logging.getLogger(__name__)


@dataclass
class Linted:
    """The last lint of one document: the text it saw and what it found."""

    text: str
    lines: list[str]
    diagnostics: list[Diagnostic]
    config: Config
    # The diagnostics' fixes, rendered when a code action asks (see engine.PendingFixes).
    pending_fixes: engine.PendingFixes | None = None

    def fix(self, diagnostic: Diagnostic) -> Fix | None:
        if diagnostic.fix is not None or self.pending_fixes is None:
            return diagnostic.fix
        return self.pending_fixes.fix(diagnostic)

    def has_safe_fix(self, diagnostic: Diagnostic) -> bool:
        pending = self.pending_fixes
        if pending is not None and pending.applicability(diagnostic) is not Applicability.SAFE:
            return False  # unsafe or none: no need to render it to know
        fix = self.fix(diagnostic)
        return fix is not None and fix.applicability is Applicability.SAFE


class PositionConverter:
    """Code-point columns <-> the client's position units, one line at a time."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding

    def _units(self, text: str) -> int:
        if self.encoding == lsp.PositionEncodingKind.Utf8:
            return len(text.encode("utf-8"))
        if self.encoding == lsp.PositionEncodingKind.Utf32:
            return len(text)
        return len(text.encode("utf-16-le")) // 2

    def to_client(self, lines: list[str], location: Location) -> lsp.Position:
        line = location.row - 1
        text = lines[line] if line < len(lines) else ""
        return lsp.Position(line=line, character=self._units(text[: location.column - 1]))

    def range(self, lines: list[str], start: Location, end: Location) -> lsp.Range:
        return lsp.Range(start=self.to_client(lines, start), end=self.to_client(lines, end))

    def from_client(self, lines: list[str], position: lsp.Position) -> Location:
        text = lines[position.line] if position.line < len(lines) else ""
        units = column = 0
        while column < len(text) and units < position.character:
            units += self._units(text[column])
            column += 1
        return Location(position.line + 1, column + 1)


class DdpifyServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("ddpify", __version__)
        self.linted: dict[str, Linted] = {}
        # Each open document's last parse: an edit re-parses the statements it touched.
        self.reparsers: dict[str, Reparser] = {}

    @property
    def positions(self) -> PositionConverter:
        codec = getattr(self.workspace, "position_codec", None)
        return PositionConverter(getattr(codec, "encoding", None) or lsp.PositionEncodingKind.Utf16)

    def document_text(self, uri: str) -> tuple[str, str]:
        document = self.workspace.get_text_document(uri)
        return document.source, document.path or uri

    def load_config(self, path: str) -> Config:
        try:
            return load_config(start=Path(path).parent)
        except ConfigError as exc:
            self.tell(f"ddpify: {exc}; using the default settings", lsp.MessageType.Warning)
            return Config()

    def lint(self, uri: str) -> Linted:
        text, path = self.document_text(uri)
        config = self.load_config(path)
        try:
            rules = config.rules()
        except ValueError as exc:
            self.tell(f"ddpify: {exc}; using the default rules", lsp.MessageType.Warning)
            config = Config()
            rules = config.rules()
        reparser = self.reparsers.setdefault(uri, Reparser())
        found = engine.check_source(
            text,
            path,
            rules,
            force=True,
            parser=reparser.parse,
            fixes=False,
            positions=reparser.positions,
        )
        linted = Linted(
            text,
            engine.physical_lines(text),
            config.filter(found.diagnostics, path),
            config,
            found.pending_fixes,
        )
        self.linted[uri] = linted
        return linted

    def current(self, uri: str) -> Linted:
        """The lint of the document as it is now (relinting if it changed since)."""
        linted = self.linted.get(uri)
        if linted is None or linted.text != self.document_text(uri)[0]:
            linted = self.lint(uri)
        return linted

    def to_lsp(self, d: Diagnostic, lines: list[str]) -> lsp.Diagnostic:
        return lsp.Diagnostic(
            range=self.positions.range(lines, d.location, d.end_location),
            message=d.message,
            severity=_SEVERITY[d.severity],
            code=d.code,
            code_description=lsp.CodeDescription(href=rule_url(d.code)),
            source="ddpify",
        )

    def publish(self, uri: str, diagnostics: list[lsp.Diagnostic]) -> None:
        params = lsp.PublishDiagnosticsParams(uri=uri, diagnostics=diagnostics)
        if hasattr(self, "text_document_publish_diagnostics"):
            self.text_document_publish_diagnostics(params)
        else:  # pragma: no cover - pygls 1.x
            self.publish_diagnostics(uri, diagnostics)

    def tell(self, message: str, kind: lsp.MessageType) -> None:
        params = lsp.ShowMessageParams(type=kind, message=message)
        if hasattr(self, "window_show_message"):
            self.window_show_message(params)
        else:  # pragma: no cover - pygls 1.x
            self.show_message(message, kind)

    def refresh(self, uri: str) -> None:
        linted = self.lint(uri)
        self.publish(uri, [self.to_lsp(d, linted.lines) for d in linted.diagnostics])

    def text_edits(self, edits: tuple[Edit, ...], lines: list[str]) -> list[lsp.TextEdit]:
        return [
            lsp.TextEdit(
                range=self.positions.range(lines, e.location, e.end_location),
                new_text=e.content,
            )
            for e in edits
        ]

    def quick_fixes(self, uri: str, linted: Linted, wanted: lsp.Range) -> list[lsp.CodeAction]:
        start = self.positions.from_client(linted.lines, wanted.start)
        end = self.positions.from_client(linted.lines, wanted.end)
        actions = []
        for d in linted.diagnostics:
            if d.end_location < start or d.location > end:
                continue
            fix = linted.fix(d)
            if fix is None:
                continue
            safe = fix.applicability is Applicability.SAFE
            title = f"{fix.message} ({d.code})" + ("" if safe else " [unsafe]")
            actions.append(
                lsp.CodeAction(
                    title=title,
                    kind=lsp.CodeActionKind.QuickFix,
                    diagnostics=[self.to_lsp(d, linted.lines)],
                    is_preferred=safe,
                    edit=lsp.WorkspaceEdit(changes={uri: self.text_edits(fix.edits, linted.lines)}),
                )
            )
        return actions

    def client_resolves_edits(self) -> bool:
        try:
            support = self.client_capabilities.text_document.code_action.resolve_support
        except AttributeError:
            return False
        return support is not None and "edit" in support.properties

    def fix_all(self, uri: str, linted: Linted) -> lsp.CodeAction | None:
        """The fix-all action; its edit is computed now, or on codeAction/resolve when the
        client can ask for it later (the fix loop lints several times: keep the light
        bulb fast)."""
        if not any(linted.has_safe_fix(d) for d in linted.diagnostics):
            return None
        if self.client_resolves_edits():
            return lsp.CodeAction(
                title="Fix all safe ddpify findings", kind=FIX_ALL_KIND, data={"uri": uri}
            )
        return self.resolve_fix_all(uri, linted)

    def resolve_fix_all(self, uri: str, linted: Linted) -> lsp.CodeAction | None:
        _, path = self.document_text(uri)
        rules = linted.config.rules()

        def lint(text: str) -> list[Diagnostic]:
            found = engine.check_source(text, path, rules, force=True).diagnostics
            return linted.config.filter(found, path)

        try:
            outcome = fix_until_stable(linted.text, lint, filename=path)
        except GateError as exc:
            log.warning("fix-all withheld for %s: %s", uri, exc)
            return None
        if not outcome.changed:
            return None
        end = Location(len(linted.lines), len(linted.lines[-1]) + 1)
        whole = Edit(outcome.text, Location(1, 1), end)
        return lsp.CodeAction(
            title=f"Fix all safe ddpify findings ({len(outcome.fixed)})",
            kind=FIX_ALL_KIND,
            edit=lsp.WorkspaceEdit(changes={uri: self.text_edits((whole,), linted.lines)}),
        )

    def hover(self, uri: str, position: lsp.Position) -> lsp.Hover | None:
        linted = self.current(uri)
        where = self.positions.from_client(linted.lines, position)
        codes = [d.code for d in linted.diagnostics if d.location <= where <= d.end_location]
        pages = [
            rule_page(code) or f"# {code}\n\nNo page for this code."
            for code in dict.fromkeys(codes)
        ]
        if not pages:
            return None
        content = lsp.MarkupContent(kind=lsp.MarkupKind.Markdown, value="\n\n---\n\n".join(pages))
        return lsp.Hover(contents=content)


def create_server() -> DdpifyServer:
    server = DdpifyServer()

    @server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: DdpifyServer, params: lsp.DidOpenTextDocumentParams) -> None:
        ls.refresh(params.text_document.uri)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: DdpifyServer, params: lsp.DidChangeTextDocumentParams) -> None:
        ls.refresh(params.text_document.uri)

    @server.feature(lsp.TEXT_DOCUMENT_DID_SAVE)
    def did_save(ls: DdpifyServer, params: lsp.DidSaveTextDocumentParams) -> None:
        ls.refresh(params.text_document.uri)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: DdpifyServer, params: lsp.DidCloseTextDocumentParams) -> None:
        ls.linted.pop(params.text_document.uri, None)
        ls.reparsers.pop(params.text_document.uri, None)
        ls.publish(params.text_document.uri, [])

    @server.feature(
        lsp.TEXT_DOCUMENT_CODE_ACTION,
        lsp.CodeActionOptions(
            code_action_kinds=[lsp.CodeActionKind.QuickFix, FIX_ALL_KIND],
            resolve_provider=True,
        ),
    )
    def code_action(ls: DdpifyServer, params: lsp.CodeActionParams) -> list[lsp.CodeAction]:
        uri = params.text_document.uri
        linted = ls.current(uri)
        only = params.context.only
        actions: list[lsp.CodeAction] = []
        if not only or lsp.CodeActionKind.QuickFix in only:
            actions.extend(ls.quick_fixes(uri, linted, params.range))
        if not only or any(FIX_ALL_KIND.startswith(kind) for kind in only):
            fix_all = ls.fix_all(uri, linted)
            if fix_all is not None:
                actions.append(fix_all)
        return actions

    @server.feature(lsp.CODE_ACTION_RESOLVE)
    def code_action_resolve(ls: DdpifyServer, action: lsp.CodeAction) -> lsp.CodeAction:
        uri = action.data.get("uri") if isinstance(action.data, dict) else None
        if action.kind != FIX_ALL_KIND or uri is None:
            return action
        resolved = ls.resolve_fix_all(uri, ls.current(uri))
        return resolved if resolved is not None else action

    @server.feature(lsp.TEXT_DOCUMENT_HOVER)
    def hover(ls: DdpifyServer, params: lsp.HoverParams) -> lsp.Hover | None:
        return ls.hover(params.text_document.uri, params.position)

    return server


# The server's young-generation threshold: a round trip allocates tens of thousands of
# objects (JSON, diagnostics, the analysis) that reference counting frees; collecting
# every 700 allocations (CPython's default) only re-scans the live syntax trees.
SERVER_YOUNG_THRESHOLD = 50_000


def settle_memory() -> None:
    """Freeze what start-up made (modules, every rule class, libcst's grammar) out of the
    collector's scans, and collect young objects less often: the server lives long and
    its garbage is nearly all freed by reference counting (libcst trees hold no cycles)."""
    Config().rules()  # import every rule module now, before the freeze
    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVER_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def serve() -> None:
    server = create_server()
    settle_memory()
    server.start_io()
