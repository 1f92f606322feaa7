"""The script model's whole-file answers, as rules see them in `leave_Module`."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.engine import run_rules
from ddpify.rules.base import Rule


def _distributed(source: str) -> bool:
    answers = []

    class Probe(Rule):
        CODE, NAME = "DDP999", "probe"

        def leave_Module(self, node: cst.Module) -> None:
            answers.append(self.context.model.is_distributed)

    run_rules(cst.parse_module(source), [Probe])
    return answers[0]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.init_process_group('nccl')\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(net)\n",
        "from torch.utils.data.distributed import DistributedSampler as DS\ns = DS(data)\n",
        "import torch.multiprocessing as mp\nmp.spawn(main, nprocs=2)\n",
        "import os\nrank = int(os.environ['LOCAL_RANK'])\n",
        "import os\nworld = int(os.getenv('WORLD_SIZE', '1'))\n",
    ],
)
def test_distributed_scripts_are_recognised(source):
    assert _distributed(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n",
        "import torch.distributed as dist\n",  # imported, never used
        "import os\nname = os.environ['USER']\n",
    ],
)
def test_single_process_scripts_are_not(source):
    assert not _distributed(source)
