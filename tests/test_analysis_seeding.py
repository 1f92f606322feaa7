"""ddpify.analysis.seeding: which helper functions seed the global streams, and with which
parameter; which calls draw from those streams."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.names import ImportMap
from ddpify.analysis.seeding import (
    ALIKE,
    CONDITIONAL,
    UNSEEDED,
    draws_from_global_stream,
    seed_parameter,
    torch_seeding,
)
from ddpify.analysis.tree import Tree

IMPORTS = ImportMap()
for _line in ("import random", "import numpy as np", "import torch"):
    IMPORTS.add(cst.parse_statement(_line).body[0])


def _function(code: str) -> cst.FunctionDef:
    function = cst.parse_module(code).body[0]
    assert isinstance(function, cst.FunctionDef)
    return function


@pytest.mark.parametrize(
    "code, expected",
    [
        ("def set_seed(seed):\n    random.seed(seed)\n    torch.manual_seed(seed)\n", (0, "seed")),
        ("def init(cfg, s=0):\n    np.random.seed(s)\n", (1, "s")),
        ("def f(seed, deterministic=False):\n    torch.cuda.manual_seed_all(seed)\n", (0, "seed")),
        # Seeds with something else than a parameter, or decides the rank's seed itself.
        ("def f(args):\n    random.seed(args.seed)\n", None),
        ("def f(seed):\n    torch.manual_seed(seed + rank())\n", None),
        ("def f(seed):\n    seed += rank()\n    torch.manual_seed(seed)\n", None),
        ("def f(seed):\n    return seed\n", None),
    ],
)
def test_seed_parameter(code, expected):
    assert seed_parameter(_function(code), IMPORTS) == expected


@pytest.mark.parametrize(
    "code, expected",
    [
        ("random.random()", True),
        ("np.random.randint(0, 4)", True),
        ("torch.randperm(8)", True),
        ("torch.randperm(8, generator=g)", False),
        ("np.random.RandomState(0)", False),
        ("np.random.default_rng(0)", False),
        ("random.seed(0)", False),
    ],
)
def test_draws_from_global_stream(code, expected):
    call = cst.parse_expression(code)
    assert isinstance(call, cst.Call)
    assert draws_from_global_stream(call, IMPORTS) is expected


@pytest.mark.parametrize(
    "code, kind, condition",
    [
        ("import torch\ntorch.manual_seed(0)\n", ALIKE, None),
        ("import torch\nif __name__ == '__main__':\n    torch.manual_seed(0)\n", ALIKE, None),
        ("import torch\ndef main(a):\n    torch.random.manual_seed(a.seed)\n", ALIKE, None),
        (
            "import torch\ndef main(a):\n    if a.seed is not None:\n"
            "        torch.manual_seed(a.seed)\n",
            CONDITIONAL,
            "a.seed is not None",
        ),
        # a seeding helper called only under a condition
        (
            "import torch\ndef set_seed(s):\n    torch.manual_seed(s)\n"
            "def main(a):\n    if a.seed:\n        set_seed(a.seed)\n",
            CONDITIONAL,
            "a.seed",
        ),
        (
            "import torch\ndef set_seed(s):\n    torch.manual_seed(s)\n"
            "def main(a):\n    set_seed(a.seed)\n",
            ALIKE,
            None,
        ),
        # one conditional seed and one on every path: every rank is seeded alike
        (
            "import torch\nif cfg:\n    torch.manual_seed(1)\ntorch.manual_seed(0)\n",
            ALIKE,
            None,
        ),
        ("import torch\nimport random\nrandom.seed(0)\n", UNSEEDED, None),
    ],
)
def test_torch_seeding(code, kind, condition):
    seeding = torch_seeding(Tree(cst.parse_module(code)))
    assert (seeding.kind, seeding.condition) == (kind, condition)
