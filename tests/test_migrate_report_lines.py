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


TWO_NETS_WITH_BATCH_NORM = """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8, shuffle=True)
netG = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).to(device)
netD = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).to(device)
optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-3)
optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-3)
for epoch in range(2):
    for (real,) in loader:
        real = real.to(device)
        fake = netG(torch.randn(real.size(0), 2, device=device))
        loss_d = netD(real).mean() - netD(fake.detach()).mean()
        optimizerD.zero_grad()
        loss_d.backward()
        optimizerD.step()
        loss_g = -netD(fake).mean()
        optimizerG.zero_grad()
        loss_g.backward()
        optimizerG.step()
"""


def test_each_models_sync_batch_norm_conversion_points_at_its_own_line():
    """A GAN with BatchNorm in both nets gets two conversions under the same guard line;
    each change of the report points at the conversion of the net it names (they traded
    lines when the guard was the anchor: the discriminator's change is recorded first)."""
    result = migrate_source(TWO_NETS_WITH_BATCH_NORM, "train.py", Options())
    assert result.migrated, result.reason
    lines = result.output.splitlines()
    conversions = [c for c in result.changes if c.description.startswith("SyncBatchNorm")]
    assert len(conversions) == 2
    for change in conversions:
        net = change.description.split(" of ")[1].split(" ")[0]
        assert lines[change.line - 1].strip() == (
            f"{net} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({net})"
        )
