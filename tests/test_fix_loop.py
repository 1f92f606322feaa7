"""`ddpify check --fix`: real fixes compile, settle, keep comments, honour noqa, keep bytes.

The real fixable rule used is DDP043 (legacy `torch.cuda.amp` spellings); the loop's own
guarantees (whole fixes only, bounded rounds, the compile gate, unsafe fixes) are shown
with synthetic findings and a test-only rule, since no real rule misbehaves on purpose.
"""

from __future__ import annotations

import libcst as cst
import pytest

import ddpify.rules
from ddpify.cli import main
from ddpify.diagnostics import (
    Applicability,
    Diagnostic,
    Edit,
    Fix,
    FixAvailability,
    Location,
    Severity,
)
from ddpify.engine import check_source
from ddpify.fixes import MAX_ROUNDS, apply_fixes, compatible_fixes, fix_until_stable
from ddpify.gates import GateError
from ddpify.rules import RULES_BY_CODE, select_rules
from ddpify.rules.base import NodeFix, Rule

LEGACY_AMP = """\
import torch

# The scaler keeps fp16 gradients from underflowing.
scaler = torch.cuda.amp.GradScaler()  # created once


def train_step(model, batch, optimizer):
    # forward in mixed precision
    with torch.cuda.amp.autocast():
        loss = model(batch).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""


needs_ddp043 = pytest.mark.skipif(
    "DDP043" not in RULES_BY_CODE or RULES_BY_CODE["DDP043"].FIX is FixAvailability.NEVER,
    reason="the fixable rule DDP043 is not registered",
)


def lint_with(codes):
    rules = select_rules(codes)

    def lint(text):
        return check_source(text, "train.py", rules).diagnostics

    return lint


def comments(text: str) -> list[str]:
    return [line[line.index("#") :] for line in text.splitlines() if "#" in line]


@needs_ddp043
def test_fixed_output_compiles_settles_and_keeps_comments():
    lint = lint_with(["DDP043"])
    assert [d.code for d in lint(LEGACY_AMP)].count("DDP043") == 2
    outcome = fix_until_stable(LEGACY_AMP, lint)
    assert len(outcome.fixed) == 2
    assert outcome.remaining == []
    compile(outcome.text, "train.py", "exec")
    assert "torch.cuda.amp" not in outcome.text
    assert comments(outcome.text) == comments(LEGACY_AMP)
    again = fix_until_stable(outcome.text, lint)
    assert again.text == outcome.text and not again.fixed


@needs_ddp043
def test_cli_fix_rewrites_in_place_and_a_second_run_changes_nothing(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(LEGACY_AMP)
    assert main(["check", str(script), "--fix", "--select", "DDP043"]) == 0
    out = capsys.readouterr().out
    assert "Fixed 2 findings, 0 remaining." in out
    fixed = script.read_text()
    assert fixed != LEGACY_AMP and comments(fixed) == comments(LEGACY_AMP)
    assert main(["check", str(script), "--fix", "--select", "DDP043"]) == 0
    assert "Fixed 0 findings, 0 remaining." in capsys.readouterr().out
    assert script.read_text() == fixed


@needs_ddp043
def test_noqa_line_is_not_fixed(tmp_path, capsys):
    source = LEGACY_AMP.replace("GradScaler()  # created once", "GradScaler()  # noqa: DDP043")
    script = tmp_path / "train.py"
    script.write_text(source)
    main(["check", str(script), "--fix", "--select", "DDP043"])
    fixed = script.read_text()
    assert "scaler = torch.cuda.amp.GradScaler()  # noqa: DDP043" in fixed
    assert "with torch.cuda.amp.autocast()" not in fixed
    assert "Fixed 1 finding, 0 remaining." in capsys.readouterr().out


@needs_ddp043
def test_diff_shows_the_fix_and_writes_nothing(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(LEGACY_AMP)
    code = main(["check", str(script), "--diff", "--select", "DDP043"])
    out, err = capsys.readouterr()
    assert code == 1
    assert f"--- a/{script}" in out
    assert "-scaler = torch.cuda.amp.GradScaler()  # created once" in out
    assert any(line.startswith("+scaler = torch.amp") for line in out.splitlines())
    assert "Would fix 2 findings" in err
    assert script.read_text() == LEGACY_AMP


@needs_ddp043
def test_fix_keeps_bom_crlf_and_declared_encoding(tmp_path):
    crlf = tmp_path / "crlf.py"
    crlf.write_bytes(b"\xef\xbb\xbf" + LEGACY_AMP.replace("\n", "\r\n").encode())
    latin = tmp_path / "latin.py"
    latin.write_bytes(("# -*- coding: latin-1 -*-\n# Déjà vu\n" + LEGACY_AMP).encode("latin-1"))
    latin.chmod(0o754)
    main(["check", str(crlf), str(latin), "--fix", "--select", "DDP043", "-q"])
    data = crlf.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf")
    assert b"torch.cuda.amp" not in data
    assert data.count(b"\r\n") == LEGACY_AMP.count("\n") and b"\n" not in data.replace(b"\r\n", b"")
    text = latin.read_bytes().decode("latin-1")
    assert "# Déjà vu" in text and "torch.cuda.amp" not in text
    assert latin.stat().st_mode & 0o777 == 0o754


# --- the loop's guarantees, shown with synthetic findings ---------------------------


def finding(code: str, *edits: tuple[int, int, int, int, str]) -> Diagnostic:
    built = tuple(Edit(text, Location(r1, c1), Location(r2, c2)) for r1, c1, r2, c2, text in edits)
    loc = built[0].location
    return Diagnostic(
        code, "test", Severity.WARNING, "m", "t.py", loc, loc, Fix("fix", Applicability.SAFE, built)
    )


def test_a_fix_that_overlaps_an_earlier_one_is_left_out_whole():
    text = "aaaa\nbbbb\ncccc\n"
    first = finding("DDP901", (1, 1, 1, 3, "X"), (2, 1, 2, 3, "Y"))
    # Its second edit collides with `first`; its first edit alone would apply cleanly.
    second = finding("DDP902", (3, 1, 3, 2, "Z"), (2, 2, 2, 4, "W"))
    assert compatible_fixes(text, [second, first]) == [first]
    assert apply_fixes(text, [first, second]) == "Xaa\nYbb\ncccc\n"


def test_the_loop_gives_up_after_the_round_limit():
    def lint(text):  # every round finds something new to "fix"
        return [finding("DDP903", (1, 1, 1, 1, "_ = 0\n"))]

    with pytest.raises(GateError) as raised:
        fix_until_stable("x = 1\n", lint)
    assert "DDP903" in str(raised.value)
    assert f"after {MAX_ROUNDS} rounds" in str(raised.value)


def test_a_fix_whose_output_does_not_compile_is_refused():
    def lint(text):
        return [finding("DDP904", (1, 1, 1, 2, "def"))] if text.startswith("x") else []

    with pytest.raises(GateError) as raised:
        fix_until_stable("x = 1\n", lint)
    assert raised.value.pass_name == "fix DDP904"
    assert "does not compile" in raised.value.reason


# --- through the CLI, with a test-only rule ----------------------------------------


class BreakingRule(Rule):
    """Test-only: `torch.magic()` -> `def()`, a fix that cannot compile."""

    CODE = "DDP097"
    NAME = "test-breaking-fix"
    SEVERITY = Severity.WARNING
    MESSAGE = "test rule"
    FIX = FixAvailability.ALWAYS

    def visit_Call(self, node: cst.Call) -> None:
        if self.context.code(node.func) == "torch.magic":
            self.report(node, fix=NodeFix("break it", ((node.func, cst.Name("def")),)))


class UnsafeRule(Rule):
    """Test-only: `torch.magic()` -> `torch.spell()`, marked unsafe."""

    CODE = "DDP098"
    NAME = "test-unsafe-fix"
    SEVERITY = Severity.WARNING
    MESSAGE = "test rule"
    FIX = FixAvailability.ALWAYS

    def visit_Call(self, node: cst.Call) -> None:
        if self.context.code(node.func) == "torch.magic":
            new = cst.Attribute(cst.Name("torch"), cst.Name("spell"))
            fix = NodeFix("rename", ((node.func, new),), Applicability.UNSAFE)
            self.report(node, fix=fix)


@pytest.fixture
def register(monkeypatch):
    def _register(rule):
        monkeypatch.setattr(ddpify.rules, "ALL_RULES", [*ddpify.rules.ALL_RULES, rule])
        monkeypatch.setitem(RULES_BY_CODE, rule.CODE, rule)

    return _register


MAGIC = "import torch\n\ntorch.magic()  # a comment\n"


def test_cli_leaves_the_file_alone_when_a_fix_fails_a_gate(tmp_path, capsys, register):
    register(BreakingRule)
    script = tmp_path / "t.py"
    script.write_text(MAGIC)
    code = main(["check", str(script), "--fix", "--select", "DDP097"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fix DDP097" in err and "left unchanged" in err
    assert script.read_text() == MAGIC


def test_unsafe_fixes_need_the_flag_or_the_setting(tmp_path, capsys, register):
    register(UnsafeRule)
    script = tmp_path / "t.py"
    script.write_text(MAGIC)
    assert main(["check", str(script), "--fix", "--select", "DDP098", "--isolated"]) == 1
    assert script.read_text() == MAGIC
    assert main(["check", str(script), "--fix", "--unsafe-fixes", "--select", "DDP098"]) == 0
    assert script.read_text() == "import torch\n\ntorch.spell()  # a comment\n"

    script.write_text(MAGIC)
    (tmp_path / "ddpify.toml").write_text("unsafe-fixes = true\n")
    assert main(["check", str(script), "--fix", "--select", "DDP098"]) == 0
    assert "torch.spell()" in script.read_text()
    script.write_text(MAGIC)
    assert main(["check", str(script), "--fix", "--no-unsafe-fixes", "--select", "DDP098"]) == 1
    assert script.read_text() == MAGIC
    capsys.readouterr()


def test_a_fix_that_drops_a_comment_is_refused():
    def lint(text):  # "fixes" `x = 1  # keep me` by rewriting the whole line
        return [finding("DDP905", (1, 1, 1, 17, "x = 2"))] if "x = 1" in text else []

    with pytest.raises(GateError) as raised:
        fix_until_stable("x = 1  # keep me\n", lint)
    assert raised.value.pass_name == "fix DDP905"
    assert "# keep me" in raised.value.reason
