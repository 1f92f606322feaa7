"""Shared test helpers: lint source text and format findings as fixture lines."""

from __future__ import annotations

from pathlib import Path

from ddpify.diagnostics import Diagnostic
from ddpify.engine import check_source
from ddpify.rules import ALL_RULES, select_rules

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


def lint(source: str, select: list[str] | None = None, filename: str = "t.py") -> list[Diagnostic]:
    result = check_source(source, filename, select_rules(select), force=True)
    assert not result.crashes, result.crashes
    return result.diagnostics


_DEFAULT_SEVERITY = {rule.CODE: rule.SEVERITY for rule in ALL_RULES}


def fixture_line(d: Diagnostic) -> str:
    """`row:col CODE message`, with `(severity)` before the message when a finding is
    not at its rule's default severity (a rule that drops to info when unsure)."""
    shown = "" if d.severity is _DEFAULT_SEVERITY.get(d.code) else f"({d.severity.value}) "
    return f"{d.location.row}:{d.location.column} {d.code} {shown}{d.message}"


def codes(source: str, select: list[str] | None = None) -> list[str]:
    return [d.code for d in lint(source, select)]


def fix(source: str, select: list[str], unsafe: bool = False) -> str:
    """The source after one round of the selected rules' fixes."""
    from ddpify.fixes import apply_fixes

    return apply_fixes(source, lint(source, select), unsafe=unsafe)


def fix_cleanly(source: str, code: str, unsafe: bool = False) -> str:
    """`code`'s fixes applied; the result must compile and no longer report `code`."""
    fixed = fix(source, [code], unsafe=unsafe)
    compile(fixed, "fixed.py", "exec")
    assert code not in codes(fixed, [code])
    return fixed
