"""The original as the conversion meant it: with the migration's number-changing fixes applied.

A migration fixes some bugs that change the numbers: `scaler.unscale_()` before
`clip_grad_norm_` (DDP044) makes the clip see true gradients, `sampler.set_epoch(epoch)`
(DDP022) reshuffles every epoch. Compared with the unfixed original, a right conversion
would differ, and the difference would be blamed on it. So verify runs the original with
the same fixes, made by ddpify's own rule fixes (the ones `ddpify check --fix` applies) on a
temporary copy, and says so.

Which fixes: the codes the migration's record says it fixed (`MigrationResult.fixed_codes`;
for `ddpify verify` on two files, the migration of the original is recomputed in memory),
among those that change the numbers, whose rule reports the original and no longer
reports the converted script: a hand-made conversion that kept the bug is compared with
the original as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# The fixes that change what a script computes (the others move code, rename or guard I/O).
NUMERIC_FIXES = {
    "DDP044": "scaler.unscale_() before gradient clipping",
    "DDP022": "sampler.set_epoch(epoch) at the start of each epoch",
}


@dataclass
class OriginalFixes:
    text: str  # the original's text with the fixes applied (unchanged when none)
    applied: list[str] = field(default_factory=list)  # "DDP044 at line 32: ..." per fix
    not_applied: list[str] = field(default_factory=list)  # fixed by the migration, no fix here

    @property
    def changed(self) -> bool:
        return bool(self.applied)


def migration_fixed_codes(original_text: str, filename: str) -> set[str]:
    """The codes `ddpify migrate` fixes in this script, from its own record; empty if it
    cannot migrate it."""
    try:
        from ddpify.migrate.pipeline import migrate_source

        return migrate_source(original_text, filename).fixed_codes
    except Exception:  # noqa: BLE001 - a script migrate refuses has no record of fixes
        return set()


def reported_codes(text: str, filename: str, codes: Iterable[str]) -> set[str]:
    from ddpify.engine import check_source

    wanted = set(codes)
    rules = [rule for rule in all_rules() if rule.CODE in wanted]
    found = check_source(text, filename, rules, force=True).diagnostics
    return {d.code for d in found if d.code in wanted}


def all_rules():
    from ddpify.rules import ALL_RULES

    return ALL_RULES


def fix_original(
    original_text: str,
    converted_text: str | None,
    filename: str,
    fixed_codes: Iterable[str] | None = None,
) -> OriginalFixes:
    """The original with the number-changing fixes the conversion made; see the module doc."""
    from ddpify.engine import check_source
    from ddpify.fixes import fix_until_stable
    from ddpify.gates import GateError

    record = migration_fixed_codes(original_text, filename) if fixed_codes is None else fixed_codes
    codes = set(record) & set(NUMERIC_FIXES)
    if codes:
        codes &= reported_codes(original_text, filename, codes)
    if converted_text is not None and codes:
        codes -= reported_codes(converted_text, filename, codes)
    result = OriginalFixes(original_text)
    if not codes:
        return result
    rules = [rule for rule in all_rules() if rule.CODE in codes]

    def lint(text: str):
        return check_source(text, filename, rules, force=True).diagnostics

    try:
        outcome = fix_until_stable(original_text, lint, filename=filename)
    except GateError:
        outcome = None
    fixed = outcome.fixed if outcome is not None else []
    for diagnostic in fixed:
        result.applied.append(
            f"{diagnostic.code} at line {diagnostic.location.row}: {NUMERIC_FIXES[diagnostic.code]}"
        )
    if fixed:
        result.text = outcome.text
    done = {d.code for d in fixed}
    result.not_applied = [f"{code}: {NUMERIC_FIXES[code]}" for code in sorted(codes - done)]
    return result
