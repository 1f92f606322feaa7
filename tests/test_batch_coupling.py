"""Comparisons of a batch's rows with each other (contrastive losses): found by the
analysis, named by migrate where the batch is split, and excused by verify only as a
reason the gradients may differ."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.batch_coupling import (
    batch_comparisons,
    setting_groupings,
    setting_sized_tensors,
)
from ddpify.analysis.tree import Tree
from ddpify.migrate import migrate_source
from ddpify.migrate.analyze import Options


def comparisons(body: str) -> list[str]:
    source = "import torch\nimport torch.nn as nn\n\n" + textwrap.dedent(body)
    tree = Tree(cst.parse_module(source))
    return [tree.code(node) for node in batch_comparisons(tree)]


@pytest.mark.parametrize(
    "expression",
    [
        "torch.matmul(anchor, contrast.T)",
        "anchor @ contrast.t()",
        "torch.mm(anchor, contrast.transpose(0, 1))",
        "anchor @ anchor.permute(1, 0)",
        "torch.cdist(anchor, contrast)",
    ],
)
def test_a_batch_compared_with_a_batch_is_found(expression):
    found = comparisons(
        f"""
        def similarity_loss(features, temperature=0.1):
            anchor = features[:, 0]
            contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
            logits = {expression} / temperature
            return logits.logsumexp(dim=1).mean()
        """
    )
    assert found == [expression]


@pytest.mark.parametrize(
    "body",
    [
        # a layer's own weight: a projection of each sample, not a comparison
        "return x @ self.weight.T",
        "w = self.weight\n    return torch.matmul(x, w.t())",
        "w = self.layers[0].weight\n    return x @ w.T",
        # attention inside each sample: the last two dimensions, never the batch
        "return torch.matmul(x, x.transpose(-2, -1))",
        "return x @ x",
    ],
)
def test_projections_and_per_sample_products_are_not_comparisons(body):
    source = "class Layer(nn.Module):\n    def forward(self, x):\n        " + body.replace(
        "\n    ", "\n        "
    )
    assert comparisons(source) == []


def test_values_a_constructor_builds_are_not_a_batch():
    # an orthogonal initial weight from an SVD: `self.dim` reads `self`, not the argument
    body = """
    class Operator(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim = dim
            u, _, v = torch.svd(torch.randn(self.dim, self.dim))
            self.weight = nn.Parameter(torch.mm(u, v.t()))
    """
    assert comparisons(body) == []


def test_module_level_products_are_not_comparisons():
    assert comparisons("a = torch.ones(3, 2)\nsim = a @ a.T\n") == []


CONTRASTIVE = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ContrastiveLoss(nn.Module):
    def __init__(self, temperature=0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        z = F.normalize(torch.cat([z1, z2]), dim=1)
        sim = torch.matmul(z, z.T) / self.temperature
        sim.fill_diagonal_(-1e9)
        n = z1.size(0)
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
        return F.cross_entropy(sim, targets)


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 10))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
    criterion = ContrastiveLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for (x,) in loader:
            noisy = x + 0.1 * torch.randn_like(x)
            loss = criterion(model(x), model(noisy))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
"""


def test_migrate_names_a_contrastive_loss_that_now_compares_one_rank_only():
    result = migrate_source(CONTRASTIVE, "train_contrastive.py")
    assert result.migrated, result.reason
    notes = [item for item in result.needs_human if "compares every row" in item.why]
    assert len(notes) == 1
    assert "all_gather" in notes[0].why
    line = result.output.splitlines()[notes[0].line - 1].strip()
    assert line == "sim = torch.matmul(z, z.T) / self.temperature"


def test_migrate_says_nothing_of_a_product_that_compares_no_rows():
    plain = CONTRASTIVE.replace("sim = torch.matmul(z, z.T)", "sim = torch.matmul(z, z)")
    result = migrate_source(plain, "train_contrastive.py")
    assert result.migrated, result.reason
    assert not [item for item in result.needs_human if "compares every row" in item.why]


# -- a mean over the targets not ignored ------------------------------------------------

PADDED_TOKENS = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class CharModel(nn.Module):
    def __init__(self, vocab=12, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        loss = None
        if targets is not None:
            flat = logits.view(-1, logits.size(-1))
            loss = F.cross_entropy(flat, targets.view(-1), ignore_index=-1)
        return logits, loss


def main():
    torch.manual_seed(0)
    words = torch.randint(0, 12, (200, 8))
    targets = torch.where(torch.rand(200, 8) < 0.3, -1, words)
    model = CharModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(20):
        ix = torch.randint(0, 200, (16,))
        X, Y = words[ix], targets[ix]
        logits, loss = model(X, Y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
"""


def test_migrate_names_a_loss_that_averages_over_the_targets_it_keeps():
    result = migrate_source(PADDED_TOKENS, "train_chars.py")
    assert result.migrated, result.reason
    notes = [item for item in result.needs_human if "ignore_index" in item.why]
    assert len(notes) == 1
    assert "all-reduced" in notes[0].why
    line = result.output.splitlines()[notes[0].line - 1].strip()
    assert line.startswith("loss = F.cross_entropy(")


@pytest.mark.parametrize(
    "change",
    [
        (", ignore_index=-1)", ")"),  # every target counts: the ranks' means average right
        ("ignore_index=-1)", "ignore_index=-1, reduction='sum')"),  # no mean at all
    ],
)
def test_migrate_says_nothing_of_a_loss_with_one_denominator(change):
    result = migrate_source(PADDED_TOKENS.replace(*change), "train_chars.py")
    assert result.migrated, result.reason
    assert not [item for item in result.needs_human if "ignore_index" in item.why]


def groupings(body: str) -> list[str]:
    source = "import torch\nimport torch.nn as nn\n\n" + textwrap.dedent(body)
    tree = Tree(cst.parse_module(source))
    return [tree.code(node) for node in setting_groupings(tree)]


PATCH_NCE = """
class PatchNCELoss(nn.Module):
    def forward(self, feat_q, feat_k):
        dim = feat_q.shape[1]
        if self.opt.all_negatives:
            group = 1
        else:
            group = {group}
        feat_q = feat_q.view(group, -1, dim)
        feat_k = feat_k.view(group, -1, dim)
        return torch.bmm(feat_q, feat_k.transpose(2, 1))
"""


@pytest.mark.parametrize("group", ["self.opt.batch_size", "args.batch_size", 'cfg["batch_size"]'])
def test_rows_grouped_by_a_batch_size_setting_then_compared_are_found(group):
    assert groupings(PATCH_NCE.format(group=group)) == ["torch.bmm(feat_q, feat_k.transpose(2, 1))"]
    # a contrastive loss over the batch it is not: migrate's note stays silent about it
    assert comparisons(PATCH_NCE.format(group=group)) == []


@pytest.mark.parametrize(
    "group",
    [
        "feat_q.size(0) // 64",  # the tensor's own size: follows whatever batch it is given
        "batch_size",  # a bare local may be `x.size(0)`: not read as a setting
    ],
)
def test_rows_grouped_by_the_tensors_own_size_are_not_a_setting(group):
    assert groupings(PATCH_NCE.format(group=group)) == []


def test_attention_over_a_reshape_by_heads_is_not_a_grouping_by_setting():
    body = """
    def attention(self, q, k):
        q = q.view(self.heads, -1, self.head_dim)
        k = k.view(self.heads, -1, self.head_dim)
        return torch.bmm(q, k.transpose(1, 2))
    """
    assert groupings(body) == []


# A CLIP-style step that sizes its targets and its halves by the loader's batch-size setting.
SETTING_SIZED = """
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def step(model, optimizer, x, y, batch_size):
    z = F.normalize(model(torch.cat([x, y])), dim=1)
    logits = z[:batch_size] @ z[batch_size:].T
    targets = torch.arange(batch_size)
    loss = F.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 10))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Linear(10, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = 0
    for x, y in loader:
        mask = torch.ones(args.batch_size)
        seen += args.batch_size
        step(model, optimizer, x * mask[:, None], y, args.batch_size)
    print(seen)


if __name__ == "__main__":
    main()
"""


def setting_sized(source: str) -> list[str]:
    tree = Tree(cst.parse_module(source))
    return [tree.code(tree.statement(node)).strip() for node in setting_sized_tensors(tree)]


def test_tensors_sized_by_the_loaders_batch_setting_are_found():
    assert setting_sized(SETTING_SIZED) == [
        "logits = z[:batch_size] @ z[batch_size:].T",
        "logits = z[:batch_size] @ z[batch_size:].T",
        "targets = torch.arange(batch_size)",
        "mask = torch.ones(args.batch_size)",
    ]


def test_a_helper_parameter_is_the_setting_only_where_every_call_passes_it():
    other = SETTING_SIZED.replace("    print(seen)\n", "    step(model, optimizer, x, y, 4)\n")
    assert setting_sized(other) == ["mask = torch.ones(args.batch_size)"]


def test_a_count_or_a_setting_other_than_the_loaders_is_not_a_size():
    found = setting_sized(SETTING_SIZED)
    assert "seen += args.batch_size" not in found
    other = SETTING_SIZED.replace("torch.ones(args.batch_size)", "torch.ones(args.eval_batch_size)")
    assert "mask = torch.ones(args.eval_batch_size)" not in setting_sized(other)


def test_global_policy_sizes_the_step_by_the_per_process_batch():
    source = SETTING_SIZED
    result = migrate_source(source, "train_clip.py", Options(batch_policy="global"))
    assert result.migrated, result.reason
    assert "mask = torch.ones((args.batch_size // WORLD_SIZE))" in result.output
    assert "seen += args.batch_size\n" in result.output  # a count, not a size: unchanged
    assert "targets = torch.arange((batch_size // WORLD_SIZE))" in result.output
    changes = [c for c in result.changes if "sizes a tensor by the batch-size" in c.description]
    lines = [result.output.splitlines()[c.line - 1].strip() for c in changes]
    assert lines == [
        "logits = z[:(batch_size // WORLD_SIZE)] @ z[(batch_size // WORLD_SIZE):].T",
        "targets = torch.arange((batch_size // WORLD_SIZE))",
        "mask = torch.ones((args.batch_size // WORLD_SIZE))",
    ]
    # the per-rank policy keeps the setting: each process's loader yields that many rows
    per_rank = migrate_source(source, "train_clip.py", Options(batch_policy="per-rank"))
    assert "mask = torch.ones(args.batch_size)" in per_rank.output
