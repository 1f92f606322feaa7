"""Random edits through the language server's own lint (the statements an edit did not
touch kept from the last parse, their positions carried over, fixes rendered when asked)
give, after every edit, what a cold `ddpify check` of the same text gives."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from ddpify import api
from ddpify.config import Config
from ddpify.diagnostics import Diagnostic

pytest.importorskip("pygls", reason="the language server needs the `lsp` extra (pygls)")

from ddpify.lsp import DdpifyServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = [
    ROOT / "fixtures" / "examples" / "buggy_train.py",
    ROOT / "fixtures" / "clean" / "early_return_guard.py",
    ROOT / "fixtures" / "clean" / "ddp_accumulation_metrics.py",
    ROOT / "fixtures" / "rules" / "DDP040" / "nested_loops.py",
]
RULES = Config().rules()

# Lines an edit inserts, at the indentation of the line it lands on: layout, plain code,
# and statements that change findings (an unguarded save, a collective, a backward).
INDENTED = [
    "",
    "# a note",
    "pass",
    "value = 1",
    "print(value)",
    'torch.save(model.state_dict(), "model.pt")',
    "dist.barrier()",
    "loss.backward()",
    "if dist.get_rank() == 0:",
]
# Lines inserted at column 0 whatever the line: top-level code, or a dedent that splits
# (or breaks) the function it lands in.
TOP_LEVEL = ["x = 0", "# top-level note", "import os", "def helper():\n    return 1"]


class _Buffer(DdpifyServer):
    """The server linting an in-memory document, as on didChange, without a client."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.text = ""

    def document_text(self, uri: str) -> tuple[str, str]:
        return self.text, str(self.path)


def _edit(lines: list[str], rng: random.Random) -> list[str]:
    lines = list(lines)
    row = rng.randrange(len(lines) + 1)
    near = lines[min(row, len(lines) - 1)] if lines else ""
    indent = near[: len(near) - len(near.lstrip())] if near.strip() else ""
    kind = rng.choice(["insert", "insert", "top", "delete", "change", "duplicate"])
    if kind == "insert" or not lines:
        lines.insert(row, f"{indent}{rng.choice(INDENTED)}\n".replace(indent + "\n", "\n"))
    elif kind == "top":
        lines.insert(row, rng.choice(TOP_LEVEL) + "\n")
    else:
        row = min(row, len(lines) - 1)
        if kind == "delete":
            del lines[row]
        elif kind == "change":
            lines[row] = lines[row].rstrip("\n").replace("0", "2") + "  # edited\n"
        else:
            lines.insert(row, lines[row])
    return lines


def _linted(server: _Buffer, text: str) -> list[Diagnostic]:
    server.text = text
    linted = server.lint("file:///train.py")
    return [dataclasses.replace(d, fix=linted.fix(d)) for d in linted.diagnostics]


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda path: path.name)
def test_random_edits_get_what_a_cold_check_gives(fixture, tmp_path):
    rng = random.Random(fixture.name)
    path = tmp_path / "train.py"  # no pyproject.toml above it: the default settings
    server = _Buffer(path)
    lines = fixture.read_text().splitlines(keepends=True)
    assert _linted(server, "".join(lines)) == api.check_source("".join(lines), str(path), RULES)
    reused = findings = 0
    for _ in range(10):
        edited = _edit(lines, rng)
        text = "".join(edited)
        cold = api.check_source(text, str(path), RULES)
        assert _linted(server, text) == cold, text
        reused += server.reparsers["file:///train.py"].reused
        findings += len(cold)
        if not any(d.code == "DDP000" for d in cold):
            lines = edited  # else the next edit starts from the text before this one
    assert reused > 0  # the edits went through the incremental parse
    assert findings > 0
