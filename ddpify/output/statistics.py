"""`--statistics`: how often each code fired, most frequent first."""

from __future__ import annotations

import json
from collections import Counter
from typing import TextIO

from ddpify.diagnostics import Diagnostic


def rows(diagnostics: list[Diagnostic]) -> list[dict]:
    counts = Counter(d.code for d in diagnostics)
    names = {d.code: d.name for d in diagnostics}
    fixable = {d.code for d in diagnostics if d.fix is not None}
    ordered = sorted(counts, key=lambda code: (-counts[code], code))
    return [
        {"code": code, "name": names[code], "count": counts[code], "fixable": code in fixable}
        for code in ordered
    ]


def render(diagnostics: list[Diagnostic], stream: TextIO, as_json: bool = False) -> None:
    table = rows(diagnostics)
    if as_json:
        json.dump(table, stream, indent=2)
        stream.write("\n")
        return
    width = max((len(str(row["count"])) for row in table), default=1)
    for row in table:
        mark = "[*]" if row["fixable"] else "   "
        stream.write(f"{row['count']:>{width}}\t{row['code']}\t{mark} {row['name']}\n")
