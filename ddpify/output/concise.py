from __future__ import annotations

from typing import TextIO

from ddpify.diagnostics import Diagnostic


def line(d: Diagnostic) -> str:
    fixable = " [*]" if d.fix is not None else ""
    return f"{d.filename}:{d.position}: {d.code}{fixable} {d.message}"


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    for d in diagnostics:
        stream.write(line(d) + "\n")
