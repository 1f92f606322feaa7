"""The shared device/wrapping analysis: which scripts are distributed, where a rank comes from."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.diagnostics import Severity
from ddpify.engine import run_rules
from ddpify.rules.devices._common import DistributedRule, Rank, RankResolver
from tests.helpers import lint


class _Probe(DistributedRule):
    """Reports `is_distributed()` once, and what `probe(x)` resolves `x` to."""

    CODE = "DDP999"
    NAME = "probe"
    SEVERITY = Severity.INFO
    MESSAGE = "probe"

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "probe":
            resolver = RankResolver(self.model, self.context.module)
            found = resolver.resolve(node.args[0].value, self.enclosing_function())
            self.report(node, "unclear" if found is None else found[0].value)

    def leave_Module(self, node: cst.Module) -> None:
        self.report(node, f"distributed={self.is_distributed()}")


def _probe(source: str) -> list[str]:
    module = cst.parse_module(textwrap.dedent(source))
    return [report.message for report in run_rules(module, [_Probe])]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.init_process_group('nccl')\n",
        "import os\nlocal_rank = int(os.environ['LOCAL_RANK'])\n",
        "from torch.utils.data import DistributedSampler as DS\nsampler = DS(range(4))\n",
        "from torch.nn.parallel import DistributedDataParallel\nDistributedDataParallel(m)\n",
        "import torch.multiprocessing as mp\nmp.spawn(worker, nprocs=2)\n",
    ],
)
def test_distributed_scripts_are_recognised(source):
    assert _probe(source) == ["distributed=True"]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n",
        # Accelerate owns the process group: not plain DDP code.
        "import accelerate\nimport torch.distributed as dist\ndist.barrier()\n",
        # Importing torch.distributed is not using it.
        "import torch.distributed as dist\nimport torch\n",
    ],
)
def test_other_scripts_are_not_distributed(source):
    assert _probe(source) == ["distributed=False"]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os\nprobe(int(os.environ['RANK']))", Rank.GLOBAL.value),
        ("import os\nprobe(os.environ.get('LOCAL_RANK', 0))", Rank.LOCAL.value),
        ("import os\nprobe(os.getenv('SLURM_PROCID'))", Rank.GLOBAL.value),
        ("import torch.distributed as dist\nprobe(dist.get_rank())", Rank.GLOBAL.value),
        ("import torch.distributed as dist\nr = dist.get_rank()\nx = r\nprobe(x)", "global"),
        ("import torch\nprobe(rank % torch.cuda.device_count())", Rank.LOCAL.value),
        ("probe(args.node_rank * args.gpus + gpu)", Rank.GLOBAL.value),
        ("probe(args.rank)", Rank.GLOBAL.value),
        ("probe(args.local_rank)", Rank.LOCAL.value),
        ("probe(gpu)", Rank.LOCAL.value),
        ("probe(self.rank)", "unclear"),
        ("probe(rank)", "unclear"),
        ("import os\nrank = int(os.environ['RANK'])\nrank = 0\nprobe(rank)", "unclear"),
        # The single-process branch's `rank = 0` says nothing about the distributed one.
        (
            "import torch.distributed as dist\nif distributed:\n    rank = dist.get_rank()\n"
            "else:\n    rank = 0\nprobe(rank)",
            Rank.GLOBAL.value,
        ),
        (
            "import os\nif args.local_rank == -1:\n    rank = 0\n"
            "else:\n    rank = int(os.environ['RANK'])\nprobe(rank)",
            Rank.GLOBAL.value,
        ),
        (
            "import torch.distributed as dist\ntry:\n    rank = dist.get_rank()\n"
            "except Exception:\n    rank = 0\nprobe(rank)",
            Rank.GLOBAL.value,
        ),
    ],
)
def test_rank_origin(source, expected):
    assert _probe(source)[0] == expected


def test_a_parameter_hides_assignments_elsewhere():
    source = """
    import torch.distributed as dist

    rank = dist.get_rank()

    def worker(rank, world_size):
        probe(rank)

    def helper():
        probe(rank)
    """
    assert _probe(source)[:2] == ["unclear", "global"]


def test_assignments_in_the_same_function_win_over_module_level():
    source = """
    import os

    rank = int(os.environ["RANK"])

    def main():
        rank = int(os.environ["LOCAL_RANK"])
        probe(rank)
    """
    assert _probe(source)[0] == "local"


SCRIPT_HEAD = "import os\nimport torch\nimport torch.distributed as dist\n"


def test_late_set_device_is_a_warning_and_device_id_an_info():
    late = SCRIPT_HEAD + "dist.init_process_group('nccl')\ntorch.cuda.set_device(int(r))\n"
    bound = SCRIPT_HEAD + "dist.init_process_group('nccl', device_id=d)\nx = torch.ones(1).cuda()\n"
    assert [d.severity for d in lint(late, ["DDP010"])] == [Severity.WARNING]
    assert [d.severity for d in lint(bound, ["DDP010"])] == [Severity.INFO]


def test_missing_set_device_is_an_error_at_each_bare_device():
    source = SCRIPT_HEAD + "dist.init_process_group('nccl')\na = torch.ones(1).cuda()\n"
    source += "b = torch.zeros(1, device='cuda')\n"
    found = lint(source, ["DDP010"])
    assert [(d.location.row, d.severity) for d in found] == [
        (5, Severity.ERROR),
        (6, Severity.ERROR),
    ]


def test_noqa_silences_one_bare_device():
    source = SCRIPT_HEAD + "dist.init_process_group('nccl')\n"
    source += "a = torch.ones(1).cuda()  # noqa: DDP010\nb = torch.ones(1).cuda()\n"
    assert [d.location.row for d in lint(source, ["DDP010"])] == [6]
