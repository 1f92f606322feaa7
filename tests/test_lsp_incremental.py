"""The language server reuses what an edit did not touch (the parse, the fixes it has not
been asked for, ...): after every edit of a session its diagnostics and quick fixes must
be what a cold `ddpify check` of the same text gives."""

from __future__ import annotations

import dataclasses
import pickle
import random
from pathlib import Path

import pytest

from ddpify import engine
from ddpify.config import Config
from ddpify.diagnostics import Diagnostic, Location
from ddpify.reparse import Reparser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "fixtures" / "examples" / "buggy_train.py"
RULES = Config().rules()

# A clean script whose findings depend on other top-level statements: the guard is a
# helper defined above `main`, the sampler is built in another function.
SCRIPT = """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def should_write():
    return dist.get_rank() == 0


def build_loader():
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = DistributedSampler(data)
    return DataLoader(data, batch_size=32, sampler=sampler), sampler


def train_epoch(model, loader, optimizer):
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    loader, sampler = build_loader()
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        loss = train_epoch(model, loader, optimizer)
        if should_write():
            print(f"epoch {epoch}: {loss:.3f} on {local_rank}")
            torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

# (old, new, codes that must then be reported, codes that must not), applied in turn.
EDITS = [
    ("from torch.utils", "# data\n\n\nfrom torch.utils", set(), {"DDP050"}),
    # The guard's helper stops testing the rank: the save in `main` (another statement).
    ("return dist.get_rank() == 0", "return epoch_ok()", {"DDP050"}, set()),
    ("return epoch_ok()", "return dist.get_rank() == 0", set(), {"DDP050"}),
    ("        sampler.set_epoch(epoch)\n", "", {"DDP022"}, set()),
    ("model.module.state_dict()", "model.state_dict()", {"DDP022", "DDP051"}, set()),
    # Lines inserted above the findings, inside `main` and above it.
    ("    for epoch", "    steps = 0\n    # epochs\n    for epoch", {"DDP051"}, set()),
    ("def main():", "WIDTH = 8\n\n\ndef main():", {"DDP051"}, set()),
    ('"model.pt")', '"model.pt")  # noqa: DDP051', {"DDP022"}, {"DDP051"}),
    ("for x, y in loader:", "for x, y in loader", {"DDP000"}, set()),
    ("for x, y in loader\n", "for x, y in loader:\n", {"DDP022"}, {"DDP000"}),
    (
        "loader, sampler = build_loader()",
        "loader, sampler = build_loader()\n    sampler.set_epoch(0)",
        set(),
        {"DDP022"},
    ),
    ("batch_size=32, sampler", "batch_size=32, shuffle=True, sampler", {"DDP021"}, set()),
    # The model renamed where it is wrapped: the wrapper's findings follow the new name.
    ("    model = DDP(", "    net = DDP(", set(), set()),
    ("main()\n", "main()\n# the end\n", set(), set()),
]


def _bare(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    return [dataclasses.replace(d, fix=None) for d in diagnostics]


@pytest.mark.parametrize("path", [EXAMPLE, ROOT / "fixtures" / "rules" / "DDP043"])
def test_fixes_rendered_when_asked_are_the_fixes_a_check_renders(path):
    files = [path] if path.is_file() else sorted(path.glob("*.py"))
    checked = 0
    for file in files:
        text = file.read_text()
        eager = engine.check_source(text, str(file), RULES, force=True)
        lazy = engine.check_source(text, str(file), RULES, force=True, fixes=False)
        assert all(d.fix is None for d in lazy.diagnostics)
        assert lazy.diagnostics == _bare(eager.diagnostics)
        assert [lazy.pending_fixes.fix(d) for d in lazy.diagnostics] == [
            d.fix for d in eager.diagnostics
        ]
        checked += sum(d.fix is not None for d in eager.diagnostics)
    assert checked >= 3


def test_pending_fixes_leave_a_forked_child_rendered():
    """A risky file is linted in a forked child (guarded.py): its fixes come back rendered."""
    text = EXAMPLE.read_text()
    lazy = engine.check_source(text, str(EXAMPLE), RULES, force=True, fixes=False)
    eager = engine.check_source(text, str(EXAMPLE), RULES, force=True)
    copied = pickle.loads(pickle.dumps(lazy.pending_fixes))
    assert [copied.fix(d) for d in lazy.diagnostics] == [d.fix for d in eager.diagnostics]


def _lint_incrementally(reparser: Reparser, text: str, path: Path) -> list[Diagnostic]:
    """What the language server does on each edit; fixes rendered as a check renders them."""
    found = engine.check_source(
        text,
        str(path),
        RULES,
        force=True,
        parser=reparser.parse,
        fixes=False,
        positions=reparser.positions,
    )
    return [
        dataclasses.replace(d, fix=found.pending_fixes.fix(d) if found.pending_fixes else None)
        for d in found.diagnostics
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_line_edits_keep_positions_and_fixes_of_a_cold_check(seed):
    """Lines inserted, deleted and changed above, inside and below findings: positions
    carried over from the last lint must be the ones a cold check computes."""
    rng = random.Random(seed)
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    reparser = Reparser()
    carried = 0
    for _ in range(12):
        row = rng.randrange(len(lines))
        indent = lines[row][: len(lines[row]) - len(lines[row].lstrip())]
        kind = rng.choice(["insert", "insert", "delete", "comment"])
        if kind == "insert":
            lines.insert(row, rng.choice(["\n", f"{indent}# a note\n", f"{indent}pass\n"]))
        elif kind == "delete" and (lines[row].strip() in ("", "pass") or "# a note" in lines[row]):
            del lines[row]
        else:
            lines[row] = lines[row].rstrip("\n") + "  # edited\n"
        text = "".join(lines)
        got = _lint_incrementally(reparser, text, EXAMPLE)
        assert got == engine.check_source(text, str(EXAMPLE), RULES).diagnostics
        positions = reparser._positions
        if positions is not None and positions.module is reparser.module:
            carried += sum(len(found) for found in positions.carried.values())
            # Found statement by statement, never by the whole-module fallback.
            assert positions._whole is None
    assert carried > 0  # the positions of untouched statements came from the last lint


# -- a language-server session ----------------------------------------------------------


def _lsp_range(start, end) -> dict:
    # ASCII text: code-point columns are UTF-16 units.
    return {
        "start": {"line": start.row - 1, "character": start.column - 1},
        "end": {"line": end.row - 1, "character": end.column - 1},
    }


def _cold(text: str, path: Path) -> list[Diagnostic]:
    return engine.check_source(text, str(path), RULES).diagnostics


def _published_form(diagnostics: list[Diagnostic]) -> list[tuple]:
    return sorted(
        (str(_lsp_range(d.location, d.end_location)), d.code, d.message) for d in diagnostics
    )


def _fix_form(diagnostics: list[Diagnostic]) -> list[tuple]:
    return sorted(
        (
            d.code,
            str(_lsp_range(d.location, d.end_location)),
            tuple((str(_lsp_range(e.location, e.end_location)), e.content) for e in d.fix.edits),
        )
        for d in diagnostics
        if d.fix is not None
    )


def test_every_edit_of_a_session_gets_what_a_cold_check_gives(tmp_path):
    pytest.importorskip("pygls", reason="the language server needs the `lsp` extra (pygls)")
    from tests.test_lsp import start_server

    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    uri = path.as_uri()
    client = start_server(tmp_path)
    try:
        text = SCRIPT
        client.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}},
        )
        published = client.wait_for("textDocument/publishDiagnostics", lambda p: p["uri"] == uri)
        assert published["diagnostics"] == []
        for version, (old, new, present, absent) in enumerate(EDITS, start=2):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
            client.notify(
                "textDocument/didChange",
                {
                    "textDocument": {"uri": uri, "version": version},
                    "contentChanges": [{"text": text}],
                },
            )
            published = client.wait_for(
                "textDocument/publishDiagnostics", lambda p: p["uri"] == uri
            )
            cold = _cold(text, path)
            codes = {d.code for d in cold}
            assert present <= codes and not absent & codes, (new, codes)
            got = sorted(
                (str(d["range"]), d["code"], d["message"]) for d in published["diagnostics"]
            )
            assert got == _published_form(cold), new
            # The quick fixes offered over the whole document: the fixes a check renders.
            actions = client.request(
                "textDocument/codeAction",
                {
                    "textDocument": {"uri": uri},
                    "range": _lsp_range(Location(1, 1), Location(999, 1)),
                    "context": {"diagnostics": [], "only": ["quickfix"]},
                },
            )
            offered = sorted(
                (
                    a["diagnostics"][0]["code"],
                    str(a["diagnostics"][0]["range"]),
                    tuple((str(e["range"]), e["newText"]) for e in a["edit"]["changes"][uri]),
                )
                for a in actions
            )
            assert offered == _fix_form(cold), new
    finally:
        assert client.close() == 0
