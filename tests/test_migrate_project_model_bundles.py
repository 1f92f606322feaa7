"""Models a helper in another module builds and returns as a bundle (`nets, nets_ema =
build_model(args)`, a dict of DataParallel nets and their EMA deep copies), trained by
key where received (`optims[k] = Adam(self.nets[k].parameters())`).

fixtures/projects/model_bundles is the project of our own in that style; it migrates, runs
as one process and under torchrun, and verifies with the other projects
(tests/test_migrate_projects.py, tests/test_migrate_run.py). Here: the analysis facts,
the shape of the wrap, and the cases left alone or refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import libcst as cst

from ddpify.analysis.bundles import data_parallel_feeding_bundles, trained_helper_bundles
from ddpify.analysis.project import ProjectView
from ddpify.analysis.tree import Tree
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES

PROJECT = FIXTURES / "projects" / "model_bundles" / "before"


def _trees(root: Path) -> dict[str, Tree]:
    project = load_project(root / "train.py")
    trees = {
        str(path.relative_to(root)): Tree(cst.parse_module(module.text))
        for path, module in project.modules.items()
    }
    view = ProjectView(list(trees.values()))
    for tree in trees.values():
        tree.view = view
    return trees


def _migrated(root: Path, tmp_path: Path):
    work = tmp_path / "p"
    shutil.copytree(root, work)
    return migrate_project(load_project(work / "train.py"), "train.py")


def _output(migration, suffix: str) -> str:
    return next(r for r in migration.results if r.filename.endswith(suffix)).output


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_the_bundle_a_helper_returns_and_the_receiver_trains_is_found():
    trees = _trees(PROJECT)
    [found] = trained_helper_bundles(trees["core/solver.py"])
    assert found.collection == "self.nets"
    assert found.bundle.helper.name.value == "build_model"
    assert (found.bundle.returned, found.bundle.position) == ("nets", 0)
    # the entry set after the bundle is built (`nets['classifier'] = ...`) counts too
    assert set(found.bundle.entries) == {
        "generator",
        "mapping_network",
        "discriminator",
        "classifier",
    }
    assert found.bundle.data_parallel == set(found.bundle.entries)
    # `nets_ema` is returned by the same helper, but no optimizer trains it
    assert all(t.collection != "self.nets_ema" for t in trained_helper_bundles(trees["train.py"]))
    # every DataParallel of the helper feeds a bundle (the EMA copies are deep copies)
    assert len(data_parallel_feeding_bundles(trees["core/model.py"])) == 4
    assert data_parallel_feeding_bundles(trees["core/solver.py"]) == []


def test_the_trained_entries_are_wrapped_where_received_after_their_preparation(tmp_path):
    migration = _migrated(PROJECT, tmp_path)
    assert migration.migrated, migration.entry.reason
    solver = _output(migration, "core/solver.py")
    init = solver[solver.index("def __init__") : solver.index("def _reset_grad")]
    wrap = (
        "        for net in self.nets.keys():\n"
        "            if net == 'classifier':\n"
        "                continue\n"
        "            self.nets[net] = DDP(self.nets[net].module"
    )
    assert wrap in init
    # after the move and the weight init through the children the setattr registered,
    # and after the EMA copies took the initial weights
    for prepared in ("self.to(self.device)", "network.apply(init_weights)", "load_state_dict"):
        assert init.index(prepared) < init.index(wrap)
    model = _output(migration, "core/model.py")
    # DataParallel stays in the helper, on this process's device only, for the EMA copies
    # and for the code that reads `.module`; no DDP there (not both)
    assert "DDP" not in model
    assert model.count("device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None") == 4
    assert "generator_ema = copy.deepcopy(generator)" in model
    # the checkpoint helper keeps reading `.module` of what it was given: unchanged keys
    assert "net = module.module if self.data_parallel else module" in _output(
        migration, "core/checkpoint.py"
    )
    changes = [c.description for c in migration.results[1].changes] + [
        c.description for r in migration.results for c in r.changes
    ]
    assert any("where `build_model` returns it to" in d for d in changes)


HELPER = """\
import copy

import torch.nn as nn


def build_model(args):
    generator = nn.DataParallel(nn.Linear(2, 2))
    discriminator = nn.DataParallel(nn.Linear(2, 1))
    generator_ema = copy.deepcopy(generator)
    return dict(generator=generator, discriminator=discriminator), dict(generator=generator_ema)
"""

TRAINER = """\
import torch
import torch.nn as nn

from nets import build_model


class Trainer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.nets, self.nets_ema = build_model(args)
{optimizers}

    def fit(self, loader):
        for x, y in loader:
            loss = ((self.model(x) - y) ** 2).mean()
            loss.backward()
"""

ENTRY = """\
import torch

from trainer import Trainer



def main():
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    trainer = Trainer(None)
    trainer.fit(loader)


if __name__ == "__main__":
    main()
"""


def _project(tmp_path: Path, optimizers: str, helper: str = HELPER) -> Path:
    return _write(
        tmp_path / "src",
        {
            "nets.py": helper,
            "trainer.py": TRAINER.format(optimizers=optimizers),
            "train.py": ENTRY,
        },
    )


def test_a_helper_bundle_no_optimizer_trains_is_left_alone(tmp_path):
    """The trainer trains a model of its own; the helper's bundle (a frozen pair of nets)
    is no trained bundle, and its DataParallel calls are not touched by this mechanism."""
    root = _project(
        tmp_path,
        "        self.model = nn.Linear(2, 2)\n"
        "        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)",
    )
    trees = _trees(root)
    assert trained_helper_bundles(trees["trainer.py"]) == []
    assert data_parallel_feeding_bundles(trees["nets.py"]) == []
    migration = _migrated(root, tmp_path)
    assert migration.migrated, migration.entry.reason
    assert "device_ids" not in _output(migration, "nets.py")
    assert "self.model = DDP(self.model" in _output(migration, "trainer.py")
    assert "self.nets[" not in _output(migration, "trainer.py")


def test_a_bundle_trained_under_an_if_around_the_optimizer_is_refused(tmp_path):
    """Which keys train is decided by an `if` around the optimizer, not a `continue`
    ddpify can repeat where it wraps: refused, naming the optimizer and the helper."""
    root = _project(
        tmp_path,
        "        self.optims = {}\n"
        "        for k in self.nets.keys():\n"
        "            if k != 'discriminator' or args.train_d:\n"
        "                self.optims[k] = torch.optim.Adam(self.nets[k].parameters())",
    )
    migration = _migrated(root, tmp_path)
    assert not migration.migrated
    reason = migration.entry.reason
    assert "`self.optims[k] = torch.optim.Adam(self.nets[k].parameters())`" in reason
    assert "(built by `build_model`) under a condition" in reason


def test_a_bundle_with_dataparallel_on_some_models_only_is_refused(tmp_path):
    helper = HELPER.replace("nn.DataParallel(nn.Linear(2, 1))", "nn.Linear(2, 1)")
    root = _project(
        tmp_path,
        "        self.optims = {}\n"
        "        for k in self.nets.keys():\n"
        "            self.optims[k] = torch.optim.Adam(self.nets[k].parameters())",
        helper,
    )
    migration = _migrated(root, tmp_path)
    assert not migration.migrated
    assert "wraps only some models of the bundle it returns in DataParallel (generator)" in (
        migration.entry.reason
    )


def test_a_plain_bundle_is_wrapped_without_module(tmp_path):
    """No DataParallel in the helper: each trained model is wrapped as it is."""
    helper = HELPER.replace("nn.DataParallel(nn.Linear(2, 2))", "nn.Linear(2, 2)").replace(
        "nn.DataParallel(nn.Linear(2, 1))", "nn.Linear(2, 1)"
    )
    root = _project(
        tmp_path,
        "        self.optims = {}\n"
        "        for k in self.nets.keys():\n"
        "            self.optims[k] = torch.optim.Adam(self.nets[k].parameters())",
        helper,
    )
    migration = _migrated(root, tmp_path)
    assert migration.migrated, migration.entry.reason
    trainer = _output(migration, "trainer.py")
    assert "        for k in self.nets.keys():\n            self.nets[k] = DDP(self.nets[k]," in (
        trainer
    )
    assert "device_ids" not in _output(migration, "nets.py")
    result = next(r for r in migration.results if r.filename.endswith("trainer.py"))
    assert any("is a DDP wrapper now" in h.why for h in result.needs_human)


def test_a_module_that_imports_os_inside_a_function_gets_it_at_the_top(tmp_path):
    """The rank constants a helper module now reads need `os` at module level; an
    `import os` inside one of its functions binds it there only (found running the
    StarGAN v2 row: its face-alignment module)."""
    helper = (
        HELPER + "\n\ndef list_images(folder):\n    import os\n\n    return os.listdir(folder)\n"
    )
    helper = helper.replace(
        "def build_model(args):", "def build_model(args):\n    print('building')"
    )
    root = _project(
        tmp_path,
        "        self.optims = {}\n"
        "        for k in self.nets.keys():\n"
        "            self.optims[k] = torch.optim.Adam(self.nets[k].parameters())",
        helper,
    )
    migration = _migrated(root, tmp_path)
    assert migration.migrated, migration.entry.reason
    nets = _output(migration, "nets.py")
    assert nets.startswith("import copy\nimport os\n") or "\nimport os\n" in nets.split("def ")[0]
    compile(nets, "nets.py", "exec")


def test_a_bundle_is_wrapped_in_a_project_that_also_converts_dataparallel(tmp_path):
    """A DataParallel of a trained model elsewhere makes the project a DataParallel one;
    the bundle's models are still wrapped where received (not left training apart)."""
    root = _project(
        tmp_path,
        "        self.head = nn.DataParallel(nn.Linear(2, 2))\n"
        "        self.optims = {'head': torch.optim.SGD(self.head.parameters(), lr=0.1)}\n"
        "        for k in self.nets.keys():\n"
        "            self.optims[k] = torch.optim.Adam(self.nets[k].parameters())",
    )
    migration = _migrated(root, tmp_path)
    assert migration.migrated, migration.entry.reason
    trainer = _output(migration, "trainer.py")
    assert "self.head = DDP(nn.Linear(2, 2)" in trainer
    assert "            self.nets[k] = DDP(self.nets[k].module, " in trainer
    assert "DDP" not in _output(migration, "nets.py")
