"""DDP011 and DDP030 decisions that the fixture lines do not show: order and severity."""

from __future__ import annotations

from ddpify.diagnostics import Severity
from tests.helpers import lint

HEAD = (
    "import os\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch import nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "local_rank = int(os.environ['LOCAL_RANK'])\n"
    "dist.init_process_group('nccl')\n"
)


def _found(body: str, code: str) -> list[tuple[int, Severity]]:
    return [(d.location.row, d.severity) for d in lint(HEAD + body, [code])]


def test_a_move_after_the_wrap_does_not_count():
    body = "model = nn.Linear(2, 2)\nddp = DDP(model, device_ids=[local_rank])\nmodel.cuda()\n"
    assert _found(body, "DDP011") == [(9, Severity.ERROR)]


def test_a_move_before_the_wrap_counts_in_every_spelling():
    for move in ("model.cuda()", "model = model.to(local_rank)", "model.to(device=local_rank)"):
        body = f"model = nn.Linear(2, 2)\n{move}\nmodel = DDP(model, device_ids=[local_rank])\n"
        assert _found(body, "DDP011") == [], move


def test_rebinding_the_wrapped_name_judges_the_model_before_the_wrap():
    body = "model = nn.Linear(2, 2).cuda()\nmodel = DDP(model, device_ids=[local_rank])\n"
    assert _found(body, "DDP011") == []


def test_moves_in_another_function_are_not_judged():
    body = (
        "def build():\n    return nn.Linear(2, 2)\n"
        "def wrap(model):\n    return DDP(model, device_ids=[local_rank])\n"
    )
    assert _found(body, "DDP011") == []


def test_batchnorm_without_sync_is_info_and_after_the_wrap_an_error():
    unsynced = "model = nn.BatchNorm1d(2).cuda()\nmodel = DDP(model, device_ids=[local_rank])\n"
    late = unsynced + "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"
    assert _found(unsynced, "DDP030") == [(9, Severity.INFO)]
    assert _found(late, "DDP030") == [(10, Severity.ERROR)]


def test_conversion_in_an_earlier_function_is_not_after_the_wrap():
    body = (
        "def wrap(model):\n    return DDP(model, device_ids=[local_rank])\n"
        "def build():\n    model = nn.BatchNorm1d(2).cuda()\n"
        "    return nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"
    )
    assert _found(body, "DDP030") == []
