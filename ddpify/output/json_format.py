from __future__ import annotations

import json
from typing import Any, TextIO

from ddpify.diagnostics import Diagnostic, Location


def _location(location: Location) -> dict[str, int]:
    return {"row": location.row, "column": location.column}


def to_dict(d: Diagnostic) -> dict[str, Any]:
    fix = None
    if d.fix is not None:
        fix = {
            "message": d.fix.message,
            "applicability": d.fix.applicability.value,
            "edits": [
                {
                    "content": edit.content,
                    "location": _location(edit.location),
                    "end_location": _location(edit.end_location),
                }
                for edit in d.fix.edits
            ],
        }
    return {
        "code": d.code,
        "name": d.name,
        "severity": d.severity.value,
        "message": d.message,
        "filename": d.filename,
        "cell": d.cell,
        "location": _location(d.location),
        "end_location": _location(d.end_location),
        "fix": fix,
    }


def render(diagnostics: list[Diagnostic], stream: TextIO) -> None:
    json.dump([to_dict(d) for d in diagnostics], stream, indent=2)
    stream.write("\n")
