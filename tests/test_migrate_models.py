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


def test_a_dataparallel_subclass_beside_torchs_becomes_one_ddp_wrap_after_the_if():
    result = migrate_source(SYNC_BN_WRAPPER, "train.py")
    assert result.migrated, result.reason
    out = result.output
    assert "DataParallelWithCallback(model)" not in out and "nn.DataParallel(model)" not in out
    assert out.count("model = DDP(model") == 1
    assert out.count("convert_sync_batchnorm(model)") == 1
    assert out.index("convert_sync_batchnorm(model)") < out.index("model = DDP(model")


def test_a_dataparallel_subclass_alone_around_the_trained_model_is_refused_by_name():
    source = SYNC_BN_WRAPPER.replace("    else:\n        model = nn.DataParallel(model)\n", "")
    result = migrate_source(source, "train.py")
    assert not result.migrated
    assert "`model = DataParallelWithCallback(model)` (in `main`)" in result.reason
    assert "DataParallel subclass of the project" in result.reason


GAN_BY_KEY = (FIXTURES / "migrate" / "gan_dict_by_key" / "before.py").read_text()


def test_each_model_of_a_dict_trained_by_key_is_wrapped_and_the_ema_copy_stays_plain():
    result = migrate_source(GAN_BY_KEY, "train.py")
    assert result.migrated, result.reason
    out = result.output
    wrap = out.index("nets = Munch({name: DDP(net, ")
    # The EMA copy is made of the plain generator, before the wrap; the optimizers train
    # the same parameters either side of it.
    assert out.index("generator_ema = copy.deepcopy(nets.generator)") < wrap
    assert "generator_ema = DDP(" not in out


def test_a_dict_comprehension_of_optimizers_by_key_wraps_each_model():
    source = GAN_BY_KEY.replace(
        "    optims = Munch()\n    for net in nets.keys():\n"
        "        optims[net] = torch.optim.Adam(nets[net].parameters(), lr=args.lr, "
        "betas=(0.5, 0.999))\n",
        "    optims = Munch({net: torch.optim.Adam(nets[net].parameters(), lr=args.lr) "
        "for net in nets})\n",
    )
    assert source != GAN_BY_KEY
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    assert "nets = Munch({name: DDP(net, " in result.output


def test_a_loop_that_skips_some_keys_is_refused_naming_the_skip():
    source = GAN_BY_KEY.replace(
        "    for net in nets.keys():\n",
        '    for net in nets.keys():\n        if net == "frozen":\n            continue\n',
    )
    result = migrate_source(source, "train.py")
    assert not result.migrated
    assert 'trains only the items of `nets` that `if net == "frozen":` lets through' in (
        result.reason
    )


def test_a_dict_of_models_a_helper_returns_is_wrapped_where_received():
    """`nets, nets_ema = build_nets(device)`, trained by key: each model of `nets` is
    wrapped in `main`, after the EMA copy is made of the plain generator; the helper,
    which also builds the EMA bundle, is left as it is (tests/
    test_migrate_project_model_bundles.py has the same across modules)."""
    source = GAN_BY_KEY.replace(
        "    nets = Munch(generator=Generator(4, 6).to(device), "
        "discriminator=Discriminator(6).to(device))\n",
        "    nets, nets_ema = build_nets(device)\n",
    ).replace(
        "def main(args):",
        "def build_nets(device):\n"
        "    nets = Munch(generator=Generator(4, 6).to(device), "
        "discriminator=Discriminator(6).to(device))\n"
        "    return nets, Munch(generator=copy.deepcopy(nets.generator))\n\n\n"
        "def main(args):",
    )
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    out = result.output
    wrap = "    for net in nets.keys():\n        nets[net] = DDP(nets[net], device_ids="
    assert wrap in out
    assert out.index("generator_ema = copy.deepcopy(nets.generator)") < out.index(wrap)
    helper = out[out.index("def build_nets") : out.index("def main")]
    assert "DDP" not in helper
