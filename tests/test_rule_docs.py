"""Every rule has one page with the fixed headings; its Example fires, Use instead does not."""

from __future__ import annotations

import pytest

from ddpify.diagnostics import FixAvailability
from ddpify.docs import HEADINGS, code_block, docs_dir, rule_page, sections
from ddpify.rules import ALL_RULES
from tests.helpers import codes


def test_pages_and_rules_match_one_to_one():
    pages = {p.stem for p in docs_dir().glob("*.md")}
    registered = {rule.CODE for rule in ALL_RULES}
    assert pages == registered


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.CODE)
def test_page_headings_in_order(rule):
    page = rule_page(rule.CODE)
    assert page.splitlines()[0] == f"# {rule.CODE} {rule.NAME}"
    found = list(sections(page))
    expected = [h for h in HEADINGS if h != "Fix safety" or rule.FIX is not FixAvailability.NEVER]
    assert found == expected


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.CODE)
def test_example_triggers_and_use_instead_does_not(rule):
    parts = sections(rule_page(rule.CODE))
    assert rule.CODE in codes(code_block(parts["Example"]), [rule.CODE])
    assert rule.CODE not in codes(code_block(parts["Use instead"]), [rule.CODE])
