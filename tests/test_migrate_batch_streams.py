"""Loops over a batch stream of the project (a class whose `__iter__` yields row slices, a
generator function yielding them), and loops over an iterable ddpify cannot resolve.

The converted fixtures (fixtures/projects/batch_stream, fixtures/migrate/stream_generator)
run as one process and under torchrun in tests/test_migrate_run.py and are verified
against their originals in tests/test_migrate_projects.py; these check what a user reads:
where the batch is split, the report, and the refusals.
"""

from __future__ import annotations

from pathlib import Path

from ddpify.migrate import migrate_source
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES

SPLIT_X = "x = x[RANK * len(x) // WORLD_SIZE : (RANK + 1) * len(x) // WORLD_SIZE]"


def _project(root: Path, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return migrate_project(load_project(root / "train.py"), "train.py")


def test_a_stream_class_behind_a_with_tqdm_bar_is_split_at_the_loop_target(tmp_path):
    before = FIXTURES / "projects" / "batch_stream" / "before"
    files = {str(p.relative_to(before)): p.read_text() for p in before.rglob("*.py")}
    migration = _project(tmp_path, files)
    assert migration.migrated, migration.entry.reason
    trainer = next(r for r in migration.results if r.filename.endswith("trainer.py"))
    out = trainer.output
    # The split is the first thing the loop does with each batch, before the step.
    loop = out.index("for i, x in enumerate(t):")
    assert out.index(SPLIT_X, loop) < out.index("self.step(x.to(self.device))", loop)
    assert out.count(SPLIT_X) == 1
    summary = migration.summary()
    assert summary.lr_scaling == "none"  # the global batch is the original's
    assert "does not divide" in summary.hand_made
    assert any("`PointStream` stream split by rank" in c.description for c in trainer.changes)


def test_a_generator_function_yielding_slices_is_split_where_the_loop_takes_its_batch():
    before = (FIXTURES / "migrate" / "stream_generator" / "before.py").read_text()
    result = migrate_source(before, "t.py")
    assert result.migrated, result.reason
    loop = result.output.index("for xb, yb in iterate_minibatches(X, Y, BATCH_SIZE):")
    split = result.output.index("xb = xb[RANK * len(xb) // WORLD_SIZE", loop)
    assert split < result.output.index("loss = loss_fn(model(xb), yb)", loop)
    assert "yb = yb[RANK * len(yb) // WORLD_SIZE" in result.output


STEP = (
    "    for xb in {iterable}:\n"
    "        opt.zero_grad()\n"
    "        loss = ((model(xb) - 1) ** 2).mean()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
)
HEADER = (
    "import torch\n\n"
    "model = torch.nn.Linear(2, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "data = torch.randn(64, 2)\n\n"
)


def test_a_stream_that_yields_the_whole_tensor_is_not_split_and_is_named():
    source = (
        HEADER + "class Repeat:\n"
        "    def __iter__(self):\n"
        "        for _ in range(4):\n"
        "            yield data\n\n\n"
        "stream = Repeat()\n"
        "for epoch in range(2):\n" + STEP.format(iterable="stream")
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "the training loop `for xb in stream:` iterates `stream`" in result.reason
    assert "made by `Repeat()`" in result.reason
    assert "full-batch" not in result.reason


def test_a_loader_whose_class_comes_from_the_config_is_refused_with_where_to_shard(tmp_path):
    """The style of config-driven segmentation projects: `get_instance(module, name, config)`
    picks a DataLoader subclass by name, and the Trainer's base class stores the loader."""
    migration = _project(
        tmp_path,
        {
            "loaders.py": (
                "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
                "class BaseLoader(DataLoader):\n"
                "    def __init__(self, dataset, batch_size, shuffle):\n"
                "        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle)\n\n\n"
                "class Points(BaseLoader):\n"
                "    def __init__(self, batch_size, shuffle=True):\n"
                "        data = TensorDataset(torch.randn(32, 2), torch.randn(32, 1))\n"
                "        super().__init__(data, batch_size, shuffle)\n"
            ),
            "trainer.py": (
                "import torch\nfrom tqdm import tqdm\n\n\n"
                "class BaseTrainer:\n"
                "    def __init__(self, model, optimizer, train_loader):\n"
                "        self.model = model\n"
                "        self.optimizer = optimizer\n"
                "        self.train_loader = train_loader\n\n\n"
                "class Trainer(BaseTrainer):\n"
                "    def train_epoch(self):\n"
                "        tbar = tqdm(self.train_loader, ncols=100)\n"
                "        for batch_idx, (data, target) in enumerate(tbar):\n"
                "            self.optimizer.zero_grad()\n"
                "            loss = ((self.model(data) - target) ** 2).mean()\n"
                "            loss.backward()\n"
                "            self.optimizer.step()\n"
            ),
            "train.py": (
                "import torch\nimport loaders\nfrom trainer import Trainer\n\n\n"
                "def get_instance(module, name, config):\n"
                "    return getattr(module, config[name]['type'])(**config[name]['args'])\n\n\n"
                "config = {'train_loader': {'type': 'Points', 'args': {'batch_size': 8}}}\n"
                "train_loader = get_instance(loaders, 'train_loader', config)\n"
                "model = torch.nn.Linear(2, 1)\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "Trainer(model, optimizer, train_loader).train_epoch()\n"
            ),
        },
    )
    assert not migration.migrated
    reason = migration.entry.reason
    assert (
        "the training loop `for batch_idx, (data, target) in enumerate(tbar):` iterates "
        "`self.train_loader`, made by `get_instance(loaders, 'train_loader', config)` "
        "(its class is chosen at run time)"
    ) in reason
    assert "DataLoader subclass `BaseLoader` (the base of `Points`)" in reason
    assert "set_epoch" in reason and "full-batch" not in reason


def test_a_loop_that_handles_a_distributed_sampler_is_not_skipped_when_it_is_the_only_one():
    """Beside a loop ddpify shards, a library trainer's loop that sets the epoch of its own
    DistributedSampler is left alone (ddpm-style packages ship one); alone, it may be the
    loop that trains, on a loader built without that sampler: refused, not trusted."""
    source = (
        HEADER + "from torch.utils.data.distributed import DistributedSampler\n\n\n"
        "class Stream:\n"
        "    def __iter__(self):\n"
        "        for i in range(0, 64, 8):\n"
        "            yield data[i : i + 8]\n\n\n"
        "def train(loader, sampler=None):\n"
        "    if isinstance(sampler, DistributedSampler):\n"
        "        sampler.set_epoch(0)\n" + STEP.format(iterable="loader") + "\n\n"
        "train(Stream())\n"
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "the training loop `for xb in loader:` iterates `loader`" in result.reason


def test_a_frozen_extractor_under_dataparallel_in_a_metrics_module_leaves_the_model_wrapped(
    tmp_path,
):
    """The ddpm-style package: its FID module puts a frozen feature extractor under
    DataParallel and keeps it as its own `self.model`; the project is not a DataParallel
    one for that, and the model that trains is wrapped in DDP."""
    migration = _project(
        tmp_path,
        {
            "metrics.py": (
                "import torch\nimport torch.nn as nn\n\n\n"
                "class FeatureStats:\n"
                "    def __init__(self, device):\n"
                "        self.device = device\n"
                "        self.model = self.load_model()\n\n"
                "    def load_model(self):\n"
                "        net = nn.Linear(2, 4).requires_grad_(False)\n"
                "        if isinstance(self.device, list):\n"
                "            return nn.DataParallel(nn.Sequential(net), device_ids=self.device)\n"
                "        return net\n"
            ),
            "trainer.py": (
                "import torch\n\n\n"
                "class Trainer:\n"
                "    def __init__(self, model, optimizer):\n"
                "        self.model = model\n"
                "        self.optimizer = optimizer\n\n"
                "    def fit(self, batches):\n"
                "        for x in batches:\n"
                "            self.optimizer.zero_grad()\n"
                "            self.model(x).pow(2).mean().backward()\n"
                "            self.optimizer.step()\n"
            ),
            "train.py": (
                "import torch\nimport metrics\nfrom trainer import Trainer\n\n\n"
                "def chunks(data, size):\n"
                "    for i in range(0, len(data), size):\n"
                "        yield data[i : i + size]\n\n\n"
                "model = torch.nn.Linear(2, 1)\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "trainer = Trainer(model, optimizer)\n"
                "trainer.fit(chunks(torch.randn(32, 2), 8))\n"
            ),
        },
    )
    assert migration.migrated, migration.entry.reason
    assert migration.entry.shape == "single-GPU"
    assert "model = DDP(model" in migration.entry.output
    extractor = next(r for r in migration.results if r.filename.endswith("metrics.py"))
    assert "nn.DataParallel(nn.Sequential(net)" in extractor.output
    # The generator handed straight to `fit` is a batch stream too: split in the loop.
    trainer = next(r for r in migration.results if r.filename.endswith("trainer.py"))
    assert SPLIT_X in trainer.output
