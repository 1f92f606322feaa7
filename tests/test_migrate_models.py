"""Which modules the optimizers train, as `ddpify migrate` must see them in real projects:
an optimizer class chosen from torch.optim at run time, code under an imported module's
`__main__` guard (not the project's), helpers handed the model before the wrap, and a
DataParallel subclass of the project around the trained model."""

from __future__ import annotations

import shutil
from pathlib import Path

from ddpify.migrate import migrate_source
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES


def _migrate_dir(root: Path) -> dict[str, object]:
    migration = migrate_project(load_project(root / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    return {result.filename: result for result in migration.results}


def test_a_configured_optimizer_trains_the_model_the_trainer_wraps(tmp_path):
    work = tmp_path / "p"
    shutil.copytree(FIXTURES / "projects" / "configured_optimizer" / "before", work)
    results = _migrate_dir(work)
    trainer = results["base/trainer.py"].output
    # `get_instance(torch.optim, "optimizer", config, trainable_params)` is the optimizer,
    # and `trainable_params` (either branch) names `self.model`: it is the model DDP wraps.
    assert "self.model = DDP(self.model, device_ids=" in trainer
    assert "torch.nn.DataParallel(self.model)" not in trainer
    assert '{"params": self.model.module.get_decoder_params()}' in trainer
    # `zero_init_head(self.model)` runs before the wrap, on the plain module; the forward
    # hook's `module` is a layer: neither helper reads through `.module`.
    layers = results.get("tools/layers.py")
    assert layers is None or not layers.changed
    # The schedule's `__main__` demo trains a Linear of its own, never run on import.
    schedules = results["tools/schedules.py"].output
    assert "DDP" not in schedules and "demo = torch.optim.SGD(net.parameters()" in schedules


HELPERS_WITH_DEMO = """\
import torch
from torch import nn


def build(width):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


if __name__ == "__main__":
    demo = build(8)
    opt = torch.optim.SGD(demo.parameters(), lr=0.1)
    print(demo.weight if hasattr(demo, "weight") else demo[0].weight.shape)
"""

ENTRY = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import build


def main():
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = build(16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()


if __name__ == "__main__":
    main()
"""


def test_an_imported_modules_main_demo_is_not_the_project(tmp_path):
    (tmp_path / "helpers.py").write_text(HELPERS_WITH_DEMO)
    (tmp_path / "train.py").write_text(ENTRY)
    results = _migrate_dir(tmp_path)
    assert "model = DDP(model" in results["train.py"].output
    # The demo's SGD and model never run when the module is imported: nothing to wrap.
    assert "DDP" not in results["helpers.py"].output


SYNC_BN_WRAPPER = '''\
import torch
from torch import nn


class DataParallelWithCallback(nn.DataParallel):
    """Runs a callback on every replica (a sync-BatchNorm package's)."""


def main(sync_bn=False):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    if sync_bn:
        model = DataParallelWithCallback(model)
    else:
        model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    main()
'''


def test_a_dataparallel_subclass_around_the_trained_model_is_refused_by_name():
    result = migrate_source(SYNC_BN_WRAPPER, "train.py")
    assert not result.migrated
    assert "`model = DataParallelWithCallback(model)` (in `main`)" in result.reason
    assert "DataParallel subclass of the project" in result.reason
