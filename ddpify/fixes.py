"""Applying fixes: text edits from diagnostics, applied back to front, in bounded rounds.

A fix is applied whole or not at all: when two fixes touch the same text, the later one
waits for the next round, where the file is linted again and the fix recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable

from ddpify.diagnostics import Applicability, Diagnostic, Edit, Location
from ddpify.gates import GateError, check_comments_kept, check_compiles, check_roundtrip
from ddpify.guarded import GaveUp, guarded

# A fix that keeps producing new fixes after this many rounds is a bug in a rule.
MAX_ROUNDS = 10


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


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    # Two insertions at one point also conflict: their order would be arbitrary.
    return (a[0] < b[1] and b[0] < a[1]) or a[0] == b[0]


def compatible_fixes(text: str, diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """The diagnostics whose fixes can all be applied together, in source order; a fix
    that overlaps one already chosen is left out whole, never in part."""
    starts = _offsets(text)
    chosen: list[Diagnostic] = []
    taken: list[tuple[int, int]] = []
    ordered = sorted(
        (d for d in diagnostics if d.fix is not None and d.fix.edits),
        key=lambda d: min(e.location for e in d.fix.edits),
    )
    for d in ordered:
        spans = [
            (_offset(starts, e.location), _offset(starts, e.end_location)) for e in d.fix.edits
        ]
        if any(_overlaps(span, other) for span in spans for other in taken):
            continue
        if any(_overlaps(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :]):
            continue  # a malformed fix that overlaps itself
        chosen.append(d)
        taken.extend(spans)
    return chosen


def apply_fixes(text: str, diagnostics: Iterable[Diagnostic], unsafe: bool = False) -> str:
    """One round: apply every applicable fix that does not overlap an earlier fix."""
    chosen = compatible_fixes(text, fixable(diagnostics, unsafe))
    return apply_edits(text, [edit for d in chosen for edit in d.fix.edits])


@dataclass
class FixOutcome:
    original: str
    text: str
    fixed: list[Diagnostic] = field(default_factory=list)  # as reported before each fix
    remaining: list[Diagnostic] = field(default_factory=list)  # findings of the final text
    rounds: int = 0

    @property
    def changed(self) -> bool:
        return self.text != self.original


def fix_until_stable(
    text: str,
    lint: Callable[[str], list[Diagnostic]],
    *,
    unsafe: bool = False,
    filename: str = "<fix>",
    max_rounds: int = MAX_ROUNDS,
) -> FixOutcome:
    """Lint, apply the compatible fixes, lint again, until no applicable fix is left.

    Every round's output must compile (else GateError names the codes whose fixes broke
    it), and the loop must settle within `max_rounds`: a rewrite that keeps changing its
    own output is not idempotent. `lint` must already drop `# noqa`-suppressed findings,
    which is what keeps their fixes from being applied. A file that crashes or stalls the
    parser fails the `parse` gate (see guarded.py).
    """
    try:
        return guarded(_fix_until_stable, text, lint, unsafe, filename, max_rounds)
    except GaveUp as exc:
        raise GateError("parse", f"cannot analyse: {exc}") from None


def _fix_until_stable(
    text: str,
    lint: Callable[[str], list[Diagnostic]],
    unsafe: bool,
    filename: str,
    max_rounds: int,
) -> FixOutcome:
    outcome = FixOutcome(text, text)
    diagnostics = lint(text)
    if not fixable(diagnostics, unsafe):
        outcome.remaining = diagnostics
        return outcome
    check_roundtrip(text)
    for _ in range(max_rounds):
        chosen = compatible_fixes(outcome.text, fixable(diagnostics, unsafe))
        if not chosen:
            outcome.remaining = diagnostics
            return outcome
        new_text = apply_edits(outcome.text, [e for d in chosen for e in d.fix.edits])
        if new_text == outcome.text:
            break  # fixes that change nothing: settled, and nothing was fixed
        codes = ", ".join(sorted({d.code for d in chosen}))
        check_compiles(new_text, f"fix {codes}", filename)
        check_comments_kept(outcome.text, new_text, f"fix {codes}")
        outcome.text = new_text
        outcome.fixed.extend(chosen)
        outcome.rounds += 1
        diagnostics = lint(new_text)
    if outcome.rounds == max_rounds and fixable(diagnostics, unsafe):
        codes = ", ".join(sorted({d.code for d in fixable(diagnostics, unsafe)}))
        raise GateError(f"fix {codes}", f"not idempotent: still changing after {max_rounds} rounds")
    outcome.remaining = diagnostics
    return outcome
