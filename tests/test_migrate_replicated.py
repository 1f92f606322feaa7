"""Steps that keep their batch whole (full batch, one example per step, a bptt step that
carries its state) run whole on every rank: what a user reads in the converted script and
its report, and that a loop that pulls its batch from an iterator is never called full
batch. The fixture pairs full_batch_graph, full_batch_passed_in (the whole graph handed to a
step function), one_example_steps and bptt_carried_state run
as python and under torchrun in the batched runner (tests/test_migrate_run.py) and are
verified in tests/test_verify_migrate.py."""

from __future__ import annotations

import pytest

from ddpify.migrate import migrate_source
from tests.helpers import FIXTURES

# case -> (the kind of step, the start of the line the report names to share the work)
REPLICATED = {
    "full_batch_graph": ("full batch", "output = model(features, adj)"),
    "full_batch_passed_in": ("full batch", "output = model(*input)"),
    "one_example_steps": ("one example per step", "x, y = Xtr[[step_num]], Ytr[[step_num]]"),
    "bptt_carried_state": ("carried state", "ids = tokens.view(batch_size, -1)"),
}


def migrate_case(case: str):
    text = (FIXTURES / "migrate" / case / "before.py").read_text()
    result = migrate_source(text, "before.py")
    assert result.migrated, result.reason
    return result


@pytest.mark.parametrize("case", sorted(REPLICATED))
def test_a_step_that_keeps_its_batch_whole_is_replicated_and_says_so(case):
    kind, line = REPLICATED[case]
    result = migrate_case(case)
    out = result.output
    # Nothing is split by rank and the learning rate stays: every rank runs the original step.
    for split in ("RANK * len(", "RANK::", "* WORLD_SIZE", "// WORLD_SIZE"):
        assert split not in out
    assert f"# ddpify: replicated step ({kind})" in out
    assert result.replicated is not None and kind in result.replicated
    assert "no speed-up" in result.replicated and "exact because" in result.replicated
    # The report names the line to change to share the work.
    items = [item for item in result.needs_human if item.why.startswith("replicated")]
    assert len(items) == 1 and items[0].line is not None
    assert out.splitlines()[items[0].line - 1].strip().startswith(line)


def test_the_report_puts_the_replication_policy_first():
    import io

    result = migrate_case("full_batch_graph")
    stream = io.StringIO()
    result.render(stream)
    text = stream.getvalue()
    assert "Batch policy: replicated (every rank computes the whole step)" in text
    assert text.index("Replication: replicated") < text.index("Changes:")


def test_an_unseeded_replicated_step_is_not_called_exact():
    text = (FIXTURES / "migrate" / "bptt_carried_state" / "before.py").read_text()
    result = migrate_source(text.replace("torch.manual_seed(3)\n", ""), "before.py")
    assert result.migrated, result.reason
    assert "does not seed torch" in result.replicated
    assert "exact because" not in result.replicated


def test_a_project_that_builds_a_data_loader_is_never_replicated():
    """A DataLoader anywhere means the step may draw from it in a way ddpify did not
    follow: refused, naming the loop, rather than N copies of the same work."""
    text = (FIXTURES / "migrate" / "full_batch_graph" / "before.py").read_text()
    text = text.replace(
        "import torch.nn.functional as F\n",
        "import torch.nn.functional as F\nfrom torch.utils.data import DataLoader\n",
    )
    extra = "extra = DataLoader(features, batch_size=4)\n"
    text = text.replace("idx_val = torch.arange", extra + "idx_val = torch.arange")
    result = migrate_source(text, "before.py")
    assert not result.migrated
    assert "for epoch in range(args.epochs):" in result.reason
    assert "replicated" not in result.reason


PULLED = """
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler


def balanced_sampler(labels):
    counts = torch.bincount(labels).float()
    return WeightedRandomSampler((1.0 / counts)[labels], len(labels))


def make_loader(x, labels):
    sampler = balanced_sampler(labels)
    return DataLoader(TensorDataset(x, labels), batch_size=4, sampler=sampler, drop_last=True)


class Fetcher:
    def __init__(self, loader):
        self.loader = loader

    def __next__(self):
        try:
            x, y = next(self.iter)
        except (AttributeError, StopIteration):
            self.iter = iter(self.loader)
            x, y = next(self.iter)
        return {"x": x, "y": y}


def d_loss(disc, x, y):
    return nn.functional.cross_entropy(disc(x), y)


class Trainer:
    def __init__(self):
        self.disc = nn.Linear(3, 2)
        self.opt = torch.optim.Adam(self.disc.parameters(), lr=1e-3)

    def train(self, loaders, iters):
        fetcher = Fetcher(loaders["src"])
        for i in range(iters):
            inputs = next(fetcher)
            loss = d_loss(self.disc, inputs["x"], inputs["y"])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()


if __name__ == "__main__":
    labels = torch.tensor([0] * 12 + [1] * 4)
    loaders = {"src": make_loader(torch.randn(16, 3), labels)}
    Trainer().train(loaders, 5)
"""


def test_a_loop_that_pulls_its_batch_each_step_is_never_called_full_batch():
    result = migrate_source(PULLED, "train.py")
    assert not result.migrated
    reason = result.reason
    assert "full-batch" not in reason and "replicated" not in reason
    assert "`inputs = next(fetcher)`" in reason
    assert '`fetcher = Fetcher(loaders["src"])`' in reason
    # The real obstacle: the loader's own weighted draw, which a DistributedSampler replaces.
    assert "DataLoader in `make_loader`" in reason
    assert "WeightedRandomSampler((1.0 / counts)[labels], len(labels))" in reason
    # `indices[RANK::WORLD_SIZE]` shares unequally when the count does not divide: a hang.
    assert "`indices[RANK::WORLD_SIZE]`" in reason and "unequal shares" in reason
    assert "different numbers of steps" in reason and "drop the remainder" in reason


def test_a_set_numbered_in_its_order_is_named_as_data_that_differs_by_rank():
    """Replicated ranks must build the same data; `enumerate(set(names))` numbers strings
    in hash order, which differs between torchrun's processes. A sorted set does not."""
    text = (FIXTURES / "migrate" / "full_batch_graph" / "before.py").read_text()
    helper = (
        "def encode(names):\n"
        "    classes = set(names)\n"
        "    return {c: i for i, c in enumerate(classes)}\n\n\n"
        "def encode_sorted(names):\n"
        "    return {c: i for i, c in enumerate(sorted(list(set(names))))}\n\n\n"
    )
    text = text.replace("class GraphConvNet", helper + "class GraphConvNet")
    result = migrate_source(text, "before.py")
    assert result.migrated, result.reason
    notes = [item for item in result.needs_human if "hash randomisation" in item.why]
    assert len(notes) == 1
    assert result.output.splitlines()[notes[0].line - 1].strip() == "classes = set(names)"


def test_tensors_a_function_rebinds_through_global_are_not_full_batch():
    """`global x` in a helper the loop calls: the model's input may change every step, so
    the step is not proven full-batch and is not replicated."""
    source = (
        "import torch\nmodel = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "x, y = torch.randn(8, 2), torch.randn(8, 1)\n"
        "def next_chunk():\n    global x\n    x = torch.randn(8, 2)\n"
        "for epoch in range(3):\n    next_chunk()\n"
        "    loss = ((model(x) - y) ** 2).mean()\n    loss.backward()\n    opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "cannot tell where the batch enters the step" in result.reason


@pytest.mark.parametrize("case", sorted(REPLICATED))
def test_a_replicated_step_logs_the_whole_batch_not_a_shard(case):
    """Every rank computes the whole step, so rank 0's loss is the original's: the report
    must not tell the user to all-reduce it (DDP054), while the print stays on rank 0."""
    result = migrate_case(case)
    assert any(c.description == "logs on global rank 0 only" for c in result.changes)
    assert not [item for item in result.needs_human if "DDP054" in item.why]


def test_a_sharded_step_still_says_its_loss_is_rank_zeros_shard():
    result = migrate_case("single_toplevel")
    shard = [item for item in result.needs_human if "DDP054" in item.why]
    assert shard and all("rank 0's shard only" in item.why for item in shard)


def test_the_advice_to_split_a_full_batch_says_unequal_shares_keep_the_mean():
    result = migrate_case("full_batch_graph")
    advice = next(item.why for item in result.needs_human if item.why.startswith("replicated"))
    assert "`X[RANK::WORLD_SIZE]`" in advice and "does not divide by WORLD_SIZE" in advice


def test_a_step_function_handed_a_batch_the_loop_makes_is_not_full_batch():
    """Noop of full_batch_passed_in: when the loop hands the step function rows it picks
    each step (`train_iter(..., (features[rows], adj_mat), ...)` with `rows` drawn in the
    loop), the model's input is not built before the loop, so the step is not replicated
    as a full batch."""
    text = (FIXTURES / "migrate" / "full_batch_passed_in" / "before.py").read_text()
    text = text.replace(
        "    for epoch in range(args.epochs):\n        train_iter(epoch + 1, gat_net, optimizer, "
        "criterion, (features, adj_mat),",
        "    for epoch in range(args.epochs):\n        picked = features * torch.rand(1)\n"
        "        train_iter(epoch + 1, gat_net, optimizer, criterion, (picked, adj_mat),",
    )
    assert "picked = features" in text
    result = migrate_source(text, "before.py")
    assert "# ddpify: replicated step" not in (result.output or "")
