"""One JSON object per line: the `json` format's objects, streamable."""

from __future__ import annotations

import json
from typing import TextIO

from ddpify.diagnostics import Diagnostic
from ddpify.output.json_format import to_dict


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    for d in diagnostics:
        stream.write(json.dumps(to_dict(d)) + "\n")
