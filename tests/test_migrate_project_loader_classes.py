"""Loaders whose class the configuration chooses (`getattr(dataloaders, config[...])`):
which are DataLoaders (ddpify/analysis/loader_classes.py), and the split-then-shard the
migration puts in the project's base (fixtures/projects/config_loaders)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import libcst as cst
import pytest

from ddpify.analysis.loader_classes import chosen_loader_base, chosen_loader_modules
from ddpify.analysis.project import Project
from ddpify.analysis.tree import Tree
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES

PROJECT = FIXTURES / "projects" / "config_loaders"


def _copy(tmp_path: Path) -> Path:
    work = tmp_path / "p"
    shutil.copytree(PROJECT / "before", work)
    return work


def _sites(work: Path) -> dict[str, str | None]:
    modules = chosen_loader_modules(Project.discover([work / "train.py"]))
    tree = Tree(cst.parse_module((work / "train.py").read_text()))
    found = {}
    for call in tree.find(cst.Call):
        if tree.code(call).startswith("get_instance("):
            base = chosen_loader_base(tree, call, modules)
            found[tree.code(call.args[1].value)] = base.name if base else None
    return found


def test_every_class_of_the_module_derives_from_the_base(tmp_path):
    work = _copy(tmp_path)
    modules = chosen_loader_modules(Project.discover([work / "train.py"]))
    assert set(modules) == {"dataloaders"}
    base = modules["dataloaders"]
    assert (base.module, base.name, base.members) == (
        "base.base_dataloader",
        "BaseDataLoader",
        ("Blobs", "Stripes"),
    )
    # the loaders are DataLoaders of the base; the model, chosen the same way, is not
    assert _sites(work) == {
        '"train_loader"': "BaseDataLoader",
        '"val_loader"': "BaseDataLoader",
        '"arch"': None,
    }


def test_a_module_that_can_name_something_else_is_not_proven(tmp_path):
    work = _copy(tmp_path)
    init = work / "dataloaders" / "__init__.py"
    init.write_text(init.read_text() + "from torch.utils.data import DataLoader\n")
    assert _sites(work)['"train_loader"'] is None  # plain DataLoader: not sharded in the base
    init.write_text(init.read_text() + "\n\ndef make(size):\n    return None\n")
    assert chosen_loader_modules(Project.discover([work / "train.py"])) == {}


def test_the_base_is_left_alone_when_the_module_is_not_proven(tmp_path):
    """`dataloaders.SIZES` could be what the configuration names: the classes are not
    proven to be the only candidates, so nothing is sharded in the base."""
    work = _copy(tmp_path)
    (work / "dataloaders" / "__init__.py").write_text(
        "from .blobs import Blobs\nfrom .stripes import Stripes\nSIZES = [32, 64]\n"
    )
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    outputs = "".join(result.output for result in migration.results)
    assert "ddpify_sharded" not in outputs and "ddpify_training_loader" not in outputs


def test_the_validation_loader_is_built_outside_the_training_block():
    after = (PROJECT / "after" / "train.py").read_text()
    assert (
        "    with ddpify_training_loader():\n"
        '        train_loader = get_instance(dataloaders, "train_loader", config)\n'
        '    val_loader = get_instance(dataloaders, "val_loader", config)\n'
    ) in after
    assert "ddpify_set_epoch(epoch)" in (PROJECT / "after" / "base" / "base_trainer.py").read_text()


@pytest.fixture
def migrated_base(monkeypatch):
    """The migrated base_dataloader.py, imported, with torch.distributed answering as
    rank `base.rank` of 2 (DistributedSampler asks it when no rank is given)."""
    torch = pytest.importorskip("torch")
    path = PROJECT / "after" / "base" / "base_dataloader.py"
    spec = importlib.util.spec_from_file_location("migrated_base_dataloader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.rank = 0
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: module.rank)
    return module


def _training_loader(module, dataset, **arguments):
    with module.ddpify_training_loader():
        return module.BaseDataLoader(dataset, 1, **arguments)


def test_the_training_split_is_split_then_sharded(migrated_base):
    dataset = list(range(40))
    held_out = migrated_base.BaseDataLoader(dataset, 1, shuffle=True, val_split=0.25)
    validation = set(held_out.val_sampler.indices)
    shards = []
    for rank in (0, 1):
        migrated_base.rank = rank
        shards.append(
            list(_training_loader(migrated_base, dataset, shuffle=True, val_split=0.25).sampler)
        )
    # each rank half of the training split; together all of it and nothing held out
    assert len(shards[0]) == len(shards[1]) == 15
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(40)) - validation
    # the validation part of that same instance stays whole
    assert len(validation) == 10


def test_set_epoch_reshuffles_the_training_shard(migrated_base):
    loader = _training_loader(migrated_base, list(range(40)), shuffle=True, val_split=0.25)
    first = list(loader.sampler)
    migrated_base.ddpify_set_epoch(1)
    assert list(loader.sampler) != first and sorted(loader.sampler) != sorted(range(40))


def test_a_loader_built_outside_the_block_stays_whole(migrated_base):
    dataset = list(range(12))
    migrated_base.rank = 1
    whole = migrated_base.BaseDataLoader(dataset, 1, shuffle=False)
    assert list(whole.sampler) == list(range(12))
    halves = []
    for rank in (0, 1):
        migrated_base.rank = rank
        halves.append(set(_training_loader(migrated_base, dataset, shuffle=True).sampler))
    assert len(halves[0]) == len(halves[1]) == 6
    assert halves[0] | halves[1] == set(range(12))


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_a_configured_optimizer_is_read_and_a_demos_is_not(tmp_path):
    """An optimizer whose class the configuration chooses from torch.optim is one: the
    model it trains is wrapped where the loader is sharded; the SGD of a helper module's
    `__main__` demo never runs on import, so its model is left alone."""
    work = _copy(tmp_path)
    _edit(
        work / "base" / "base_trainer.py",
        'torch.optim.SGD(self.model.parameters(), **config["optimizer"]["args"])',
        'getattr(torch.optim, config["optimizer"]["type"])(self.model.parameters())',
    )
    with (work / "models.py").open("a") as models:  # a demo, as helper modules have
        models.write(
            '\n\nif __name__ == "__main__":\n    import torch\n\n'
            "    net = TinySegNet(2)\n    sgd = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        )
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    outputs = {result.filename: result.output for result in migration.results}
    assert "self.model = DDP(self.model" in outputs["base/base_trainer.py"]
    assert "DDP" not in outputs.get("models.py", "")


def test_a_sampler_the_base_draws_with_that_ddpify_cannot_shard_is_refused(tmp_path):
    work = _copy(tmp_path)
    _edit(
        work / "base" / "base_dataloader.py",
        "return SubsetRandomSampler(indices[split_index:]), ",
        "return WeightedRandomSampler(np.ones(len(indices)), len(indices)), ",
    )
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert not migration.migrated
    assert "draws with `WeightedRandomSampler(np.ones(len(indices)), len(indices))`" in (
        migration.entry.reason
    )


def test_the_global_batch_policy_divides_the_training_batch_in_the_base(tmp_path):
    from ddpify.migrate.analyze import Options

    work = _copy(tmp_path)
    options = Options(batch_policy="global")
    migration = migrate_project(load_project(work / "train.py"), "train.py", options)
    base = next(r for r in migration.results if r.filename.endswith("base_dataloader.py"))
    assert '"batch_size": arguments.get("batch_size", 1) // get_world_size()' in base.output
    assert migration.summary().lr_scaling == "none"
