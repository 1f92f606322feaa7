"""The rank-0 rules' shared analysis (ddpify/rules/rank_zero/_common.py) and behaviours
the fixtures do not pin down: helper call sites, rebinding, severities, one finding a line."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.guards import Scope, rank_zero_scope
from ddpify.diagnostics import Severity
from ddpify.rules.rank_zero._common import mentions_rank, non_zero_guarded
from ddpify.walk import walk
from tests.helpers import lint

DIST_HEAD = "import torch\nimport torch.distributed as dist\ndist.init_process_group('nccl')\n"


def findings(source: str, code: str) -> list[tuple[int, Severity]]:
    """(line, severity) of each finding of `code`, lines counted after DIST_HEAD."""
    offset = DIST_HEAD.count("\n")
    text = DIST_HEAD + textwrap.dedent(source)
    return [(d.location.row - offset, d.severity) for d in lint(text, [code])]


def at_target(source: str, predicate) -> object:
    """`predicate(ancestors)` at the call `target()` in `source`."""
    module = cst.parse_module(textwrap.dedent(source))
    ancestors: list[cst.CSTNode] = []
    found = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if isinstance(node, cst.Call) and getattr(node.func, "value", None) == "target":
            found.append(predicate(tuple(ancestors)))

    walk(module, enter, lambda node: ancestors.pop())
    (result,) = found
    return result


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('f"ckpt_rank{rank}.pt"', True),
        ("os.path.join(out, f'shard_{dist.get_rank()}.pt')", True),
        ("f'{args.local_rank}.log'", True),
        ("f'gpu{gpu}.pt'", True),
        ("not is_main", True),
        ("not is_main_process()", True),
        ("args.rank != 0", True),
        ('"checkpoint_rank0.pt"', False),  # literal text: the same file on every rank
        ("f'{remaining} batches left'", False),  # 'main' inside a word
        ("os.path.join(out, 'model.pt')", False),
        ("args.verbose", False),
    ],
)
def test_mentions_rank(expr, expected):
    assert mentions_rank(cst.parse_expression(expr)) is expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("w = target() if rank == 0 else None\n", Scope.GLOBAL),
        ("w = None if rank != 0 else target()\n", Scope.GLOBAL),
        ("w = target() if rank != 0 else None\n", None),
        ("is_main and target()\n", Scope.GLOBAL),
        ("rank != 0 or target()\n", Scope.GLOBAL),
        ("rank == 0 or target()\n", None),
        ("w = target() if (rank != 0 and ready) else None\n", None),
        ("if dist.get_rank() == 0:\n    if local_rank == 0:\n        target()\n", Scope.GLOBAL),
        ("if local_rank == 0:\n    target()\n", Scope.LOCAL),
        # guards.py reads `rank != 0 and x` as a non-zero guard; the rules veto it
        ("def f():\n    if rank != 0 and is_eval:\n        return\n    target()\n", None),
        ("def f():\n    if rank != 0 and rank != 1:\n        return\n    target()\n", None),
        ("def f():\n    if rank != 0:\n        return\n    target()\n", Scope.GLOBAL),
    ],
)
def test_rank_zero_scope_in_statements_and_expressions(source, expected):
    assert at_target(source, rank_zero_scope) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("if rank != 0:\n    target()\n", True),
        ("if local_rank not in [-1, 0]:\n    target()\n", True),
        ("if rank == 0:\n    pass\nelse:\n    target()\n", True),
        ("if rank == 0:\n    target()\n", False),
        ("target()\n", False),
    ],
)
def test_non_zero_guarded(source, expected):
    assert at_target(source, non_zero_guarded) is expected


@pytest.mark.parametrize(
    "signal",
    [
        "local_rank = int(os.environ['LOCAL_RANK'])\n",
        "parser.add_argument('--local_rank', type=int)\n",
        "world = dist.get_world_size()\n",
        "sampler = DistributedSampler(dataset)\n",
        "model = DDP(model)\n",
        "mp.spawn(worker, nprocs=2)\n",
    ],
)
def test_distributed_script_signals(signal):
    head = (
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "import torch.multiprocessing as mp\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DistributedSampler\n"
    )
    source = head + signal + "torch.save(model, 'm.pt')\n"
    assert [d.code for d in lint(source, ["DDP050"])] == ["DDP050"]


def test_single_process_script_is_not_distributed():
    source = "import os\nimport torch\nimport torch.distributed as dist\n"
    source += "torch.save(model, os.environ['OUT'])\nprint('saved')\n"
    assert lint(source, ["DDP050", "DDP052"]) == []


def test_helper_inherits_the_weakest_guard_of_its_call_sites():
    source = """
    def save(path):
        torch.save({}, path)

    if dist.get_rank() == 0:
        save("a.pt")
    save("b.pt")
    """
    assert findings(source, "DDP050") == [(3, Severity.WARNING)]


def test_helper_chain_and_recursion():
    source = """
    def write(path, depth):
        torch.save({}, path)
        if depth:
            write(path, depth - 1)

    def save_all():
        write("a.pt", 2)

    if dist.get_rank() == 0:
        save_all()
    """
    assert findings(source, "DDP050") == []


def test_local_call_site_makes_a_helper_local():
    source = """
    def save(path):
        torch.save({}, path)

    if dist.get_rank() == 0:
        save("a.pt")
    if local_rank == 0:
        save("b.pt")
    """
    assert findings(source, "DDP050") == [(3, Severity.INFO)]


def test_methods_resolve_through_self_and_constructors_through_the_class():
    source = """
    class Trainer:
        def __init__(self):
            torch.save({}, "init.pt")

        def checkpoint(self):
            torch.save({}, "ckpt.pt")

        def fit(self):
            if dist.get_rank() == 0:
                self.checkpoint()

    Trainer().fit()
    """
    assert findings(source, "DDP050") == [(4, Severity.WARNING)]


def test_spawn_target_runs_on_every_rank_even_from_the_launcher():
    source = """
    import torch.multiprocessing as mp

    def worker(rank):
        torch.save({}, "w.pt")

    if __name__ == "__main__":
        torch.save({}, "launcher.pt")
        mp.spawn(worker, nprocs=2)
    """
    assert findings(source, "DDP050") == [(5, Severity.WARNING)]


def test_main_block_runs_on_every_rank_under_torchrun():
    source = """
    if __name__ == "__main__":
        torch.save({}, "m.pt")
    """
    assert findings(source, "DDP050") == [(3, Severity.WARNING)]


def test_function_reads_the_global_wrapper_as_bound_at_the_end():
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    def save():
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), "m.pt")

    model = torch.nn.Linear(2, 2)
    model = DDP(model)
    save()
    """
    assert findings(source, "DDP051") == [(6, Severity.WARNING)]


def test_parameter_shadows_the_global_wrapper():
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(2, 2))

    def save(model):
        torch.save(model.state_dict(), "m.pt")
        torch.save(model, "whole.pt")
    """
    assert findings(source, "DDP051") == []


def test_rebinding_to_the_module_ends_the_wrapper():
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(2, 2))
    model = model.module
    torch.save(model.state_dict(), "m.pt")
    """
    assert findings(source, "DDP051") == []


def test_whole_object_save_is_an_error():
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(2, 2))
    torch.save(ddp, "m.pt")
    """
    assert findings(source, "DDP051") == [(5, Severity.ERROR)]


def test_state_dict_in_a_dict_saved_twice_is_reported_once():
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(2, 2))
    state = {"model": ddp.state_dict()}
    torch.save(state, "a.pt")
    torch.save(state, "b.pt")
    """
    assert findings(source, "DDP051") == [(5, Severity.WARNING)]


def test_logging_severities_and_one_finding_per_line():
    source = """
    import wandb
    from tqdm import tqdm
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter()
    print("a"); print("b")
    for x in tqdm(range(3)): print(x)
    wandb.log({"x": 1})
    """
    assert findings(source, "DDP052") == [
        (6, Severity.WARNING),
        (7, Severity.INFO),
        (8, Severity.INFO),
        (9, Severity.WARNING),
    ]


def test_compound_header_and_body_are_separate_statements():
    """`for x in tqdm(...)` and a print in its body are two lines, two findings."""
    source = """
    from tqdm import tqdm

    for x in tqdm(range(3)):
        print(x)
    """
    assert [line for line, _ in findings(source, "DDP052")] == [4, 5]


def test_print_silenced_by_an_imported_setup_helper():
    source = """
    import utils

    utils.init_distributed_mode(args)
    print("only the main process prints")
    """
    assert findings(source, "DDP052") == []


def test_stdout_redirected_off_rank_zero():
    source = """
    import os
    import sys

    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")
    print("quiet elsewhere")
    """
    assert findings(source, "DDP052") == []


def test_logger_level_raised_under_a_guard():
    source = """
    import logging

    logger = logging.getLogger(__name__)
    if dist.get_rank() != 0:
        logger.setLevel(logging.WARNING)
    logger.info("rank 0 only")
    print("still every rank")
    """
    assert findings(source, "DDP052") == [(8, Severity.INFO)]


def test_guarded_collective_in_an_early_return_with_and_is_not_rank_zero():
    source = """
    def evaluate(is_eval):
        if dist.get_rank() != 0 and is_eval:
            return
        dist.barrier()

    evaluate(True)
    """
    assert findings(source, "DDP053") == []


def test_collective_in_a_helper_called_from_both_sides_is_fine():
    source = """
    def sync():
        dist.barrier()

    if dist.get_rank() == 0:
        sync()
    else:
        sync()
    """
    assert findings(source, "DDP053") == []


def test_guarded_collective_is_an_error():
    source = """
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    """
    assert findings(source, "DDP053") == [(3, Severity.ERROR)]


def test_rank_zero_forward_of_the_wrapper_is_a_warning():
    """It hangs only when the model has buffers to broadcast, which the linter cannot see."""
    source = """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.BatchNorm1d(2))
    if dist.get_rank() == 0:
        model(torch.ones(2, 2))
        model.module(torch.ones(2, 2))
    """
    assert findings(source, "DDP053") == [(6, Severity.WARNING)]


# -- DDP054 -------------------------------------------------------------------------------

SHARDED_EVAL = """\
from torch.utils.data import DataLoader, DistributedSampler
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False))
correct = torch.zeros(2)
with torch.no_grad():
    for x, y in loader:
        correct[0] += (model(x).argmax(1) == y).sum()
        correct[1] += len(y)
accuracy = correct[0] / correct[1]
if dist.get_rank() == 0:
    print("accuracy", accuracy)
"""


def test_sharded_evaluation_metric_is_a_warning_where_it_is_logged():
    assert findings(SHARDED_EVAL, "DDP054") == [(10, Severity.WARNING)]


@pytest.mark.parametrize(
    "reduction",
    [
        "dist.all_reduce(correct)\n",
        "correct = reduce_tensor(correct)\n",
        "torch.distributed.all_reduce(correct, op=torch.distributed.ReduceOp.SUM)\n",
    ],
)
def test_any_reduction_of_the_sums_silences_it(reduction):
    source = SHARDED_EVAL.replace("accuracy = ", reduction + "accuracy = ")
    assert findings(source, "DDP054") == []


def test_unsharded_loader_and_per_rank_lines_are_quiet():
    unsharded = SHARDED_EVAL.replace(
        "sampler=DistributedSampler(ds, shuffle=False)", "shuffle=False"
    )
    assert findings(unsharded, "DDP054") == []
    per_rank = SHARDED_EVAL.replace('print("accuracy", accuracy)', "print(rank, accuracy)")
    assert findings(per_rank, "DDP054") == []


def test_training_loss_of_one_shard_is_info():
    source = SHARDED_EVAL.replace("with torch.no_grad():\n", "if True:\n")
    assert findings(source, "DDP054") == [(10, Severity.INFO)]
