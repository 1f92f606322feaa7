"""Which loops run over epochs: the one answer (analysis/epochs.py) that the data rules,
the seeding rule and the migration's set_epoch pass read."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.epochs import epoch_loops
from ddpify.analysis.tree import Tree
from ddpify.migrate.data import _epoch_loops


def _heads(source: str, loops) -> list[str]:
    module = cst.parse_module(source)
    tree = Tree(module)
    return [module.code_for_node(loop).splitlines()[0] for loop in loops(tree)]


@pytest.mark.parametrize(
    "head",
    [
        "for epoch in range(args.epochs):",
        "for _ in range(self.num_epochs):",
        "for i, e in enumerate(range(cfg.train.max_epoch)):",
        "while epoch < max_epochs:",
        "while True:",  # its body runs `train_one_epoch()`
    ],
)
def test_epoch_loops_in_every_spelling(head):
    source = f"{head}\n    train_one_epoch(model, loader)\n    break\n"
    assert _heads(source, epoch_loops) == [head]


def test_loops_over_batches_and_steps_are_not_epoch_loops():
    source = (
        "for x, y in loader:\n    step(x, y)\n"
        "while step < max_steps:\n    step += 1\n"
        "for name, p in model.named_parameters():\n    print(name)\n"
    )
    assert _heads(source, epoch_loops) == []


def test_migrate_places_set_epoch_in_the_outermost_for_loop_of_the_same_answer():
    source = (
        "while True:\n"
        "    run_epoch()\n"
        "    for epoch in range(3):\n"
        "        for inner_epoch in range(2):\n"
        "            pass\n"
    )
    assert _heads(source, epoch_loops) == [
        "while True:",
        "for epoch in range(3):",
        "for inner_epoch in range(2):",
    ]
    assert _heads(source, _epoch_loops) == ["for epoch in range(3):"]
