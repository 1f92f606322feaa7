"""Engine behaviour that no single rule shows: isolation, skipping, suppression."""

from __future__ import annotations

from ddpify.diagnostics import Severity
from ddpify.engine import check_source
from ddpify.rules import RULES_BY_CODE
from ddpify.rules.base import Rule

DP = "import torch\nm = torch.nn.DataParallel(x)\n"


class Explodes(Rule):
    CODE = "DDP999"
    NAME = "always-crashes"
    SEVERITY = Severity.ERROR
    MESSAGE = "never reported"

    def visit_Call(self, node):
        self.report(node)
        raise ValueError("boom")


def test_a_crashing_rule_costs_only_itself():
    result = check_source(DP, "t.py", [Explodes, RULES_BY_CODE["DDP070"]])
    assert [d.code for d in result.diagnostics] == ["DDP070"]
    assert result.crashes == ["rule DDP999 failed: ValueError: boom"]


def test_files_that_never_mention_torch_are_not_parsed():
    result = check_source("def broken(:\n", "t.py", [RULES_BY_CODE["DDP070"]])
    assert result.skipped and result.diagnostics == []


def test_noqa_on_the_last_line_of_a_multiline_call():
    source = "import torch\nm = torch.nn.DataParallel(\n    x\n)  # noqa: DDP070\n"
    assert check_source(source, "t.py", [RULES_BY_CODE["DDP070"]]).diagnostics == []


def test_noqa_for_another_code_does_not_suppress():
    source = "import torch\nm = torch.nn.DataParallel(x)  # noqa: DDP0700\n"
    assert len(check_source(source, "t.py", [RULES_BY_CODE["DDP070"]]).diagnostics) == 1
