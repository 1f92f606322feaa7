"""DDP051's fixes: `.module` before `.state_dict()` (safe), `torch.save(ddp.module)` (unsafe)."""

from __future__ import annotations

import pytest

from tests.helpers import codes, fix, fix_cleanly, lint

HEAD = (
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "dist.init_process_group('nccl')\n"
)

SAFE_CASES = [
    pytest.param(
        "model = DDP(torch.nn.Linear(2, 2))\ntorch.save(model.state_dict(), 'm.pt')\n",
        "model = DDP(torch.nn.Linear(2, 2))\ntorch.save(model.module.state_dict(), 'm.pt')\n",
        id="plain",
    ),
    pytest.param(
        "model = DDP(torch.nn.Linear(2, 2))\n"
        "torch.save({'model': model.state_dict(),  # weights\n"
        "            'step': 3}, 'ckpt.pt')\n",
        "model = DDP(torch.nn.Linear(2, 2))\n"
        "torch.save({'model': model.module.state_dict(),  # weights\n"
        "            'step': 3}, 'ckpt.pt')\n",
        id="in-dict-comment-kept",
    ),
    pytest.param(
        "class T:\n"
        "    def __init__(self, net):\n"
        "        self.net = DDP(net)\n"
        "    def save(self):\n"
        "        ckpt = {}\n"
        "        ckpt['net'] = self.net.state_dict()\n"
        "        torch.save(ckpt, 'c.pt')\n"
        "T(torch.nn.Linear(2, 2)).save()\n",
        "class T:\n"
        "    def __init__(self, net):\n"
        "        self.net = DDP(net)\n"
        "    def save(self):\n"
        "        ckpt = {}\n"
        "        ckpt['net'] = self.net.module.state_dict()\n"
        "        torch.save(ckpt, 'c.pt')\n"
        "T(torch.nn.Linear(2, 2)).save()\n",
        id="self-attribute-via-dict-item",
    ),
]


@pytest.mark.parametrize(("body", "expected"), SAFE_CASES)
def test_safe_fix(body, expected):
    assert fix_cleanly(HEAD + body, "DDP051") == HEAD + expected


def test_whole_object_save_needs_unsafe_fixes():
    body = "model = DDP(torch.nn.Linear(2, 2))\ntorch.save(model, 'whole.pt')\n"
    assert fix(HEAD + body, ["DDP051"]) == HEAD + body
    fixed = fix(HEAD + body, ["DDP051"], unsafe=True)
    assert fixed == HEAD + body.replace("save(model,", "save(model.module,")
    assert "DDP051" not in codes(fixed, ["DDP051"])


def test_conditional_wrap_is_reported_without_a_fix():
    """`.module` would break the run where the `if` is not taken."""
    body = (
        "import sys\n"
        "model = torch.nn.Linear(2, 2)\n"
        "if len(sys.argv) > 1:\n"
        "    model = DDP(model)\n"
        "torch.save(model.state_dict(), 'm.pt')\n"
    )
    (diagnostic,) = lint(HEAD + body, ["DDP051"])
    assert diagnostic.fix is None
    assert fix(HEAD + body, ["DDP051"], unsafe=True) == HEAD + body


@pytest.mark.parametrize(
    "body",
    [
        "model = DDP(torch.nn.Linear(2, 2))\ntorch.save(model.module.state_dict(), 'm.pt')\n",
        "model = torch.nn.Linear(2, 2)\ntorch.save(model.state_dict(), 'm.pt')\n"
        "model = DDP(model)\n",
    ],
    ids=["already-unwrapped", "saved-before-the-wrap"],
)
def test_noop(body):
    assert fix(HEAD + body, ["DDP051"], unsafe=True) == HEAD + body
