"""Class-balanced sampling and fetcher objects (issue 11, the StarGAN v2 shapes).

A WeightedRandomSampler in the training loader is shared out by rank while keeping its
distribution (ddpify/migrate/weighted.py); a fetcher object built from loaders kept in an
attribute bundle (`loaders = SimpleNamespace(src=..., ref=...)`, `next(fetcher)`) feeds
the step from those loaders (ddpify/analysis/fetchers.py). The fixture pairs
weighted_sampler_balanced, fetcher_next_batch and gan_fetcher_weighted run in the batched
runner (tests/test_migrate_run.py) and verify (tests/test_verify_migrate.py); these check
what a user reads in the converted script and its report, and what the inserted sampler
draws.
"""

from __future__ import annotations

import pytest

from ddpify.migrate import migrate_source, snippets
from ddpify.migrate.pipeline import migrate_sources
from tests.helpers import FIXTURES

CASES = FIXTURES / "migrate"


def migrate(source: str):
    result = migrate_source(source, "t.py")
    assert result.migrated, result.reason
    return result


def test_a_weighted_sampler_is_replaced_by_the_distributed_one_written_once():
    before = (CASES / "weighted_sampler_balanced" / "before.py").read_text()
    result = migrate(before)
    out = result.output
    assert out.count("class DistributedWeightedSampler(torch.utils.data.Sampler):") == 1
    assert (
        "return DistributedWeightedSampler(torch.as_tensor(weights), len(weights), "
        "replacement=True)" in out
    )
    assert "DistributedSampler(" not in out.replace("DistributedWeightedSampler(", "")
    # The epoch loop moves the draw on, as it would a DistributedSampler's.
    assert "train_loader.sampler.set_epoch(epoch)" in out
    changes = [change.description for change in result.changes]
    assert any("WeightedRandomSampler is shared out by rank" in what for what in changes)
    assert migrate_source(out, "t.py").output == out  # a second run leaves it be


def test_the_import_the_conversion_made_unused_is_dropped_and_no_other():
    """WeightedRandomSampler is no longer called once the sampler is converted: its
    import goes; a name the user imported and never used (`RandomSampler`) stays, and so
    does the class where the script still names it (an `isinstance` check)."""
    before = (CASES / "weighted_sampler_balanced" / "before.py").read_text()
    out = migrate(before).output
    assert "from torch.utils.data import DataLoader, TensorDataset\n" in out
    assert "WeightedRandomSampler(" not in out.replace("DistributedWeightedSampler(", "")
    imported = "TensorDataset, WeightedRandomSampler"
    left_unused = before.replace(imported, "RandomSampler, " + imported)
    out = migrate(left_unused).output
    assert "from torch.utils.data import DataLoader, RandomSampler, TensorDataset\n" in out
    returned = "    return train_loader, val_loader"
    check = "    assert isinstance(sampler, WeightedRandomSampler)\n"
    still_named = before.replace(returned, check + returned)
    out = migrate(still_named).output
    assert "from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler" in out


def _sampler_class(rank: int, world: int):
    torch = pytest.importorskip("torch")
    code = snippets.WEIGHTED_SAMPLER.format(name="Weighted", torch="torch")
    scope = {"torch": torch, "RANK": rank, "WORLD_SIZE": world}
    exec(compile(code, "<snippet>", "exec"), scope)
    return scope["Weighted"]


def test_the_ranks_share_one_weighted_draw_without_overlap_and_redraw_each_pass():
    torch = pytest.importorskip("torch")
    weights = [0.05] * 15 + [1.0] * 4  # 19 samples: one is dropped for 2 ranks
    shares = [list(_sampler_class(rank, 2)(weights, 19)) for rank in (0, 1)]
    assert [len(s) for s in shares] == [9, 9]
    generator = torch.Generator()
    generator.manual_seed(0)
    whole = torch.multinomial(
        torch.as_tensor(weights, dtype=torch.double), 19, True, generator=generator
    ).tolist()[:18]
    assert shares[0] == whole[0::2] and shares[1] == whole[1::2]
    sampler = _sampler_class(0, 2)(weights, 19)
    first, second = list(sampler), list(sampler)
    assert first != second  # each pass draws anew, alike on every rank
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_the_weighted_draw_keeps_the_class_balance():
    pytest.importorskip("torch")
    labels = [0] * 90 + [1] * 10
    weights = [1 / 90 if label == 0 else 1 / 10 for label in labels]
    drawn = [i for rank in (0, 1) for i in _sampler_class(rank, 2)(weights, 4000)]
    minority = sum(labels[i] for i in drawn) / len(drawn)
    assert 0.45 < minority < 0.55  # the original's balance, not the data's 10%


def test_a_fetcher_over_a_bundle_of_loaders_trains_on_its_loader_only():
    before = (CASES / "fetcher_next_batch" / "before.py").read_text()
    result = migrate(before)
    out = result.output
    assert "sampler=DistributedSampler(traindataset, shuffle=shuffle)" in out
    assert "images[RANK" not in out  # the sampler shards it: no split of the batch
    # Each new iterator over the loader starts a pass: the sampler's epoch moves on there.
    restart = out.index("            self.iter = iter(self.loader)")
    assert out.rindex("self.loader.sampler.set_epoch(", 0, restart) > out.index("except Stop")
    notes = [item.why for item in result.needs_human]
    assert any(why.startswith("`loaders.val` comes from `get_loader`") for why in notes), notes
    assert not any("`loaders.train` comes from" in why for why in notes), notes


def test_a_gan_fetcher_over_two_weighted_loaders_wraps_both_models():
    before = (CASES / "gan_fetcher_weighted" / "before.py").read_text()
    out = migrate(before).output
    assert "return DistributedWeightedSampler(weights, len(weights))" in out
    assert "self.generator = DDP(self.generator" in out
    assert "self.discriminator = DDP(self.discriminator" in out
    assert "x_real[RANK" not in out


MODES = """\
import torch
from types import SimpleNamespace
from torch.utils.data import DataLoader, TensorDataset


def get_train_loader(n):
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=4,
                      shuffle=True)


def get_test_loader(n):
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=4)


class Fetcher:
    def __init__(self, loader):
        self.loader = loader
        self.iter = iter(loader)

    def __next__(self):
        try:
            return next(self.iter)
        except StopIteration:
            self.iter = iter(self.loader)
            return next(self.iter)


class Solver:
    def __init__(self):
        self.net = torch.nn.Linear(2, 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train(self, loaders):
        fetcher = Fetcher(loaders.src)
        for i in range(10):
            x, y = next(fetcher)
            self.opt.zero_grad()
            ((self.net(x) - y) ** 2).mean().backward()
            self.opt.step()

    @torch.no_grad()
    def sample(self, loaders):
        for x, _ in loaders.src:
            print(self.net(x).mean().item())


def main(mode):
    solver = Solver()
    if mode == "train":
        loaders = SimpleNamespace(src=get_train_loader(32))
        solver.train(loaders)
    else:
        loaders = SimpleNamespace(src=get_test_loader(16))
        solver.sample(loaders)


if __name__ == "__main__":
    main("train")
"""


def test_a_bundle_of_the_same_name_handed_only_to_sampling_keeps_its_loader_whole():
    out = migrate(MODES).output
    train = out[out.index("def get_train_loader") : out.index("def get_test_loader")]
    test = out[out.index("def get_test_loader") : out.index("class Fetcher")]
    assert "DistributedSampler(" in train
    assert "DistributedSampler(" not in test


# Modules built by a helper of another module and kept in an attribute dict, each trained
# by an optimizer over `self.nets[net]` in a loop over its keys: each is wrapped where the
# Solver receives the dict (tests/test_migrate_project_model_bundles.py has the details).
UNTRACED_MODEL = """\
from munch import Munch
from torch import nn


def build_model():
    generator = nn.DataParallel(nn.Linear(2, 2))
    critic = nn.DataParallel(nn.Linear(2, 1))
    return Munch(generator=generator, critic=critic)
"""
UNTRACED_SOLVER = """\
import torch
from torch import nn

from model import build_model


class Solver(nn.Module):
    def __init__(self):
        super().__init__()
        self.nets = build_model()
        self.optims = {}
        for net in self.nets.keys():
            self.optims[net] = torch.optim.Adam(params=self.nets[net].parameters(), lr=1e-3)

    def train(self, loader):
        nets = self.nets
        for x, y in loader:
            loss = (nets.critic(nets.generator(x)) - y).pow(2).mean()
            for optim in self.optims.values():
                optim.zero_grad()
            loss.backward()
            for optim in self.optims.values():
                optim.step()
"""
UNTRACED_MAIN = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

from solver import Solver


def main():
    loader = DataLoader(TensorDataset(torch.randn(32, 2), torch.randn(32, 1)), batch_size=8)
    Solver().train(loader)


if __name__ == "__main__":
    main()
"""


def test_modules_a_helper_returns_in_a_dict_trained_by_key_are_wrapped_where_received():
    texts = {"main.py": UNTRACED_MAIN, "solver.py": UNTRACED_SOLVER, "model.py": UNTRACED_MODEL}
    results = migrate_sources(texts)
    assert all(result.migrated for result in results), results[0].reason
    solver, model = results[1].output, results[2].output
    assert (
        "        for net in self.nets.keys():\n"
        "            self.nets[net] = DDP(self.nets[net].module, "
    ) in solver
    # the helper keeps its DataParallel (one device per process), DDP replaces it for the
    # trained models only; it imported `from torch import nn` alone, so torch comes in
    assert "DDP" not in model
    assert model.count("device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None") == 2
    assert "\nimport torch\n" in model
    for result in results:
        compile(result.output, result.filename, "exec")
