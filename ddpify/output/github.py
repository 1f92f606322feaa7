"""GitHub Actions workflow commands: each finding becomes an annotation on the PR diff."""

from __future__ import annotations

from typing import TextIO

from ddpify.diagnostics import Diagnostic, Severity

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def line(d: Diagnostic) -> str:
    properties = {
        "file": d.filename,
        "line": d.location.row,
        "col": d.location.column,
        "endLine": d.end_location.row,
        "endColumn": d.end_location.column,
        "title": f"ddpify ({d.code})",
    }
    joined = ",".join(f"{key}={_escape_property(str(value))}" for key, value in properties.items())
    message = f"{d.filename}:{d.position}: {d.code} {d.message}"
    return f"::{_COMMAND[d.severity]} {joined}::{_escape_data(message)}"


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    for d in diagnostics:
        stream.write(line(d) + "\n")
