"""Engine behaviour that no single rule shows: isolation, skipping, suppression."""

from __future__ import annotations

import libcst as cst

from ddpify.diagnostics import Severity
from ddpify.engine import check_source
from ddpify.fixes import apply_fixes
from ddpify.rules import RULES_BY_CODE
from ddpify.rules.base import NodeFix, Rule

DP = "import torch\nm = torch.nn.DataParallel(x)\n"


class Explodes(Rule):
    CODE = "DDP999"
    NAME = "always-crashes"
    SEVERITY = Severity.ERROR
    MESSAGE = "never reported"

    def visit_Call(self, node):
        self.report(node)
        raise ValueError("boom")


def test_a_crashing_rule_costs_only_itself():
    result = check_source(DP, "t.py", [Explodes, RULES_BY_CODE["DDP070"]])
    assert [d.code for d in result.diagnostics] == ["DDP070"]
    assert result.crashes == ["rule DDP999 failed: ValueError: boom"]


def test_files_that_never_mention_torch_are_not_parsed():
    result = check_source("def broken(:\n", "t.py", [RULES_BY_CODE["DDP070"]])
    assert result.skipped and result.diagnostics == []


def test_an_options_module_declaring_local_rank_is_checked_without_torch():
    source = 'import argparse\np = argparse.ArgumentParser()\np.add_argument("--local_rank")\n'
    result = check_source(source, "opts.py", [RULES_BY_CODE["DDP003"]])
    assert not result.skipped
    assert [d.code for d in result.diagnostics] == ["DDP003"]


def test_noqa_on_the_last_line_of_a_multiline_call():
    source = "import torch\nm = torch.nn.DataParallel(\n    x\n)  # noqa: DDP070\n"
    assert check_source(source, "t.py", [RULES_BY_CODE["DDP070"]]).diagnostics == []


def test_noqa_for_another_code_does_not_suppress():
    source = "import torch\nm = torch.nn.DataParallel(x)  # noqa: DDP0700\n"
    assert len(check_source(source, "t.py", [RULES_BY_CODE["DDP070"]]).diagnostics) == 1


class InsertSetEpoch(Rule):
    """Test-only: insert a statement at the top of every `for epoch` body."""

    CODE = "DDP998"
    NAME = "probe"
    SEVERITY = Severity.INFO
    MESSAGE = "probe"

    def visit_For(self, node):
        body = node.body
        call = cst.parse_statement("sampler.set_epoch(epoch)\n")
        new = body.with_changes(body=[call, *body.body])
        self.report(node, fix=NodeFix("insert", ((body, new),)))


def test_a_fix_deep_in_a_block_is_rendered_at_the_block_indentation():
    source = (
        "import torch\n"
        "\n"
        "@decorated\n"
        "def main():\n"
        "    if True:\n"
        "        for epoch in range(3):  # loop\n"
        "            loss = step(\n"
        "                epoch,\n"
        "            )\n"
    )
    [diagnostic] = check_source(source, "t.py", [InsertSetEpoch]).diagnostics
    assert diagnostic.fix.edits[0].location.row == 7
    assert apply_fixes(source, [diagnostic]) == source.replace(
        "  # loop\n", "  # loop\n            sampler.set_epoch(epoch)\n"
    )


def test_fix_in_the_last_statement_of_a_crlf_file_with_trailing_comments():
    source = "import torch\r\n\r\n# before\r\nfor epoch in range(3):\r\n    step()\r\n"
    source += "# the end\r\n\r\n"
    [diagnostic] = check_source(source, "t.py", [InsertSetEpoch]).diagnostics
    assert apply_fixes(source, [diagnostic]) == source.replace(
        "range(3):\r\n", "range(3):\r\n    sampler.set_epoch(epoch)\r\n"
    )


# The node classes that hot per-node helpers test by exact type (`type(x) is cst.Call`)
# instead of isinstance, which is slow against libcst's ABCs: exact and isinstance tests
# agree only while libcst has no subclass of them.
EXACTLY_TESTED = (
    cst.Attribute,
    cst.BooleanOperation,
    cst.Break,
    cst.Call,
    cst.For,
    cst.FunctionDef,
    cst.If,
    cst.IfExp,
    cst.IndentedBlock,
    cst.Module,
    cst.Name,
    cst.Return,
    cst.Subscript,
    cst.Try,
    cst.While,
)


def _render_only_subclasses() -> set[type]:
    """Subclasses that exist only inside one render call and are never part of a tree
    the analysis reads: migrate's codegen hands `_CachingBlock` (an IndentedBlock that
    reuses kept statements' code) to libcst's code generator and drops it after."""
    from ddpify.codegen import _CachingBlock

    return {_CachingBlock}


def test_classes_tested_by_exact_type_have_no_subclasses():
    allowed = _render_only_subclasses()
    found = {
        cls.__name__: [sub for sub in cls.__subclasses__() if sub not in allowed]
        for cls in EXACTLY_TESTED
    }
    assert found == {cls.__name__: [] for cls in EXACTLY_TESTED}


def test_migrated_trees_hold_no_render_only_block(monkeypatch):
    """The render-only block never reaches a tree: every Tree migrate builds while it
    converts a fixture (its passes', its gates') holds only libcst's own IndentedBlock."""
    from ddpify.analysis import tree as tree_module
    from ddpify.migrate import migrate_source
    from ddpify.walk import subtree
    from tests.helpers import FIXTURES

    built = []
    original = tree_module.Tree.__init__

    def spy(self, module, *args, **kwargs):
        built.append(module)
        original(self, module, *args, **kwargs)

    monkeypatch.setattr(tree_module.Tree, "__init__", spy)
    text = (FIXTURES / "migrate" / "single_trainer_class" / "before.py").read_text()
    result = migrate_source(text, "before.py")
    assert result.migrated, result.reason
    assert len(built) > 3
    blocks = [n for m in built for n in subtree(m) if isinstance(n, cst.IndentedBlock)]
    assert blocks and all(type(n) is cst.IndentedBlock for n in blocks)
