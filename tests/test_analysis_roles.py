"""The roles analysis as both consumers read it: the rules (through `Context.tree`) and
the migration passes ask the same functions, so one answer serves both."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.roles import (
    backward_units,
    distributed_sampler_value,
    is_optimizer,
    iterable_dataset_classes,
    optimizer_names,
    training_loops,
)
from ddpify.analysis.tree import Tree
from ddpify.migrate import Options, migrate_source


@pytest.mark.parametrize(
    "name",
    ["torch.optim.SGD", "torch.optim.AdamW", "torch.optim.adamw.AdamW", "torch.optim.LBFGS"],
)
def test_torch_optimizers_are_optimizers(name):
    assert is_optimizer(name)


@pytest.mark.parametrize(
    "name",
    [
        "torch.optim.lr_scheduler.StepLR",
        "torch.optim.swa_utils.AveragedModel",
        "torch.optim.swa_utils.SWALR",
        "torch.optim.Optimizer",
        "torch.nn.Linear",
        None,
    ],
)
def test_schedulers_swa_helpers_and_the_base_class_are_not(name):
    assert not is_optimizer(name)


SWA = """\
import torch
import torch.nn as nn
from torch.optim.swa_utils import SWALR, AveragedModel
from torch.utils.data import DataLoader, TensorDataset


def main():
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    swa_model = AveragedModel(model)
    swa_scheduler = SWALR(optimizer, 0.05)
    for epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        swa_model.update_parameters(model)
        swa_scheduler.step()


if __name__ == "__main__":
    main()
"""


def test_an_averaged_model_is_no_optimizer():
    assert optimizer_names(Tree(cst.parse_module(SWA))) == {"optimizer"}


def test_migrate_asks_to_scale_the_swa_learning_rate_like_the_optimizers():
    result = migrate_source(SWA, "train.py", Options())
    notes = [item.why for item in result.needs_human]
    assert any("SWALR sets the learning rate itself; scale its swa_lr" in n for n in notes)
    assert not any("AveragedModel" in n for n in notes)
    assert "lr=0.1 * WORLD_SIZE" in result.output


STEP_HELPER = """\
def train_step(model, x, y):
    loss = model(x).sub(y).pow(2).mean()
    loss.backward()


for x, y in loader:
    train_step(model, x, y)
    optimizer.step()

while step < max_steps:
    for micro in range(accum):
        model(next(batches)).mean().backward()
    step += 1
"""


def test_backward_units_are_the_innermost_body_and_training_loops_follow_helpers():
    module = cst.parse_module(STEP_HELPER)
    tree = Tree(module)
    heads = [module.code_for_node(unit).lstrip().splitlines()[0] for unit in backward_units(tree)]
    assert heads == ["def train_step(model, x, y):", "for micro in range(accum):"]
    loops = [module.code_for_node(loop).lstrip().splitlines()[0] for loop in training_loops(tree)]
    assert loops == ["for micro in range(accum):", "for x, y in loader:"]


def test_the_rules_tree_is_the_tree_migrate_reads():
    """`Context.tree`, made from the engine's walk, holds what `Tree(module)` holds."""
    from ddpify.engine import run_rules
    from ddpify.rules.base import Rule

    seen = []

    class Probe(Rule):
        CODE, NAME = "DDP999", "probe"

        def leave_Module(self, node: cst.Module) -> None:
            seen.append(self.context.tree)

    module = cst.parse_module(STEP_HELPER + SWA)
    run_rules(module, [Probe])
    fresh = Tree(module)
    assert seen[0].nodes == fresh.nodes
    assert seen[0].parent == fresh.parent
    assert seen[0].imports.aliases == fresh.imports.aliases
    assert seen[0].find(cst.Call) == fresh.find(cst.Call)
    assert backward_units(seen[0]) == backward_units(fresh)


ITERABLES = """\
import datasets
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.datapipes.datapipe import IterDataPipe


class Shards(IterableDataset):
    pass


class LocalShards(Shards):
    pass


class Lines(IterDataPipe):
    pass


class Hub(datasets.IterableDataset):
    pass


class Images(Dataset):
    pass
"""


def test_iterable_dataset_classes_one_answer_for_rules_and_migrate():
    tree = Tree(cst.parse_module(ITERABLES))
    assert iterable_dataset_classes(tree) == {"Shards", "LocalShards", "Lines", "Hub"}


SAMPLERS = """\
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

a = DataLoader(ds, sampler=DistributedSampler(ds))
s = None if single else DistributedSampler(ds)
b = DataLoader(ds, sampler=s)
c = DataLoader(ds, sampler=RandomSampler(ds))
x = y
y = x
d = DataLoader(ds, sampler=x)
"""


def test_the_distributed_sampler_behind_a_loaders_sampler_argument():
    module = cst.parse_module(SAMPLERS)
    tree = Tree(module)
    found = {}
    for call in tree.calls_to("torch.utils.data.DataLoader"):
        target = module.code_for_node(tree.statement(call)).split("=")[0].strip()
        value = distributed_sampler_value(tree, call.args[1].value)
        found[target] = module.code_for_node(value) if value is not None else None
    assert found == {
        "a": "DistributedSampler(ds)",
        "b": "None if single else DistributedSampler(ds)",  # may be None: guard set_epoch
        "c": None,
        "d": None,  # names bound to each other, no sampler: the search ends
    }
