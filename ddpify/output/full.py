"""ruff-style output: the finding, then the offending lines with the span underlined."""

from __future__ import annotations

from typing import TextIO

from rich.console import Console
from rich.text import Text

from ddpify.diagnostics import Diagnostic, Severity

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow", Severity.INFO: "bold blue"}
_CONTEXT_LINES = 4


def _snippet(d: Diagnostic) -> list[Text]:
    lines = list(d.source_lines[:_CONTEXT_LINES])
    if not lines:
        return []
    width = len(str(d.location.row + len(lines) - 1))
    gutter = " " * width + " |"
    out = [Text(gutter, style="blue")]
    for offset, source in enumerate(lines):
        row = d.location.row + offset
        text = Text(f"{row:>{width}} | ", style="blue")
        text.append(source.rstrip("\r\n").expandtabs(4))
        out.append(text)
    first = lines[0]
    start = d.location.column - 1
    end = d.end_location.column - 1 if d.end_location.row == d.location.row else len(first)
    marker = Text(gutter + " ", style="blue")
    marker.append(" " * len(first[:start].expandtabs(4)))
    marker.append("^" * max(1, len(first[start:end].expandtabs(4))), style=_STYLE[d.severity])
    marker.append(f" {d.code}", style=_STYLE[d.severity])
    out.append(marker)
    out.append(Text(gutter, style="blue"))
    return out


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    console = Console(file=stream, highlight=False, soft_wrap=True)
    for d in diagnostics:
        head = Text(f"{d.filename}:{d.position}: ", style="bold")
        head.append(d.code, style=_STYLE[d.severity])
        if d.fix is not None:
            head.append(" [*]", style="cyan")
        head.append(f" {d.message}")
        head.append(f" ({d.severity.value})", style="dim")
        console.print(head)
        for line in _snippet(d):
            console.print(line)
        if d.fix is not None:
            label = "fix" if d.fix.applicability.value == "safe" else "unsafe fix"
            console.print(Text(f"  = {label}: {d.fix.message}", style="cyan"))
        console.print()
