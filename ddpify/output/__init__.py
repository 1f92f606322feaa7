"""Renderers: each turns a list of diagnostics into one output format."""

from __future__ import annotations

from typing import Callable, TextIO

from ddpify.diagnostics import Diagnostic
from ddpify.output import concise, full, github, json_format, json_lines, pylint, sarif

Renderer = Callable[[list[Diagnostic], TextIO], None]

RENDERERS: dict[str, Renderer] = {
    "full": full.render,
    "concise": concise.render,
    "json": json_format.render,
    "json-lines": json_lines.render,
    "sarif": sarif.render,
    "github": github.render,
    "pylint": pylint.render,
}

# Formats meant for people: they get the summary line and colours.
HUMAN_FORMATS = {"full", "concise"}
