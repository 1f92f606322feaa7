"""Training streams: a DataLoader over an IterableDataset of the project is sharded inside
the class that yields the items (ddpify/migrate/streams.py), not refused.

The sharded classes are executed here with the environment torchrun would set, to check
what each rank reads: disjoint items, as many on every rank, the tail dropped, `len()` the
rank's share. fixtures/migrate/text_stream runs under torchrun with the other cases.
"""

from __future__ import annotations

import pytest

from ddpify.migrate.pipeline import migrate_source
from ddpify.migrate.project import load_project, migrate_project

STREAM_MODULE = (
    "import torch\n"
    "from torch.utils.data import IterableDataset\n\n\n"
    "class Stream(IterableDataset):\n"
    "    def __init__(self, rows):\n"
    "        self.rows = rows\n\n"
    "    def __iter__(self):\n"
    "        yield from self.rows\n\n"
    "    def __len__(self):\n"
    "        return len(self.rows)\n\n\n"
    "class Subset(Stream):\n"
    "    def __init__(self, stream, size):\n"
    "        self.rows = stream.rows[:size]\n\n"
    "    def __iter__(self):\n"
    "        yield from super().__iter__()\n"
)
ENTRY = (
    "import torch\n"
    "from torch.utils.data import DataLoader\n"
    "from data import Stream, Subset\n\n"
    "model = torch.nn.Linear(4, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "rows = [torch.randn(4) for _ in range(32)]\n"
    "val_data = Stream(rows[:8])\n"
    "val_loader = DataLoader(val_data, batch_size=4)\n"
    "for epoch in range(2):\n"
    "    train = Subset(Stream(rows), 16)\n"
    "    loader = DataLoader(train, batch_size=4)\n"
    "    for x in loader:\n"
    "        opt.zero_grad()\n"
    "        model(x).sum().backward()\n"
    "        opt.step()\n"
    "    with torch.no_grad():\n"
    "        print(sum(model(x).sum().item() for x in val_loader))\n"
)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "data.py").write_text(STREAM_MODULE, encoding="utf-8")
    (tmp_path / "train.py").write_text(ENTRY, encoding="utf-8")
    return migrate_project(load_project(tmp_path / "train.py"), "train.py")


def _output(migration, name):
    return next(r for r in migration.results if r.filename.endswith(name))


def test_the_class_that_yields_the_items_is_sharded_once(project):
    assert project.migrated, project.entry.reason
    data = _output(project, "data.py").output
    # The subclass only delegates to super().__iter__(): the base shards, and only it.
    assert data.count("@rank_sharded_iter\n") == 1
    assert "@rank_sharded_iter\n    def __iter__(self):\n        yield from self.rows" in data
    assert "@rank_sharded_len\n    def __len__(self):" in data
    entry = project.entry.output
    assert "    train.shard_by_rank = True\n    loader = DataLoader(train, batch_size=4)" in entry
    # No sampler (a DataLoader over an IterableDataset rejects one), so no set_epoch.
    assert "sampler" not in entry and "set_epoch" not in entry
    # The evaluation stream reads all of its items on every rank, and the report says so.
    assert "val_data.shard_by_rank" not in entry
    assert any("`val_data` is an evaluation stream" in h.why for h in project.entry.needs_human)


def test_migrating_the_output_again_changes_nothing(project, tmp_path):
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    for result in project.results:
        (again_dir / result.filename).write_text(result.output, encoding="utf-8")
    again = migrate_project(load_project(again_dir / "train.py"), "train.py")
    assert again.migrated and not again.changed


def _rank_view(code, monkeypatch, rank, world_size):
    """The migrated module's namespace as rank `rank` of `world_size` sees it."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    namespace: dict = {"__name__": "data"}
    exec(compile(code, "data.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_reads_its_own_items_and_as_many_as_the_others(project, monkeypatch, world_size):
    pytest.importorskip("torch")
    code = _output(project, "data.py").output
    seen = []
    for rank in range(world_size):
        data = _rank_view(code, monkeypatch, rank, world_size)
        train = data["Subset"](data["Stream"](list(range(11))), 11)
        train.shard_by_rank = True
        items = list(train)
        assert items == list(range(rank, 11 - 11 % world_size, world_size))
        assert len(train) == 11 // world_size == len(items)
        seen.extend(items)
        plain = data["Stream"](list(range(11)))  # not switched on: the whole stream
        assert list(plain) == list(range(11)) and len(plain) == 11
    assert sorted(seen) == list(range(11 - 11 % world_size))


def test_random_draws_in_the_stream_are_reported():
    source = (
        "import random\nimport torch\n"
        "from torch.utils.data import DataLoader, IterableDataset\n\n\n"
        "class Windows(IterableDataset):\n"
        "    def __init__(self, lines, size):\n"
        "        self.lines = random.sample(lines, size)\n\n"
        "    def __iter__(self):\n"
        "        for line in self.lines:\n"
        "            start = random.randint(0, len(line) - 4)\n"
        "            yield torch.tensor(line[start:start + 4], dtype=torch.float)\n\n\n"
        "def main():\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    lines = [list(range(i, i + 9)) for i in range(40)]\n"
        "    for epoch in range(2):\n"
        "        train_set = Windows(lines, 16)\n"
        "        loader = DataLoader(train_set, batch_size=4)\n"
        "        for x in loader:\n"
        "            opt.zero_grad()\n"
        "            model(x).sum().backward()\n"
        "            opt.step()\n\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    draws = [h for h in result.needs_human if "draws random numbers" in h.why]
    assert {h.anchor for h in draws} == {
        "self.lines = random.sample(lines, size)",
        "start = random.randint(0, len(line) - 4)",
    }
    assert all("verify is inconclusive" in h.why for h in draws)


def test_a_stream_built_inside_the_loader_call_is_refused_with_the_way_out():
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, IterableDataset\n"
        "class Stream(IterableDataset):\n    def __iter__(self):\n"
        "        yield torch.randn(2), torch.randn(1)\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(Stream(), batch_size=4)\n"
        "for x, y in loader:\n    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "bind the dataset to a name first" in result.reason


def test_set_epoch_follows_a_loader_built_inside_the_epoch_loop():
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
        "def main():\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))\n"
        "    for epoch in range(3):\n"
        "        loader = DataLoader(data, batch_size=8, shuffle=True)\n"
        "        for x, y in loader:\n"
        "            opt.zero_grad()\n"
        "            ((model(x) - y) ** 2).mean().backward()\n"
        "            opt.step()\n\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    lines = result.output.splitlines()
    built = next(i for i, line in enumerate(lines) if "loader = DataLoader(" in line)
    assert lines[built + 1].strip() == "loader.sampler.set_epoch(epoch)"
    assert sum("set_epoch" in line for line in lines) == 1


SAMPLE_DATA = (
    "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
    "def sample_data(loader):\n"
    "    while True:\n"
    "        yield from loader\n\n\n"
    "def main():\n"
    "    model = torch.nn.Linear(1, 1)\n"
    "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "    data = TensorDataset(torch.arange(16.0).view(-1, 1))\n"
    "    loader = DataLoader(data, batch_size=4, shuffle=True)\n"
    "    batches = sample_data(loader)\n"
    "    for step in range(20):\n"
    "        (x,) = next(batches)\n"
    "        opt.zero_grad()\n"
    "        model(x).sum().backward()\n"
    "        opt.step()\n\n\n"
    "if __name__ == '__main__':\n    main()\n"
)


def test_an_endless_generator_over_the_loader_reshuffles_on_every_pass():
    """`while True: yield from loader`: no epoch loop to call set_epoch in; the new pass
    starts in the generator, and the sampler's epoch moves on there."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    source = SAMPLE_DATA
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    assert not any("nothing calls set_epoch" in h.why for h in result.needs_human)
    assert migrate_source(result.output, "train.py").output == result.output
    namespace: dict = {"__name__": "train"}
    exec(compile(result.output, "train.py", "exec"), namespace)
    data = TensorDataset(torch.arange(8.0))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    batches = namespace["sample_data"](DataLoader(data, batch_size=8, sampler=sampler))
    passes = [next(batches)[0].tolist() for _ in range(3)]
    assert sampler.epoch == 2
    assert all(sorted(order) == list(range(8)) for order in passes)
    assert len({tuple(order) for order in passes}) == 3  # each pass its own order


WORKER_SPLIT = (
    "import torch\n"
    "from torch.utils.data import DataLoader, IterableDataset, get_worker_info\n\n\n"
    "class Numbers(IterableDataset):\n"
    "    def __init__(self, n):\n"
    "        self.n = n\n\n"
    "    def __iter__(self):\n"
    "        info = get_worker_info()\n"
    "        start, step = (0, 1) if info is None else (info.id, info.num_workers)\n"
    "        for i in range(start, self.n, step):\n"
    "            yield torch.tensor([float(i)])\n\n\n"
    "def main():\n"
    "    model = torch.nn.Linear(1, 1)\n"
    "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "    train_set = Numbers(64)\n"
    "    loader = DataLoader(train_set, batch_size=4, num_workers=2)\n"
    "    for x in loader:\n"
    "        opt.zero_grad()\n"
    "        model(x).sum().backward()\n"
    "        opt.step()\n\n\n"
    "if __name__ == '__main__':\n    main()\n"
)


def test_a_stream_split_by_dataloader_worker_is_split_by_rank_within_each_worker(monkeypatch):
    """The class already splits by `get_worker_info()`: each worker's part is split by
    rank, so (rank, worker) pairs read disjoint items, as many per rank."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    result = migrate_source(WORKER_SPLIT, "train.py")
    assert result.migrated, result.reason
    seen: list[int] = []
    for rank in range(2):
        data = _rank_view(result.output, monkeypatch, rank, 2)
        counts = []
        for worker in range(3):
            info = SimpleNamespace(id=worker, num_workers=3)
            data["get_worker_info"] = lambda info=info: info
            stream = data["Numbers"](64)
            stream.shard_by_rank = True
            items = [int(x.item()) for x in stream]
            counts.append(len(items))
            seen.extend(items)
        assert counts == [11, 10, 10]  # workers' parts of 22, 21, 21 items, tails dropped
    assert len(seen) == len(set(seen)) == 62


def test_a_stream_that_splits_itself_by_rank_is_left_to_it_and_named():
    source = WORKER_SPLIT.replace(
        "        start, step = (0, 1) if info is None else (info.id, info.num_workers)\n",
        "        start, step = torch.distributed.get_rank(), torch.distributed.get_world_size()\n",
    )
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    assert "rank_sharded_iter" not in result.output and "shard_by_rank" not in result.output
    assert any("leaves its sharding to them" in h.why for h in result.needs_human)


def test_a_map_style_dataset_named_like_a_stream_elsewhere_still_gets_a_sampler():
    """`train` is a stream in one function and a TensorDataset where the training loader
    is built: the binding beside the loader decides."""
    source = WORKER_SPLIT.replace(
        "    train_set = Numbers(64)\n"
        "    loader = DataLoader(train_set, batch_size=4, num_workers=2)\n",
        "    train_set = torch.utils.data.TensorDataset(torch.randn(64, 1))\n"
        "    loader = DataLoader(train_set, batch_size=4, shuffle=True)\n",
    ).replace(
        "def main():\n",
        "def preview():\n    train_set = Numbers(8)\n    return list(train_set)\n\n\ndef main():\n",
    )
    result = migrate_source(source, "train.py")
    assert result.migrated, result.reason
    assert "sampler=DistributedSampler(train_set, shuffle=True)" in result.output
    assert "shard_by_rank" not in result.output
