"""Fixes of the data rules: DDP020 adds a DistributedSampler (unsafe), DDP021 drops
`shuffle=True`, DDP022 inserts `set_epoch` at the top of the epoch loop, DDP023 gives
every rank the same sampler seed."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import fix, fix_cleanly, lint


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def check_fixed(before: str, expected: str, code: str, unsafe: bool = False) -> None:
    assert fix_cleanly(before, code, unsafe) == expected


# -- DDP022: set_epoch --------------------------------------------------------------------

DDP022_CASES = [
    pytest.param(
        """
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        sampler = DistributedSampler(ds)
        loader = DataLoader(ds, sampler=sampler)
        for epoch in range(3):  # epochs
            # one pass
            for batch in loader:
                step(batch)
        """,
        """
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        sampler = DistributedSampler(ds)
        loader = DataLoader(ds, sampler=sampler)
        for epoch in range(3):  # epochs
            sampler.set_epoch(epoch)
            # one pass
            for batch in loader:
                step(batch)
        """,
        id="top-level-keeps-comments",
    ),
    pytest.param(
        """
        import torch.utils.data as tud


        def main(epochs):
            loader = tud.DataLoader(
                ds,
                sampler=tud.DistributedSampler(ds),  # shard
            )
            for ep in range(epochs):
                for batch in loader:
                    loss = model(
                        batch,
                    )
            return loss
        """,
        """
        import torch.utils.data as tud


        def main(epochs):
            loader = tud.DataLoader(
                ds,
                sampler=tud.DistributedSampler(ds),  # shard
            )
            for ep in range(epochs):
                loader.sampler.set_epoch(ep)
                for batch in loader:
                    loss = model(
                        batch,
                    )
            return loss
        """,
        id="inline-sampler-in-function",
    ),
    pytest.param(
        """
        from torch.utils.data import DataLoader, DistributedSampler


        class Trainer:
          def __init__(self, ds):
            self.train_sampler = DistributedSampler(ds)
            self.loader = DataLoader(ds, sampler=self.train_sampler)

          def fit(self, max_epochs):
            for epoch in range(max_epochs):
              for batch in self.loader:
                self.step(batch)
        """,
        """
        from torch.utils.data import DataLoader, DistributedSampler


        class Trainer:
          def __init__(self, ds):
            self.train_sampler = DistributedSampler(ds)
            self.loader = DataLoader(ds, sampler=self.train_sampler)

          def fit(self, max_epochs):
            for epoch in range(max_epochs):
              self.train_sampler.set_epoch(epoch)
              for batch in self.loader:
                self.step(batch)
        """,
        id="attribute-across-methods-two-space-indent",
    ),
    pytest.param(
        """
        from torch.utils.data import DistributedSampler
        if __name__ == "__main__":
            sampler = DistributedSampler(ds)
            for epoch in range(3):
                pass
        """,
        """
        from torch.utils.data import DistributedSampler
        if __name__ == "__main__":
            sampler = DistributedSampler(ds)
            for epoch in range(3):
                sampler.set_epoch(epoch)
                pass
        """,
        id="both-under-the-main-guard",
    ),
]


@pytest.mark.parametrize(("before", "expected"), DDP022_CASES)
def test_set_epoch_fix(before, expected):
    check_fixed(src(before), src(expected), "DDP022")


NO_DDP022_FIX = [
    pytest.param(
        """
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(ds)
        loader = DataLoader(ds, sampler=sampler)
        epoch = 0
        while epoch < 3:
            epoch += 1
        """,
        id="while-loop",
    ),
    pytest.param(
        """
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(ds)
        for epoch in range(3):
            pass
        for epoch in range(3):
            pass
        """,
        id="two-loops",
    ),
    pytest.param(
        """
        from torch.utils.data import DataLoader, DistributedSampler
        def build(ds):
            return DataLoader(ds, sampler=DistributedSampler(ds))
        def main():
            loader = build(ds)
            for epoch in range(3):
                pass
        """,
        id="sampler-out-of-scope",
    ),
    pytest.param(
        """
        from torch.utils.data import DataLoader, DistributedSampler
        for epoch in range(3):
            pass
        sampler = DistributedSampler(ds)
        """,
        id="loop-before-sampler",
    ),
    pytest.param(
        """
        from torch.utils.data import DistributedSampler
        sampler = DistributedSampler(ds) if distributed else None
        for epoch in range(3):
            pass
        """,
        id="sampler-may-be-none",
    ),
    pytest.param(
        """
        from torch.utils.data import DistributedSampler
        if distributed:
            sampler = DistributedSampler(ds)
        for epoch in range(3):
            pass
        """,
        id="sampler-bound-under-if",
    ),
    pytest.param(
        """
        from torch.utils.data import DistributedSampler
        sampler = DistributedSampler(ds)
        for epoch in range(3): pass
        """,
        id="one-line-loop-body",
    ),
]


@pytest.mark.parametrize("before", NO_DDP022_FIX)
def test_set_epoch_not_fixed_when_ambiguous(before):
    before = src(before)
    found = lint(before, ["DDP022"])
    assert [d.code for d in found] == ["DDP022"]
    assert found[0].fix is None
    assert fix(before, ["DDP022"], unsafe=True) == before


# -- DDP021: shuffle with sampler ---------------------------------------------------------

HEAD21 = "from torch.utils.data import DataLoader, DistributedSampler, RandomSampler\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            "s = DistributedSampler(ds)\n"
            "l = DataLoader(ds, batch_size=4, shuffle=True, sampler=s)\n",
            "s = DistributedSampler(ds)\nl = DataLoader(ds, batch_size=4, sampler=s)\n",
            id="middle",
        ),
        pytest.param(
            "l = DataLoader(ds, sampler=DistributedSampler(ds), shuffle=True)\n",
            "l = DataLoader(ds, sampler=DistributedSampler(ds))\n",
            id="last",
        ),
        pytest.param(
            "def f():\n"
            "    return DataLoader(\n"
            "        ds,\n"
            "        shuffle=True,\n"
            "        sampler=DistributedSampler(ds),  # shard\n"
            "    )\n",
            "def f():\n"
            "    return DataLoader(\n"
            "        ds,\n"
            "        sampler=DistributedSampler(ds),  # shard\n"
            "    )\n",
            id="multi-line-in-function",
        ),
    ],
)
def test_drop_shuffle_is_safe_for_shuffling_distributed_sampler(body, expected):
    check_fixed(HEAD21 + body, HEAD21 + expected, "DDP021")


def test_drop_shuffle_is_unsafe_for_other_samplers():
    body = "l = DataLoader(ds, shuffle=True, sampler=RandomSampler(ds))\n"
    assert fix(HEAD21 + body, ["DDP021"]) == HEAD21 + body
    check_fixed(HEAD21 + body, HEAD21 + body.replace("shuffle=True, ", ""), "DDP021", True)


def test_drop_shuffle_is_unsafe_when_it_drops_a_comment():
    body = (
        "l = DataLoader(\n    ds,\n    shuffle=True,  # why\n"
        "    sampler=DistributedSampler(ds),\n)\n"
    )
    assert fix(HEAD21 + body, ["DDP021"]) == HEAD21 + body
    fixed = fix(HEAD21 + body, ["DDP021"], unsafe=True)
    assert "shuffle" not in fixed


def test_no_fix_when_sampler_does_not_shuffle():
    body = (
        "s = DistributedSampler(ds, shuffle=False)\nl = DataLoader(ds, shuffle=True, sampler=s)\n"
    )
    (finding,) = lint(HEAD21 + body, ["DDP021"])
    assert finding.fix is None
    assert "shuffle=True` if the data should be shuffled" in finding.message


# -- DDP020: add a DistributedSampler ---------------------------------------------------

HEAD20 = "import torch.distributed as dist\n{imports}\ndist.init_process_group('gloo')\n"


@pytest.mark.parametrize(
    ("imports", "body", "expected"),
    [
        pytest.param(
            "from torch.utils.data import DataLoader, DistributedSampler",
            "loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n",
            "loader = DataLoader(train_ds, batch_size=8, "
            "sampler=DistributedSampler(train_ds, shuffle=True))\n",
            id="shuffle-moved-into-sampler",
        ),
        pytest.param(
            "import torch\nfrom torch.utils.data import DataLoader",
            "loader = DataLoader(train_ds)\n",
            "loader = DataLoader(train_ds, "
            "sampler=torch.utils.data.DistributedSampler(train_ds, shuffle=False))\n",
            id="no-shuffle-spelled-through-torch",
        ),
        pytest.param(
            "from torch.utils import data",
            "def main():\n"
            "    loader = data.DataLoader(\n"
            "        train_ds,\n"
            "        batch_size=8,\n"
            "    )\n",
            "def main():\n"
            "    loader = data.DataLoader(\n"
            "        train_ds,\n"
            "        sampler=data.DistributedSampler(train_ds, shuffle=False),\n"
            "        batch_size=8,\n"
            "    )\n",
            id="multi-line-in-function",
        ),
    ],
)
def test_add_sampler_is_unsafe(imports, body, expected):
    head = HEAD20.format(imports=imports)
    assert fix(head + body, ["DDP020"]) == head + body  # not without --unsafe-fixes
    check_fixed(head + body, head + expected, "DDP020", unsafe=True)


@pytest.mark.parametrize(
    ("imports", "body"),
    [
        pytest.param(
            "from torch.utils.data import DataLoader",
            "loader = DataLoader(train_ds, batch_size=8)\n",
            id="no-spelling-for-the-sampler",
        ),
        pytest.param(
            "from torch.utils.data import DataLoader, DistributedSampler",
            "loader = DataLoader(make_dataset(), batch_size=8)\n",
            id="dataset-not-a-name",
        ),
        pytest.param(
            "from torch.utils.data import DataLoader, DistributedSampler",
            "loader = DataLoader(train_ds, 8, True)\n",
            id="positional-shuffle",
        ),
    ],
)
def test_add_sampler_not_offered(imports, body):
    head = HEAD20.format(imports=imports)
    (finding,) = lint(head + body, ["DDP020"])
    assert finding.fix is None


# -- DDP023: one seed for every rank ----------------------------------------------------------

SEEDED = (
    "import os\nimport time\n"
    "import torch.distributed as dist\n"
    "from torch.utils.data import DistributedSampler\n"
    "rank = int(os.environ['RANK'])\n"
)


@pytest.mark.parametrize(
    "before, after",
    [
        pytest.param(
            "s = DistributedSampler(ds, seed=args.seed + rank)  # data order\n",
            "s = DistributedSampler(ds, seed=args.seed)  # data order\n",
            id="keeps-the-shared-term",
        ),
        pytest.param(
            "s = DistributedSampler(ds, 2, rank, True, dist.get_rank() + 42)\n",
            "s = DistributedSampler(ds, 2, rank, True, 42)\n",
            id="positional",
        ),
        pytest.param(
            "s = DistributedSampler(ds, seed=int(time.time()))\n",
            "s = DistributedSampler(ds, seed=0)\n",
            id="clock-becomes-default",
        ),
    ],
)
def test_ddp023_gives_every_rank_the_same_seed(before, after):
    check_fixed(SEEDED + before, SEEDED + after, "DDP023")


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("seed = args.seed + rank\ns = DistributedSampler(ds, seed=seed)\n", id="name"),
        pytest.param("s = DistributedSampler(ds, seed=rank + args.rank)\n", id="no-shared-term"),
    ],
)
def test_ddp023_no_fix_where_a_person_must_choose(line):
    source = SEEDED + line
    (finding,) = lint(source, ["DDP023"])
    assert finding.fix is None
    assert fix(source, ["DDP023"], unsafe=True) == source
