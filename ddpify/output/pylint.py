"""`path:line: [CODE] message`: pylint's parseable form, for editors' error formats."""

from __future__ import annotations

from typing import TextIO

from ddpify.diagnostics import Diagnostic


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    for d in diagnostics:
        stream.write(f"{d.filename}:{_row(d)}: [{d.code}] {d.message}\n")


def _row(d: Diagnostic) -> str:
    return f"cell {d.cell}:{d.location.row}" if d.cell is not None else str(d.location.row)
