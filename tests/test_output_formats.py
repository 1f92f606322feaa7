"""Every output format on one fixture: the same findings, in each tool's own shape."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ddpify.cli import main
from ddpify.docs import rule_page
from ddpify.output import RENDERERS
from ddpify.rules import ALL_RULES, RULES_BY_CODE

SCHEMA = Path(__file__).parent / "data" / "sarif-schema-2.1.0.json"

# A DataParallel wrap (DDP070, warning) and, where DDP043 exists, a legacy AMP scaler
# (DDP043, info, fixable): one failing finding and one advisory one with a fix.
SCRIPT = """\
import torch

model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
scaler = torch.cuda.amp.GradScaler()
"""


@pytest.fixture
def fixture_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(SCRIPT)
    return "train.py"


def run(capsys, *argv):
    code = main(["check", *argv, "--isolated"])
    out, err = capsys.readouterr()
    return code, out, err


def expected(capsys, path) -> list[tuple[str, int]]:
    """(code, row) of every finding, from the json format as the reference."""
    _, out, _ = run(capsys, path, "--output-format", "json")
    return sorted((d["code"], d["location"]["row"]) for d in json.loads(out))


def test_fixture_has_a_warning_and_an_info_finding(capsys, fixture_script):
    found = expected(capsys, fixture_script)
    assert ("DDP070", 3) in found
    if "DDP043" in RULES_BY_CODE:
        assert ("DDP043", 4) in found


def test_json_lines_is_the_json_list_one_object_per_line(capsys, fixture_script):
    _, listed, _ = run(capsys, fixture_script, "--output-format", "json")
    code, out, _ = run(capsys, fixture_script, "--output-format", "json-lines")
    assert code == 1
    assert [json.loads(line) for line in out.splitlines()] == json.loads(listed)


def test_concise_and_pylint_lines(capsys, fixture_script):
    want = expected(capsys, fixture_script)
    _, concise, _ = run(capsys, fixture_script, "--output-format", "concise")
    assert "train.py:3:9: DDP070 " in concise
    code, pylint, _ = run(capsys, fixture_script, "--output-format", "pylint")
    assert code == 1
    lines = pylint.splitlines()
    assert len(lines) == len(want)
    assert "train.py:3: [DDP070] `DataParallel` is single-process" in pylint
    parsed = sorted((line.split("[")[1].split("]")[0], int(line.split(":")[1])) for line in lines)
    assert parsed == want


def test_full_shows_source_and_summary(capsys, fixture_script):
    code, out, _ = run(capsys, fixture_script, "--output-format", "full")
    assert code == 1
    assert "3 | model = torch.nn.DataParallel(torch.nn.Linear(4, 2))" in out
    assert out.rstrip().splitlines()[-1].startswith("Checked 1 file: 0 errors, 1 warning")


def test_github_annotations(capsys, fixture_script):
    want = expected(capsys, fixture_script)
    code, out, _ = run(capsys, fixture_script, "--output-format", "github")
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == len(want)
    warning = next(line for line in lines if "DDP070" in line)
    head, message = warning.split("::", 2)[1:]
    assert head.startswith("warning file=train.py,line=3,col=9,endLine=3,endColumn=30,")
    assert "title=ddpify (DDP070)" in head
    assert message.startswith("train.py:3:9: DDP070 `DataParallel`")
    if "DDP043" in RULES_BY_CODE:
        assert any(line.startswith("::notice file=train.py,line=4,") for line in lines)


def test_github_escapes_what_would_end_a_command():
    from ddpify.diagnostics import Diagnostic, Location, Severity
    from ddpify.output.github import line

    d = Diagnostic(
        "DDP070", "n", Severity.ERROR, "50% done\nnext", "a,b:c.py", Location(1, 1), Location(1, 2)
    )
    assert line(d) == (
        "::error file=a%2Cb%3Ac.py,line=1,col=1,endLine=1,endColumn=2,"
        "title=ddpify (DDP070)::a,b:c.py:1:1: DDP070 50%25 done%0Anext"
    )


def test_sarif_is_valid_2_1_0_with_rule_metadata(capsys, fixture_script):
    want = expected(capsys, fixture_script)
    code, out, _ = run(capsys, fixture_script, "--output-format", "sarif")
    assert code == 1
    document = json.loads(out)
    jsonschema.Draft4Validator(json.loads(SCHEMA.read_text())).validate(document)
    assert document["version"] == "2.1.0"
    [run_] = document["runs"]
    rules = run_["tool"]["driver"]["rules"]
    assert {r["id"] for r in rules} >= {rule.CODE for rule in ALL_RULES}
    for rule in rules:
        if rule["id"] != "DDP000":
            assert rule["helpUri"].endswith(f"/rules/{rule['id']}.md")
            if rule_page(rule["id"]):
                assert rule["help"]["markdown"] == rule_page(rule["id"])
    results = run_["results"]
    assert (
        sorted(
            (r["ruleId"], r["locations"][0]["physicalLocation"]["region"]["startLine"])
            for r in results
        )
        == want
    )
    for result in results:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "train.py"
    levels = {r["ruleId"]: r["level"] for r in results}
    assert levels["DDP070"] == "warning"
    if "DDP043" in levels:
        assert levels["DDP043"] == "note"
        fixed = next(r for r in results if r["ruleId"] == "DDP043")
        [change] = fixed["fixes"][0]["artifactChanges"]
        assert change["replacements"][0]["deletedRegion"]["startLine"] == 4


def test_sarif_without_findings_is_still_valid(capsys, tmp_path):
    clean = tmp_path / "ok.py"
    clean.write_text("import torch\nx = torch.zeros(2)\n")
    code, out, _ = run(capsys, str(clean), "--output-format", "sarif")
    assert code == 0
    document = json.loads(out)
    jsonschema.Draft4Validator(json.loads(SCHEMA.read_text())).validate(document)
    assert document["runs"][0]["results"] == []


@pytest.mark.parametrize("fmt", sorted(RENDERERS))
def test_output_file_gets_the_report_and_stdout_stays_empty(capsys, fixture_script, fmt):
    code, out, _ = run(capsys, fixture_script, "--output-format", fmt, "--output-file", "r.txt")
    assert code == 1
    assert out == ""
    assert "DDP070" in Path("r.txt").read_text()


def test_output_file_in_a_missing_directory_is_an_error(capsys, fixture_script):
    code, _, err = run(capsys, fixture_script, "--output-file", "no/such/dir/r.txt")
    assert code == 2
    assert "cannot write no/such/dir/r.txt" in err


def test_statistics_counts_per_code(capsys, fixture_script):
    Path("more.py").write_text(SCRIPT)
    Path("third.py").write_text("import torch\nm = torch.nn.DataParallel(torch.nn.Linear(1, 1))\n")
    code, out, _ = run(capsys, ".", "--statistics", "--output-format", "concise")
    assert code == 1
    first = out.splitlines()[0].split("\t")
    assert first[:2] == ["3", "DDP070"] and first[2].endswith("dataparallel-usage")
    _, as_json, _ = run(capsys, ".", "--statistics", "--output-format", "json")
    rows = {row["code"]: row for row in json.loads(as_json)}
    assert rows["DDP070"]["count"] == 3 and rows["DDP070"]["fixable"] is False


def test_exit_zero_keeps_the_report(capsys, fixture_script):
    code, out, _ = run(capsys, fixture_script, "--exit-zero", "--output-format", "concise")
    assert code == 0
    assert "DDP070" in out


def test_exit_zero_still_fails_on_a_missing_path(capsys, fixture_script):
    code, _, _ = run(capsys, fixture_script, "missing.py", "--exit-zero")
    assert code == 2


def test_rule_listing_as_json(capsys):
    assert main(["rule", "--all", "--output-format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["code"] for r in listed] == [rule.CODE for rule in ALL_RULES]
    assert {"code", "name", "severity", "fix", "explanation"} <= set(listed[0])
