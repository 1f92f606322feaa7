"""Every `fixtures/rules/<CODE>/<case>.py` yields exactly the lines of `<case>.txt`.

A case file holds true positives in several spellings and true negatives; its `.txt`
lists the expected findings of that one rule as `line:col CODE message` (empty: none),
with `(severity)` before the message when a finding is not at its rule's default.
Set DDPIFY_UPDATE_FIXTURES=1 to rewrite the `.txt` files, then review the diff.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import FIXTURES, fixture_line, lint

CASES = sorted((FIXTURES / "rules").glob("DDP*/*.py"))


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_rule_fixture(case):
    code = case.parent.name
    found = [fixture_line(d) for d in lint(case.read_text(), [code], filename=str(case))]
    expected_file = case.with_suffix(".txt")
    if os.environ.get("DDPIFY_UPDATE_FIXTURES"):
        expected_file.write_text("".join(line + "\n" for line in found))
    expected = expected_file.read_text().splitlines()
    assert found == expected


def test_every_rule_has_positive_and_negative_fixtures():
    from ddpify.rules import ALL_RULES

    for rule in ALL_RULES:
        texts = [p.read_text() for p in (FIXTURES / "rules" / rule.CODE).glob("*.txt")]
        assert any(t.strip() for t in texts), f"{rule.CODE} has no true-positive fixture"
        assert any(not t.strip() for t in texts), f"{rule.CODE} has no true-negative fixture"
