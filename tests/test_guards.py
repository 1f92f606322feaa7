"""ddpify.analysis.guards: which spellings of a rank test count as a rank-0 guard.

`classify(test)` says what the body of `if test:` runs on; `rank_zero_scope(ancestors)`
says whether a node runs on rank 0 only.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.guards import (
    Guard,
    Scope,
    classify,
    rank_scope,
    rank_zero_scope,
    single_process_only,
)
from ddpify.walk import walk

ZERO_GLOBAL = (Guard.RANK_ZERO, Scope.GLOBAL)
ZERO_LOCAL = (Guard.RANK_ZERO, Scope.LOCAL)
OTHERS_GLOBAL = (Guard.NON_ZERO, Scope.GLOBAL)
OTHERS_LOCAL = (Guard.NON_ZERO, Scope.LOCAL)

CLASSIFY = [
    # comparisons with the global rank, in every order and operator
    ("rank == 0", ZERO_GLOBAL),
    ("0 == rank", ZERO_GLOBAL),
    ("rank is 0", ZERO_GLOBAL),
    ("rank <= 0", ZERO_GLOBAL),
    ("rank < 1", ZERO_GLOBAL),
    ("rank == 00", ZERO_GLOBAL),
    ("rank != 0", OTHERS_GLOBAL),
    ("0 != rank", OTHERS_GLOBAL),
    ("rank > 0", OTHERS_GLOBAL),
    ("rank >= 1", OTHERS_GLOBAL),
    ("not (rank != 0)", ZERO_GLOBAL),
    # where the rank comes from
    ("dist.get_rank() == 0", ZERO_GLOBAL),
    ("torch.distributed.get_rank() == 0", ZERO_GLOBAL),
    ("get_rank() == 0", ZERO_GLOBAL),
    ("get_rank() <= 0", ZERO_GLOBAL),
    ("hvd.rank() == 0", ZERO_GLOBAL),
    ("dist.get_rank() in [0]", ZERO_GLOBAL),
    ("self.rank == 0", ZERO_GLOBAL),
    ("self.global_rank == 0", ZERO_GLOBAL),
    ("args.rank == 0", ZERO_GLOBAL),
    ("ddp_rank == 0", ZERO_GLOBAL),
    ("RANK == 0", ZERO_GLOBAL),
    ("int(rank) == 0", ZERO_GLOBAL),
    ('str(rank) == "0"', ZERO_GLOBAL),
    ('int(os.environ["RANK"]) == 0', ZERO_GLOBAL),
    ('os.environ["RANK"] == "0"', ZERO_GLOBAL),
    ('int(os.getenv("RANK", "0")) == 0', ZERO_GLOBAL),
    # the ImageNet example's "first process" test (see DDP050's quiet list)
    ("args.rank % ngpus_per_node == 0", ZERO_GLOBAL),
    ("args.rank % ngpus == 0", ZERO_GLOBAL),
    # local ranks: one process per node
    ("local_rank == 0", ZERO_LOCAL),
    ("args.local_rank == 0", ZERO_LOCAL),
    ('int(os.environ.get("LOCAL_RANK", 0)) == 0', ZERO_LOCAL),
    ("local_rank in (-1, 0)", ZERO_LOCAL),
    ("args.local_rank in [-1, 0]", ZERO_LOCAL),
    ("local_rank not in [-1, 0]", OTHERS_LOCAL),
    ("args.gpu == 0", ZERO_LOCAL),
    ("gpu == 0", ZERO_LOCAL),
    ("device_id == 0", ZERO_LOCAL),
    ("comm.get_local_rank() == 0", ZERO_LOCAL),
    # truthiness of a rank: true everywhere but rank 0
    ("rank", OTHERS_GLOBAL),
    ("not rank", ZERO_GLOBAL),
    ("local_rank", OTHERS_LOCAL),
    # predicates
    ("is_main_process()", ZERO_GLOBAL),
    ("utils.is_main_process()", ZERO_GLOBAL),
    ("not is_main_process()", OTHERS_GLOBAL),
    ("is_primary()", ZERO_GLOBAL),
    ("self.is_main", ZERO_GLOBAL),
    ("self.is_master", ZERO_GLOBAL),
    ("master_process", ZERO_GLOBAL),
    ("not master_process", OTHERS_GLOBAL),
    ("rank_zero", ZERO_GLOBAL),
    ("accelerator.is_main_process", ZERO_GLOBAL),
    ("accelerator.is_local_main_process", ZERO_LOCAL),
    ("trainer.is_global_zero", ZERO_GLOBAL),
    ("self.trainer.is_global_zero", ZERO_GLOBAL),
    ("trainer.is_world_process_zero()", ZERO_GLOBAL),
    ("self.is_local_process_zero()", ZERO_LOCAL),
    ("not trainer.is_world_process_zero()", OTHERS_GLOBAL),
    # combinations
    ("not args.distributed or args.rank == 0", ZERO_GLOBAL),
    ("not dist.is_initialized() or dist.get_rank() == 0", ZERO_GLOBAL),
    ("args.distributed and args.rank == 0", ZERO_GLOBAL),
    ("rank == 0 and epoch % 10 == 0", ZERO_GLOBAL),
    ("epoch % 10 == 0 and rank == 0", ZERO_GLOBAL),
    ("args.world_size > 1 and args.rank == 0", ZERO_GLOBAL),
    ("is_main_process() and dist.get_rank() == 0", ZERO_GLOBAL),
    # every node's local rank 0 passes too: one process per node
    ("args.rank == 0 or args.local_rank == 0", ZERO_LOCAL),
    ("dist.is_initialized() and dist.get_rank() != 0", OTHERS_GLOBAL),
    # not about rank 0
    ("world_size == 1", None),
    ("rank == 1", None),
    ("args.rank == -1", None),
    ("args.local_rank == -1", None),
    ("args.local_rank != -1", None),
    ("is_dist_avail_and_initialized()", None),
    ("dist.is_initialized()", None),
    ("torch.cuda.current_device() == 0", None),
    ("epoch == 0", None),
    ("step % 100 == 0", None),
    ("rank == 0 == world", None),
    ("0 > rank", None),
    # a tautology: its `else` never runs, so "rank 0 only" holds vacuously there
    ("rank == 0 or rank != 0", OTHERS_GLOBAL),
    ("dist.get_rank() == 0 if dist.is_initialized() else True", None),
    ("xm.is_master_ordinal()", None),
]

CLASSIFY_EDGES = [
    # a zero on the left mirrors every operator
    ("0 < rank", OTHERS_GLOBAL),
    ("0 >= rank", ZERO_GLOBAL),
    # the first node holds one process per GPU: all of them pass
    ("node_rank == 0", None),
    ("args.node_rank == 0", None),
    # `and` with a non-zero test: its `else` (and what follows an early return in it)
    # still runs on the other ranks where the second condition is false
    ("rank != 0 and is_eval", None),
    ("not is_main_process() and args.save", None),
    # `or` with a non-zero test: its complement is rank 0 only
    ("rank != 0 or not args.save", OTHERS_GLOBAL),
    # "rank" as a substring of an unrelated word
    ("ranking == 0", None),
    # `-1` means "not distributed": a single process is rank 0 (transformers' examples)
    ("args.local_rank == -1 or dist.get_rank() == 0", ZERO_GLOBAL),
    ("args.local_rank != -1 and dist.get_rank() != 0", OTHERS_GLOBAL),
]


@pytest.mark.parametrize(
    ("test", "body", "orelse"),
    [
        ("RANK == -1", True, False),
        ("RANK == -1 and stopper(epoch, fitness)", True, False),
        ("args.local_rank != -1", False, True),
        ("not dist.is_initialized()", True, False),
        ("dist.is_initialized()", False, True),
        ("RANK in (-1, 0)", False, False),  # rank 0 of a distributed run passes too
        ("RANK == -1 or stop", False, False),
        ("rank == 0", False, False),
    ],
)
def test_single_process_only(test, body, orelse):
    expr = cst.parse_expression(test)
    assert single_process_only(expr) is body
    assert single_process_only(expr, orelse=True) is orelse


@pytest.mark.parametrize(("test", "expected"), CLASSIFY, ids=[c[0] for c in CLASSIFY])
def test_classify(test, expected):
    assert classify(cst.parse_expression(test)) == expected


@pytest.mark.parametrize(("test", "expected"), CLASSIFY_EDGES, ids=[c[0] for c in CLASSIFY_EDGES])
def test_classify_edges(test, expected):
    assert classify(cst.parse_expression(test)) == expected


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("rank", Scope.GLOBAL),
        ("args.global_rank", Scope.GLOBAL),
        ("dist.get_rank()", Scope.GLOBAL),
        ('os.environ["RANK"]', Scope.GLOBAL),
        ('os.environ.get("LOCAL_RANK")', Scope.LOCAL),
        ("self.local_rank", Scope.LOCAL),
        ("args.gpu", Scope.LOCAL),
        ("args.rank % ngpus", Scope.GLOBAL),
        ("world_size", None),
        ("args.epochs", None),
        ("len(loader)", None),
    ],
)
def test_rank_scope(expr, expected):
    assert rank_scope(cst.parse_expression(expr)) == expected


def scope_of_target(source: str) -> Scope | None:
    """`rank_zero_scope` at the call `target()` in `source`."""
    module = cst.parse_module(textwrap.dedent(source))
    ancestors: list[cst.CSTNode] = []
    found: list[Scope | None] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Name)
            and node.func.value == "target"
        ):
            found.append(rank_zero_scope(ancestors))

    walk(module, enter, lambda node: ancestors.pop())
    (scope,) = found
    return scope


STATEMENTS = [
    ("if rank == 0:\n    target()\n", Scope.GLOBAL),
    ("if rank == 0: target()\n", Scope.GLOBAL),
    ("if local_rank == 0:\n    target()\n", Scope.LOCAL),
    ("if rank != 0:\n    pass\nelse:\n    target()\n", Scope.GLOBAL),
    ("if rank == 0:\n    pass\nelse:\n    target()\n", None),
    ("if rank != 0:\n    pass\nelif ready:\n    target()\n", Scope.GLOBAL),
    ("if ready:\n    pass\nelif rank == 0:\n    target()\n", Scope.GLOBAL),
    ("if rank == 0:\n    pass\ntarget()\n", None),
    ("if rank == 0:\n    with lock:\n        for x in y:\n            target()\n", Scope.GLOBAL),
    ("if rank == 0:\n    try:\n        target()\n    finally:\n        pass\n", Scope.GLOBAL),
    ("if rank == 0:\n    def f():\n        target()\n", Scope.GLOBAL),
    ("if rank == 0:\n    x = [target() for _ in y]\n", Scope.GLOBAL),
    ("if dist.get_rank() == 0:\n    target()\n", Scope.GLOBAL),
    ("if target():\n    pass\n", None),  # the test itself runs everywhere
    # early exits
    ("def f():\n    if rank != 0:\n        return\n    target()\n", Scope.GLOBAL),
    ("def f():\n    if not is_main_process(): return\n    target()\n", Scope.GLOBAL),
    ("def f():\n    if rank != 0:\n        raise SystemExit\n    target()\n", Scope.GLOBAL),
    ("for x in y:\n    if rank != 0:\n        continue\n    target()\n", Scope.GLOBAL),
    ("for x in y:\n    if rank > 0:\n        break\n    target()\n", Scope.GLOBAL),
    ("def f():\n    target()\n    if rank != 0:\n        return\n", None),
    ("def f():\n    if rank != 0:\n        log()\n    target()\n", None),
    ("def f():\n    if rank == 0:\n        return\n    target()\n", None),
    ("def f():\n    if rank != 0:\n        return\n\ndef g():\n    target()\n", None),
    # decorators
    ("@rank_zero_only\ndef f():\n    target()\n", Scope.GLOBAL),
    ("@pl.utilities.rank_zero_only\ndef f():\n    target()\n", Scope.GLOBAL),
    ("@master_only\ndef f():\n    target()\n", Scope.GLOBAL),
    ("@accelerator.on_main_process\ndef f():\n    target()\n", Scope.GLOBAL),
    ("@torch.no_grad()\ndef f():\n    target()\n", None),
    # not guards
    ("if epoch == 0:\n    target()\n", None),
    ("if world_size > 1:\n    target()\n", None),
    ("target()\n", None),
]

STATEMENT_EDGES = [
    ("if rank != 0:\n    sys.exit(0)\ntarget()\n", Scope.GLOBAL),  # sys.exit() exits too
    # an exiting `else` of a rank-0 guard is an early exit for the other ranks
    (
        "def f():\n    if rank == 0:\n        pass\n    else:\n        return\n    target()\n",
        Scope.GLOBAL,
    ),
    # `and` keeps a non-zero part: other ranks pass when is_eval is false
    ("def f():\n    if rank != 0 and is_eval:\n        return\n    target()\n", None),
    # `or` with a non-zero part: only rank 0 gets past it
    ("def f():\n    if rank != 0 or not save:\n        return\n    target()\n", Scope.GLOBAL),
    # guards inside expressions
    ("w = target() if rank == 0 else None\n", Scope.GLOBAL),
    ("w = None if rank != 0 else target()\n", Scope.GLOBAL),
    ("ok = is_main and target()\n", Scope.GLOBAL),
    ("ok = rank != 0 or target()\n", Scope.GLOBAL),
    ("ok = rank == 0 or target()\n", None),
    # a global guard around a local one selects the global rank 0
    ("if rank == 0:\n    if local_rank == 0:\n        target()\n", Scope.GLOBAL),
    ("if local_rank == 0:\n    target()\n", Scope.LOCAL),
]


@pytest.mark.parametrize(("source", "expected"), STATEMENTS, ids=[s for s, _ in STATEMENTS])
def test_rank_zero_scope(source, expected):
    assert scope_of_target(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"), STATEMENT_EDGES, ids=[s for s, _ in STATEMENT_EDGES]
)
def test_rank_zero_scope_edges(source, expected):
    assert scope_of_target(source) == expected
