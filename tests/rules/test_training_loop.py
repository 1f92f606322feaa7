"""Helpers of the training-loop rules, and DDP041's opt-in status."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.diagnostics import Severity
from ddpify.engine import Context, check_source
from ddpify.fixes import apply_fixes
from ddpify.rules import select_rules
from ddpify.rules.base import NodeFix, Rule
from ddpify.rules.training_loop._common import insert_before
from ddpify.rules.training_loop.ddp041_lr_not_scaled import looks_unscaled
from ddpify.rules.training_loop.ddp043_amp_legacy_api import in_compat_shim
from tests.helpers import FIXTURES, codes, lint


def _insert(source: str, target: str) -> str:
    """Insert `NEW()` above the statement whose code is `target`, through the engine."""

    class InsertNew(Rule):
        CODE, NAME, SEVERITY, MESSAGE = "DDP999", "probe", Severity.INFO, "probe"

        def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
            if self.context.code(node).strip().endswith(target):
                new = cst.SimpleStatementLine([cst.Expr(cst.parse_expression("NEW()"))])
                replacement = insert_before(list(self.context.ancestors), node, new)
                self.report(node, fix=NodeFix("insert", (replacement,)))

    result = check_source(source, "t.py", [InsertNew], force=True)
    return apply_fixes(source, result.diagnostics)


def test_insert_before_keeps_nested_indentation_and_comments():
    source = (
        "def f():\n"
        "  for x in y:  # loop\n"
        "      # about g\n"
        "      g(x)\n"
        "      if x:\n"
        "          h(x)\n"
    )
    assert _insert(source, "g(x)") == source.replace(
        "      # about g\n", "      # about g\n      NEW()\n"
    )
    assert _insert(source, "h(x)") == source.replace(
        "          h(x)", "          NEW()\n          h(x)"
    )


def test_insert_before_at_module_level():
    assert _insert("a()\nb()\n", "b()") == "a()\nNEW()\nb()\n"


@pytest.mark.parametrize(
    ("expression", "unscaled"),
    [
        ("0.1", True),
        ("3e-4", True),
        ("args.lr", True),
        ("cfg.optim.base_lr", True),
        ("config['learning_rate']", True),
        ("lr", True),
        ("args.lr * world_size", False),
        ("get_lr(cfg)", False),
        ("args.momentum", False),
        ("config[key]", False),
    ],
)
def test_looks_unscaled(expression, unscaled):
    assert looks_unscaled(cst.parse_expression(expression)) is unscaled


def _ancestors_of_call(source: str) -> list[cst.CSTNode]:
    context = Context(cst.parse_module(source))
    found = []

    class Find(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            context.ancestors.append(node)
            if isinstance(node, cst.Call) and not found:
                found.append(list(context.ancestors))
            return True

        def on_leave(self, original_node: cst.CSTNode) -> None:
            context.ancestors.pop()

    context.module.visit(Find())
    return found[0]


@pytest.mark.parametrize(
    ("source", "shim"),
    [
        ("try:\n    pass\nexcept ImportError:\n    s = make()\n", True),
        ("try:\n    s = make()\nexcept (AttributeError, TypeError):\n    pass\n", True),
        ("if hasattr(torch, 'amp'):\n    s = make()\n", True),
        ("if torch.__version__ < '2.4':\n    pass\nelse:\n    s = make()\n", True),
        ("try:\n    s = make()\nfinally:\n    cleanup\n", False),
        ("if args.amp:\n    s = make()\n", False),
    ],
)
def test_compat_shims(source, shim):
    assert in_compat_shim(_ancestors_of_call(source)) is shim


LR_SCRIPT = (
    "import torch\nimport torch.distributed as dist\n"
    "dist.init_process_group('nccl')\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
)


def test_lr_rule_is_opt_in():
    assert "DDP041" not in {rule.CODE for rule in select_rules()}
    assert "DDP041" not in codes(LR_SCRIPT)
    assert "DDP041" in codes(LR_SCRIPT, ["DDP041"])
    assert "DDP041" in {rule.CODE for rule in select_rules(extend_select=["DDP041"])}


# -- DDP040 and DDP045: what decides ----------------------------------------------------

DDP_HEAD = (
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "dist.init_process_group('nccl')\n"
    "model = DDP(net)\n"
)
ACCUMULATING_LOOP = (
    "for i, (x, y) in enumerate(loader):\n"
    "    loss = model(x).mean()\n"
    "    loss.backward()\n"
    "    if (i + 1) % args.accumulation_steps == 0:\n"
    "        optimizer.step()\n"
)


def test_accumulation_is_reported_only_with_a_ddp_wrapper_in_the_loop():
    assert codes(DDP_HEAD + ACCUMULATING_LOOP, ["DDP040"]) == ["DDP040"]
    # The loop trains another model (a discriminator, an EMA copy): DDP is not involved.
    other = ACCUMULATING_LOOP.replace("model(x)", "critic(x)")
    assert codes(DDP_HEAD + other, ["DDP040"]) == []
    # The optimizer steps every iteration: there is no accumulation.
    every_step = ACCUMULATING_LOOP.replace(
        "    if (i + 1) % args.accumulation_steps == 0:\n", "    if True:\n"
    )
    assert codes(DDP_HEAD + every_step, ["DDP040"]) == []


def test_no_sync_elsewhere_in_the_function_keeps_accumulation_quiet():
    source = DDP_HEAD + (
        "def train():\n"
        "    ctx = model.no_sync\n"
        + "".join("    " + line + "\n" for line in ACCUMULATING_LOOP.splitlines())
    )
    assert codes(source, ["DDP040"]) == []


def test_divergent_exit_severities():
    nan_break = DDP_HEAD + (
        "for x in loader:\n"
        "    loss = model(x).mean()\n"
        "    if torch.isnan(loss):\n"
        "        break\n"
        "    loss.backward()\n"
    )
    [finding] = lint(nan_break, ["DDP045"])
    assert finding.severity is Severity.ERROR and finding.location.row == 9
    early_stop = nan_break.replace("torch.isnan(loss)", "stopper.early_stop")
    [finding] = lint(early_stop, ["DDP045"])
    assert finding.severity is Severity.INFO
    # Once the script reduces something, the flag may well be agreed: silent.
    reduced = early_stop.replace("for x in loader:", "dist.all_reduce(t)\nfor x in loader:")
    assert codes(reduced, ["DDP045"]) == []


def test_rank_local_exit_without_a_following_collective_is_quiet():
    source = DDP_HEAD + (
        "def log(step, loss):\n"
        "    if dist.get_rank() != 0:\n"
        "        return\n"
        "    for name in names:\n"
        "        if name == 'stop':\n"
        "            break\n"
        "        print(step, name, loss)\n"
    )
    assert codes(source, ["DDP045"]) == []


CORRECT_DDP = FIXTURES / "clean" / "ddp_accumulation_metrics.py"

# Each mutation undoes one thing the clean script does right; the rule must notice.
MUTATIONS = [
    pytest.param(
        "DDP040",
        "with contextlib.nullcontext() if sync else model.no_sync():",
        "with contextlib.nullcontext():",
        id="DDP040-no_sync-dropped",
    ),
    pytest.param(
        "DDP042",
        "T_max=updates_per_epoch * args.epochs",
        "T_max=len(train_loader.dataset) // args.batch_size * args.epochs",
        id="DDP042-schedule-from-dataset",
    ),
    pytest.param(
        "DDP045",
        "            dist.broadcast(stop, src=0)  # every rank leaves the loop together\n"
        "            if stop.item():\n",
        "            if rank == 0 and bad_epochs >= args.patience:\n",
        id="DDP045-rank-0-breaks-alone",
    ),
    pytest.param(
        "DDP054", "    dist.all_reduce(counts)\n", "", id="DDP054-eval-counts-not-reduced"
    ),
]


@pytest.mark.parametrize(("code", "correct", "broken"), MUTATIONS)
def test_clean_script_is_quiet_until_its_safeguard_is_removed(code, correct, broken):
    source = CORRECT_DDP.read_text()
    assert correct in source
    assert code not in codes(source, [code])
    assert code in codes(source.replace(correct, broken), [code])
