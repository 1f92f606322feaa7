"""Where a rule's page can be read online (SARIF help links, LSP code descriptions)."""

from __future__ import annotations

PROJECT_URL = "https://github.com/ddpify/ddpify"
RULE_URL = PROJECT_URL + "/blob/main/rules/{code}.md"


def rule_url(code: str) -> str:
    return RULE_URL.format(code=code)
