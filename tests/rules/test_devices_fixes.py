"""DDP012's fix: add `map_location="cpu"`, safe only where load_state_dict copies anyway."""

from __future__ import annotations

import pytest

from tests.helpers import codes, fix, fix_cleanly

HEAD = (
    "import os\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "dist.init_process_group('nccl')\n"
    "model = torch.nn.Linear(2, 2).cuda(int(os.environ['LOCAL_RANK']))\n"
)

SAFE_CASES = [
    pytest.param(
        "model.load_state_dict(torch.load('m.pt'))\n",
        "model.load_state_dict(torch.load('m.pt', map_location=\"cpu\"))\n",
        id="state-dict",
    ),
    pytest.param(
        "model.load_state_dict(torch.load('m.pt', weights_only=True), strict=False)\n",
        "model.load_state_dict(torch.load('m.pt', weights_only=True, map_location=\"cpu\"), "
        "strict=False)\n",
        id="keyword-kept",
    ),
    pytest.param(
        "model.load_state_dict(\n    torch.load(\n        'm.pt',  # the weights\n    )\n)\n",
        "model.load_state_dict(\n    torch.load(\n        'm.pt', map_location=\"cpu\",  "
        "# the weights\n    )\n)\n",
        id="trailing-comma-and-comment",
    ),
]


@pytest.mark.parametrize(("body", "expected"), SAFE_CASES)
def test_safe_fix(body, expected):
    assert fix_cleanly(HEAD + body, "DDP012") == HEAD + expected


def test_whole_object_load_needs_unsafe_fixes():
    body = "state = torch.load('ckpt.pt')\nmodel.load_state_dict(state['model'])\n"
    assert fix(HEAD + body, ["DDP012"]) == HEAD + body
    fixed = fix(HEAD + body, ["DDP012"], unsafe=True)
    assert fixed == HEAD + body.replace("'ckpt.pt')", "'ckpt.pt', map_location=\"cpu\")")
    assert "DDP012" not in codes(fixed, ["DDP012"])


@pytest.mark.parametrize(
    "body",
    [
        "model.load_state_dict(torch.load('m.pt', map_location='cpu'))\n",
        "state = torch.load('m.pt', {'cuda:0': 'cuda:1'})\n",
        "state = torch.load(**kwargs)\n",
    ],
)
def test_noop(body):
    assert fix(HEAD + body, ["DDP012"], unsafe=True) == HEAD + body
