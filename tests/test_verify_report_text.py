"""The verify report as text: aligned columns, each repeated step named once."""

from __future__ import annotations

from ddpify.verify.compare import Finding, StepRow
from ddpify.verify.report import VerifyResult, finding_lines, render_text

LONG = "encoder.layers.11.self_attention.in_projection_weight_for_the_query"


def test_long_parameter_names_keep_the_result_column_aligned():
    result = VerifyResult(
        1,
        "mismatch",
        "gradients differ",
        steps=[
            StepRow(1, "gradients", 1e-7, 1e-7, "fc.weight", True),
            StepRow(2, "gradients", 3e-2, 5e-1, LONG, False),
            StepRow(3, "weights after step 3", 1e-7, 2e-7, "fc.bias", True, optimizer=2),
        ],
    )
    table = [line for line in render_text(result).splitlines() if line[:4].strip().isdigit()]
    header = next(line for line in render_text(result).splitlines() if "worst parameter" in line)
    column = header.index("result")
    assert [line[column:] for line in table] == ["ok", "FAIL", "ok"]
    assert LONG in table[1]


def test_a_repeated_finding_names_each_later_step_once():
    findings = [
        Finding(2, "gradient mismatch", "fc.weight", "differs"),
        Finding(2, "gradient mismatch", "fc.bias", "differs"),
        Finding(3, "gradient mismatch", "fc.weight", "differs"),
        Finding(3, "gradient mismatch", "fc.bias", "differs"),
        Finding(4, "gradient mismatch", "fc.bias", "differs"),
    ]
    [line] = finding_lines(findings)
    assert line.endswith("(again at steps 3, 4)")
