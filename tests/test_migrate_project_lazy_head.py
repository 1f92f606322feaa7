"""A pix2pix/CUT-style project (fixtures/projects/lazy_head_gan): a model registry, a
class that holds the training DataLoader and hands out its batches, a projection head
whose first forward builds its layers (its optimizer made after that forward, in
`data_dependent_initialize`), and `parallelize()` wrapping the nets by name in
DataParallel. The facts the analysis answers about it, what the migration makes of
each, and the cases it must leave alone. (The after/ project runs as one process and
under torchrun in tests/test_migrate_run.py, and verifies in tests/test_migrate_projects.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import libcst as cst

from ddpify.analysis.lazy_modules import lazy_wrap_points
from ddpify.analysis.loader_holders import held_loader_of, held_loaders
from ddpify.analysis.named_wraps import data_parallel_by_name, trained_by_name
from ddpify.analysis.repeated_forwards import forwards_of_several_shapes
from ddpify.analysis.roles import training_loops
from ddpify.analysis.tree import Tree
from ddpify.migrate.pipeline import link
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES

PROJECT = FIXTURES / "projects" / "lazy_head_gan"
AFTER = PROJECT / "after"


def _copy(tmp_path: Path) -> Path:
    work = tmp_path / "p"
    shutil.copytree(PROJECT / "before", work)
    return work


def _trees(work: Path) -> dict[str, Tree]:
    """The project's modules, each as its tree (its `view` the whole project)."""
    project = load_project(work / "train.py")
    paths = list(project.modules)
    trees = link([Tree(cst.parse_module(project.modules[path].text)) for path in paths])
    return {str(path.relative_to(work)): tree for path, tree in zip(paths, trees)}


def _migrate(work: Path):
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    outputs = {r.filename: r.output for r in migration.results}
    return migration, outputs


# -- the analysis -------------------------------------------------------------------------


def test_the_training_loop_iterates_the_loader_its_holder_builds(tmp_path):
    trees = _trees(_copy(tmp_path))
    entry = trees["train.py"]
    holders = held_loaders(entry.view)
    assert set(holders) == {"SignalDatasetLoader"}
    held = holders["SignalDatasetLoader"]
    assert held.attribute == "self.dataloader"
    assert held.set_epoch is not None and held.set_epoch.name.value == "set_epoch"
    (loop,) = training_loops(entry)
    # made by create_dataset(opt), which returns `data_loader.load_data()`, which returns self
    assert held_loader_of(entry.view, loop) == ("dataset", held)


def test_a_loop_over_something_else_is_not_a_holders(tmp_path):
    work = _copy(tmp_path)
    data = work / "data" / "__init__.py"
    # load_data() now hands out the DataLoader itself, not the holder
    data.write_text(
        data.read_text().replace("        return self\n", "        return self.dataloader\n")
    )
    entry = _trees(work)["train.py"]
    (loop,) = training_loops(entry)
    assert held_loader_of(entry.view, loop) is None


def test_the_projection_head_is_wrapped_before_its_optimizer(tmp_path):
    trees = _trees(_copy(tmp_path))
    model = trees[str(Path("models") / "contrast_model.py")]
    ((lazy, point),) = lazy_wrap_points(model)
    assert (lazy.model, lazy.method) == ("self.netF", "data_dependent_initialize")
    assert model.code(point).strip().startswith("self.optimizer_F = torch.optim.Adam(")


def test_a_generator_run_in_different_ways_is_told_from_one_run_alike(tmp_path):
    trees = _trees(_copy(tmp_path))
    view = trees["train.py"].view
    shown = [view.code(call) for call in forwards_of_several_shapes(view, "self.netG")]
    assert "self.netG(self.real_A)" in shown
    assert "self.netG(tgt, self.nce_layers, encode_only=True)" in shown
    # the critic runs on fakes and reals alike; the head on both feature lists alike
    assert forwards_of_several_shapes(view, "self.netD") == []
    assert forwards_of_several_shapes(view, "self.netF") == []


def test_parallelize_wraps_the_trained_nets_by_name(tmp_path):
    trees = _trees(_copy(tmp_path))
    base = trees[str(Path("models") / "base_model.py")]
    (wrap,) = data_parallel_by_name(base)
    assert (wrap.net, wrap.attribute, wrap.prefix) == ("net", '"net" + name', "net")
    assert trained_by_name(base, wrap) == ["self.netD", "self.netF", "self.netG"]


# -- the migration ------------------------------------------------------------------------


def test_the_migration_of_each_mechanism():
    model = (AFTER / "models" / "contrast_model.py").read_text()
    # the head: wrapped after the forward that builds it, right before its optimizer
    ids = "device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None"
    assert (
        f"            self.netF = DDP(self.netF, {ids}, find_unused_parameters=True)\n"
        "            # ddpify: square-root LR scaling"
    ) in model
    assert model.count("self.netF = DDP(") == 1
    # the generator runs whole and encoder-only into one loss: no find_unused_parameters
    assert f"self.netG = DDP(self.netG, {ids})\n" in model
    # both optimizers of the one scaled backward step through the scaler, then one update
    assert (
        "        SCALER.step(self.optimizer_G)\n"
        "        SCALER.step(self.optimizer_F)\n"
        "        SCALER.update()\n"
    ) in model
    data = (AFTER / "data" / "__init__.py").read_text()
    assert "sampler=DistributedSampler(self.dataset, shuffle=not opt.serial_batches)," in data
    assert (
        "        self.dataset.current_epoch = epoch\n"
        "        self.dataloader.sampler.set_epoch(epoch)\n"
    ) in data
    base = (AFTER / "models" / "base_model.py").read_text()
    assert 'setattr(self, "net" + name, net)' in base and "DataParallel" not in base
    # gpu_ids were DataParallel's device_ids: their first is this process's GPU now
    assert "        net.to(LOCAL_RANK)\n" in (AFTER / "models" / "networks.py").read_text()
    # the loop already calls the holder's set_epoch: nothing more in the entry
    train = (AFTER / "train.py").read_text()
    assert train.count("set_epoch(") == 1


def test_the_report_names_the_policy_and_each_change(tmp_path):
    migration, _ = _migrate(_copy(tmp_path))
    text = "\n".join(
        change.description for result in migration.results for change in result.changes
    )
    assert "`SignalDatasetLoader.set_epoch` reshuffles the DistributedSampler" in text
    assert "wrap self.netF in DistributedDataParallel after the forward that builds" in text
    assert "DataParallel over the nets by name removed" in text
    human = [item.why for result in migration.results for item in result.needs_human]
    assert any("`self.netG` runs its forward in different ways" in why for why in human)
    # the holder's own cap on a pass counts per rank now: said, with what to do
    (cap,) = [why for why in human if "`SignalDatasetLoader.__iter__` ends a pass" in why]
    assert "(`if i * self.opt.batch_size >= self.opt.max_dataset_size:`)" in cap
    assert "divide the cap by WORLD_SIZE" in cap


def test_a_holder_without_set_epoch_gets_it_through_its_loader(tmp_path):
    work = _copy(tmp_path)
    data = work / "data" / "__init__.py"
    data.write_text(
        data.read_text().replace(
            "    def set_epoch(self, epoch):\n        self.dataset.current_epoch = epoch\n\n", ""
        )
    )
    train = work / "train.py"
    train.write_text(train.read_text().replace("        dataset.set_epoch(epoch)\n", ""))
    migration, outputs = _migrate(work)
    assert migration.migrated, migration.entry.reason
    assert "            dataset.dataloader.sampler.set_epoch(epoch)\n" in outputs["train.py"]


# -- left alone ---------------------------------------------------------------------------


def test_a_holder_iterated_only_to_evaluate_stays_whole(tmp_path):
    """Training draws from a plain DataLoader; the holder feeds an evaluation loop only:
    its loader keeps every sample (no sampler) and gets no set_epoch."""
    work = _copy(tmp_path)
    train = work / "train.py"
    text = train.read_text()
    text = text.replace(
        "from data import create_dataset\n",
        "from data import UnpairedSignals, create_dataset\n",
    )
    text = text.replace(
        "    dataset = create_dataset(opt)  # a SignalDatasetLoader: iterate it for batches\n",
        "    dataset = create_dataset(opt)  # a SignalDatasetLoader: iterate it for batches\n"
        "    train_loader = torch.utils.data.DataLoader(UnpairedSignals(), batch_size=4, "
        "shuffle=True, drop_last=True)\n",
    )
    text = text.replace("        dataset.set_epoch(epoch)\n", "")
    text = text.replace(
        "        for i, data in enumerate(dataset):\n",
        "        for i, data in enumerate(train_loader):\n",
    )
    text = text.replace(
        "        model.update_learning_rate()\n",
        "        with torch.no_grad():\n"
        "            for data in dataset:\n"
        "                model.set_input(data)\n"
        "                model.forward()\n"
        "        model.update_learning_rate()\n",
    )
    train.write_text(text)
    migration, outputs = _migrate(work)
    assert migration.migrated, migration.entry.reason
    assert "sampler=DistributedSampler(train_dataset, shuffle=True)" in outputs["train.py"]
    data = outputs.get(
        str(Path("data") / "__init__.py"), (work / "data" / "__init__.py").read_text()
    )
    assert "DistributedSampler" not in data and "sampler.set_epoch" not in data


def test_a_lazily_built_module_no_optimizer_trains_is_not_wrapped(tmp_path):
    """The head only measures (its features under no_grad, no optimizer): it is built on
    its first call like the trained one, but DDP is for what trains."""
    work = _copy(tmp_path)
    model = work / "models" / "contrast_model.py"
    text = model.read_text()
    text = text.replace(
        "        if self.opt.lambda_NCE > 0.0:\n"
        "            self.optimizer_F = torch.optim.Adam(self.netF.parameters(), lr=self.opt.lr, "
        "betas=(self.opt.beta1, 0.999))\n"
        "            self.optimizers.append(self.optimizer_F)\n",
        "",
    )
    text = text.replace("        self.optimizer_F.zero_grad()\n", "")
    text = text.replace("        self.optimizer_F.step()\n", "")
    text = text.replace(
        "            self.loss_NCE = self.calculate_NCE_loss(self.real_A, self.fake_B)\n",
        "            with torch.no_grad():\n"
        "                self.loss_NCE = self.calculate_NCE_loss(self.real_A, self.fake_B)\n",
    )
    model.write_text(text)
    migration, outputs = _migrate(work)
    assert migration.migrated, migration.entry.reason
    migrated = outputs[str(Path("models") / "contrast_model.py")]
    assert "self.netF = DDP(" not in migrated
    assert "self.netG = DDP(" in migrated and "self.netD = DDP(" in migrated


def test_no_place_for_the_wrap_keeps_the_refusal_naming_the_line(tmp_path):
    """The head's optimizer shares its line with another statement: no statement of its
    own to wrap the head before, so the migration stops and says where to wrap it."""
    work = _copy(tmp_path)
    model = work / "models" / "contrast_model.py"
    model.write_text(
        model.read_text().replace(
            "            self.optimizer_F = torch.optim.Adam(",
            "            self.nce_ready = True; self.optimizer_F = torch.optim.Adam(",
        )
    )
    migration, _ = _migrate(work)
    assert not migration.migrated
    reason = migration.entry.reason
    assert "`self.netF` gets its optimizer in `data_dependent_initialize`" in reason
    assert "self.nce_ready = True; self.optimizer_F = torch.optim.Adam(" in reason


def test_the_analysis_reads_single_files_too():
    """A holder class in one script (no project view): the same facts."""
    tree = Tree(
        cst.parse_module(
            "import torch\n\n\n"
            "class Batches:\n"
            "    def __init__(self, data):\n"
            "        self.loader = torch.utils.data.DataLoader(data, shuffle=True)\n\n"
            "    def __iter__(self):\n"
            "        yield from self.loader\n\n\n"
            "model = torch.nn.Linear(2, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "batches = Batches(torch.randn(8, 2))\n"
            "for epoch in range(2):\n"
            "    for x in batches:\n"
            "        opt.zero_grad()\n"
            "        model(x).sum().backward()\n"
            "        opt.step()\n"
        )
    )
    loop = next(loop for loop in training_loops(tree))
    name, held = held_loader_of(tree, loop)
    assert (name, held.holder, held.attribute, held.set_epoch) == (
        "batches",
        "Batches",
        "self.loader",
        None,
    )


def test_a_net_built_and_trained_under_one_condition_is_wrapped_under_it(tmp_path):
    """`if self.isTrain:` builds the critic and its optimizer: a test-time run builds
    neither, so the wrap stays inside that `if` (after it, `self.netD` would not exist)."""
    work = _copy(tmp_path)
    model = work / "models" / "contrast_model.py"
    text = model.read_text()
    built = "        self.netD = networks.define_D(opt.width, gpu_ids=self.gpu_ids)\n"
    optimizer = next(line for line in text.splitlines(True) if "self.optimizer_D = " in line)
    appended = "        self.optimizers.append(self.optimizer_D)\n"
    for line in (built, optimizer, appended):
        text = text.replace(line, "")
    text = text.replace(
        "        self.optimizers.append(self.optimizer_G)\n",
        "        self.optimizers.append(self.optimizer_G)\n"
        "        if self.isTrain:\n"
        + "".join("    " + line for line in (built, optimizer, appended)),
    )
    model.write_text(text)
    migration, outputs = _migrate(work)
    assert migration.migrated, migration.entry.reason
    migrated = outputs[str(Path("models") / "contrast_model.py")]
    assert (
        "        if self.isTrain:\n"
        "            self.netD = networks.define_D(opt.width, gpu_ids=self.gpu_ids)\n"
        "            self.netD = DDP(self.netD"
    ) in migrated
