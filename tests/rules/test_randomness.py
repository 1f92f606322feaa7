"""DDP060: a rank-independent seed in a distributed script that draws random
augmentations; each finding next to the reasons it stays quiet."""

from __future__ import annotations

import pytest

from ddpify.diagnostics import Severity
from tests.helpers import lint

HEAD = (
    "import os\n"
    "import random\n"
    "import numpy as np\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torchvision import transforms as T\n"
    "dist.init_process_group('nccl')\n"
)
AUGMENT = "aug = T.RandomCrop(32)\n"


def findings(body: str) -> list[str]:
    return [d.message.split("`")[1] for d in lint(HEAD + body, ["DDP060"])]


@pytest.mark.parametrize(
    "seed",
    [
        "torch.manual_seed(0)",
        "np.random.seed(args.seed)",
        "random.seed(cfg.train.seed)",
        "torch.cuda.manual_seed_all(seed)",
    ],
)
def test_same_seed_everywhere_is_reported_once_as_info(seed):
    (d,) = lint(HEAD + f"{seed}\ntorch.manual_seed(1)\n" + AUGMENT, ["DDP060"])
    assert d.severity is Severity.INFO
    assert d.message.startswith(f"`{seed}` seeds every rank alike")


def test_transformers_set_seed_and_getitem_draws_count():
    body = (
        "from transformers import set_seed\n"
        "set_seed(42)\n"
        "class D(torch.utils.data.Dataset):\n"
        "    def __getitem__(self, i):\n"
        "        return np.random.rand() + i\n"
    )
    assert findings(body) == ["set_seed(42)"]


@pytest.mark.parametrize(
    "body",
    [
        "torch.manual_seed(0)\n",  # nothing random is drawn for the data
        "torch.manual_seed(0 + dist.get_rank())\n" + AUGMENT,
        "seed = args.seed + int(os.environ['RANK'])\ntorch.manual_seed(seed)\n" + AUGMENT,
        "torch.manual_seed(0)\nnp.random.seed(0 + local_rank)\n" + AUGMENT,
        "def seed_all(s):\n    torch.manual_seed(s)\nseed_all(args.seed + rank)\n" + AUGMENT,
        "torch.manual_seed(0)\n"
        "loader = DataLoader(ds, worker_init_fn=lambda w: np.random.seed(w + rank))\n" + AUGMENT,
        "def split(n):\n    np.random.seed(0)\n    return np.random.permutation(n)\n" + AUGMENT,
        "torch.manual_seed(0)\nimport accelerate\n" + AUGMENT,
    ],
)
def test_quiet(body):
    assert findings(body) == []


def test_single_process_script_is_quiet():
    text = "import torch\nfrom torchvision import transforms\ntorch.manual_seed(0)\n"
    assert lint(text + "aug = transforms.RandomCrop(32)\n", ["DDP060"]) == []
