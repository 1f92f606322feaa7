"""SARIF 2.1.0, the format GitHub code scanning ingests: results plus rule metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from ddpify import __version__
from ddpify.diagnostics import Diagnostic, Edit, Severity
from ddpify.docs import rule_page, sections
from ddpify.engine import PARSE_ERROR_CODE, PARSE_ERROR_NAME
from ddpify.output.links import PROJECT_URL, rule_url
from ddpify.rules import ALL_RULES

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _descriptor(code: str, name: str, message: str, severity: Severity) -> dict[str, Any]:
    descriptor: dict[str, Any] = {
        "id": code,
        "name": name,
        "shortDescription": {"text": message},
        "helpUri": rule_url(code),
        "defaultConfiguration": {"level": _LEVEL[severity]},
    }
    page = rule_page(code)
    if page:
        what = sections(page).get("What it does", "").strip()
        if what:
            descriptor["fullDescription"] = {"text": what}
        descriptor["help"] = {"text": page, "markdown": page}
    return descriptor


def _descriptors() -> list[dict[str, Any]]:
    parse_error = _descriptor(
        PARSE_ERROR_CODE,
        PARSE_ERROR_NAME,
        "the file could not be read or parsed",
        Severity.ERROR,
    )
    parse_error.pop("helpUri")  # DDP000 has no page
    return [parse_error] + [
        _descriptor(rule.CODE, rule.NAME, rule.MESSAGE, rule.SEVERITY) for rule in ALL_RULES
    ]


def _uri(filename: str) -> str:
    """Relative to the working directory when inside it (what code scanning expects),
    an absolute file URI otherwise."""
    path = Path(filename)
    absolute = path.absolute()
    try:
        return quote(absolute.relative_to(Path.cwd()).as_posix())
    except ValueError:
        return absolute.as_uri()


def _region(start_row: int, start_col: int, end_row: int, end_col: int) -> dict[str, int]:
    return {
        "startLine": start_row,
        "startColumn": start_col,
        "endLine": end_row,
        "endColumn": end_col,
    }


def _replacement(edit: Edit) -> dict[str, Any]:
    return {
        "deletedRegion": _region(
            edit.location.row, edit.location.column, edit.end_location.row, edit.end_location.column
        ),
        "insertedContent": {"text": edit.content},
    }


def _result(d: Diagnostic, index: dict[str, int]) -> dict[str, Any]:
    artifact = {"uri": _uri(d.filename)}
    result: dict[str, Any] = {
        "ruleId": d.code,
        "level": _LEVEL[d.severity],
        "message": {"text": d.message},
        "locations": [
            {
                "physicalLocation": {
                    "artifactLocation": artifact,
                    "region": _region(
                        d.location.row, d.location.column, d.end_location.row, d.end_location.column
                    ),
                }
            }
        ],
    }
    if d.code in index:
        result["ruleIndex"] = index[d.code]
    if d.fix is not None:
        result["fixes"] = [
            {
                "description": {"text": f"{d.fix.message} ({d.fix.applicability.value})"},
                "artifactChanges": [
                    {
                        "artifactLocation": artifact,
                        "replacements": [_replacement(e) for e in d.fix.edits],
                    }
                ],
            }
        ]
    return result


def document(diagnostics: list[Diagnostic]) -> dict[str, Any]:
    rules = _descriptors()
    index = {rule["id"]: i for i, rule in enumerate(rules)}
    return {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "ddpify",
                        "version": __version__,
                        "informationUri": PROJECT_URL,
                        "rules": rules,
                    }
                },
                # Columns count code points, as every other ddpify output does.
                "columnKind": "unicodeCodePoints",
                "results": [_result(d, index) for d in diagnostics],
            }
        ],
    }


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    json.dump(document(diagnostics), stream, indent=2)
    stream.write("\n")
