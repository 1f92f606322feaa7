"""Every place the migrate report says needs a human comes with a line of the output."""

from __future__ import annotations

from ddpify.migrate import Options, migrate_source
from ddpify.migrate.report import _output_line

NO_DESTROY = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BACKWARD_IN_A_HELPER = """\
import torch
from torch.utils.data import DataLoader, TensorDataset


def backward(loss):
    loss.backward()


def main():
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    for (x,) in loader:
        loss = model(x.cuda()).pow(2).mean()
        opt.zero_grad()
        backward(loss)
        opt.step()


if __name__ == "__main__":
    main()
"""


def _human_lines(source: str) -> list[tuple[int | None, str]]:
    result = migrate_source(source, "train.py", Options())
    assert result.needs_human
    return [(item.line, result.output.splitlines()[item.line - 1]) for item in result.needs_human]


def test_a_group_that_is_never_destroyed_points_at_its_init():
    [(line, text)] = _human_lines(NO_DESTROY)
    assert "init_process_group" in text


def test_mixed_precision_not_added_points_at_the_backward():
    lines = _human_lines(BACKWARD_IN_A_HELPER)
    assert any("loss.backward()" in text for _, text in lines)


def test_an_anchor_whose_line_was_rewritten_maps_to_the_rewritten_line():
    original = "a = 1\nopt = SGD(lr=0.1)\nb = 2\n"
    output = "import os\na = 1\nopt = SGD(lr=0.1 * WORLD_SIZE)\nb = 2\n"
    assert _output_line(original, output, "opt = SGD(lr=0.1)") == 3
    assert _output_line(original, output, "not there") is None


def test_a_needs_human_item_is_listed_once_however_often_a_pass_asks():
    from ddpify.migrate.analyze import Plan, Shape

    plan = Plan(Shape.SINGLE, Options())
    for _ in range(3):
        plan.needs_human("scale the learning rate", "opt = SGD(params)\n")
        plan.needs_human("scale the learning rate", "other = SGD(params)\n")
    plan.needs_human("check the sampler", "opt = SGD(params)\n")
    assert [(h.why, h.anchor) for h in plan.human] == [
        ("scale the learning rate", "opt = SGD(params)"),
        ("scale the learning rate", "other = SGD(params)"),
        ("check the sampler", "opt = SGD(params)"),
    ]
