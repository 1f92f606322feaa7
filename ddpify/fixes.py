"""Applying fixes: text edits from diagnostics, applied back to front."""

from __future__ import annotations

from collections.abc import Iterable

from ddpify.diagnostics import Applicability, Diagnostic, Edit, Location


def _offsets(text: str) -> list[int]:
    """Offset of the first character of each line (1-based rows map to index row - 1)."""
    starts = [0]
    index = 0
    while True:
        nl = text.find("\n", index)
        cr = text.find("\r", index)
        ends = [i for i in (nl, cr) if i != -1]
        if not ends:
            return starts
        end = min(ends)
        end += 2 if text.startswith("\r\n", end) else 1
        starts.append(end)
        index = end


def _offset(starts: list[int], location: Location) -> int:
    return starts[location.row - 1] + location.column - 1


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    """Apply non-overlapping edits; later edits that overlap an earlier one are dropped."""
    starts = _offsets(text)
    spans = sorted(
        ((_offset(starts, e.location), _offset(starts, e.end_location), e.content) for e in edits),
        key=lambda span: (span[0], span[1]),
    )
    kept, last_end = [], -1
    for start, end, content in spans:
        if start < last_end:
            continue
        kept.append((start, end, content))
        last_end = end
    for start, end, content in reversed(kept):
        text = text[:start] + content + text[end:]
    return text


def fixable(diagnostics: Iterable[Diagnostic], unsafe: bool = False) -> list[Diagnostic]:
    return [
        d
        for d in diagnostics
        if d.fix is not None and (unsafe or d.fix.applicability is Applicability.SAFE)
    ]


def apply_fixes(text: str, diagnostics: Iterable[Diagnostic], unsafe: bool = False) -> str:
    """One round: apply every applicable fix whose edits do not overlap an earlier fix."""
    edits = [edit for d in fixable(diagnostics, unsafe) for edit in d.fix.edits]
    return apply_edits(text, edits)
