"""ddpify.analysis.values: per-process values, division by the world size, CPU fallbacks."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.names import ImportMap
from ddpify.analysis.values import (
    divides_by_world_size,
    falls_back_to_cpu,
    is_per_node_count,
    per_process_source,
)


def imports_of(*lines: str) -> ImportMap:
    imports = ImportMap()
    for line in lines:
        imports.add(cst.parse_statement(line).body[0])
    return imports


IMPORTS = imports_of("import os", "import time", "import torch", "import torch.distributed as dist")


@pytest.mark.parametrize(
    "expr, bindings, expected",
    [
        ("args.seed + rank", {}, "the rank"),
        ("42 + dist.get_rank()", {}, "the rank"),
        ('int(os.environ["LOCAL_RANK"])', {}, "the rank"),
        ("self.local_rank * 7", {}, "the rank"),
        ("int(time.time())", {}, "the clock"),
        ("os.getpid()", {}, "the process id"),
        ("seed", {"seed": ["cfg.seed + offset"], "offset": ["args.rank * 100"]}, "the rank"),
        ("args.seed", {}, None),
        ("1234", {}, None),
        ("seed", {"seed": ["args.seed"]}, None),
        ("dist.get_world_size()", {}, None),
    ],
)
def test_per_process_source(expr, bindings, expected):
    parsed = {k: [cst.parse_expression(v) for v in vs] for k, vs in bindings.items()}
    assert per_process_source(cst.parse_expression(expr), IMPORTS, parsed) == expected


@pytest.mark.parametrize(
    "expr, bindings, expected",
    [
        ("torch.cuda.device_count()", {}, True),
        ("ngpus_per_node", {}, True),
        ("args.gpus_per_node", {}, True),
        ('int(os.environ["LOCAL_WORLD_SIZE"])', {}, True),
        ('int(os.environ.get("LOCAL_WORLD_SIZE", 1))', {}, True),
        ("n", {"n": ["torch.cuda.device_count()"]}, True),
        ("n", {"n": ["m"], "m": ["torch.cuda.device_count()"]}, True),
        # The ImageNet example's world size counts the nodes too: a product is no alias.
        ("args.world_size", {"args.world_size": ["ngpus_per_node * args.world_size"]}, False),
        ("n", {"n": ["torch.cuda.device_count()", "dist.get_world_size()"]}, False),
        ("dist.get_world_size()", {}, False),
        ('int(os.environ["WORLD_SIZE"])', {}, False),
        ("ngpus", {}, False),
        ("num_nodes", {}, False),
    ],
)
def test_is_per_node_count(expr, bindings, expected):
    parsed = {k: [cst.parse_expression(v) for v in vs] for k, vs in bindings.items()}
    assert is_per_node_count(cst.parse_expression(expr), IMPORTS, parsed) is expected


@pytest.mark.parametrize(
    "code, expected",
    [
        ("args.batch_size // world_size", True),
        ("int(args.workers / ngpus_per_node)", False),  # the call, not the division
        ("args.workers / ngpus_per_node", True),
        ("args.batch_size // dist.get_world_size()", True),
        ("args.batch_size * world_size", False),
        ("len(ds) // batch_size", False),
    ],
)
def test_divides_by_world_size(code, expected):
    assert divides_by_world_size(cst.parse_expression(code)) is expected


def test_divides_by_world_size_in_place():
    statement = cst.parse_statement("args.batch_size //= args.world_size").body[0]
    assert divides_by_world_size(statement)


@pytest.mark.parametrize(
    "code, expected",
    [
        ('"cuda" if torch.cuda.is_available() else "cpu"', True),
        ('torch.device("cuda" if use_cuda else "cpu")', False),  # the call, not the choice
        ('"cpu" if args.no_cuda else "cuda"', True),
        ('torch.device("cuda") if args.gpu else torch.device("cpu")', True),
        ('"cuda" if rank == 0 else "cpu"', False),  # not a CUDA test
        ('"cuda:0" if torch.cuda.is_available() else "mps"', False),
    ],
)
def test_falls_back_to_cpu_expressions(code, expected):
    assert falls_back_to_cpu(cst.parse_expression(code), IMPORTS) is expected


def test_falls_back_to_cpu_statements():
    fallback = cst.parse_statement(
        'if torch.cuda.is_available():\n    device = "cuda"\nelse:\n    device = "cpu"\n'
    )
    required = cst.parse_statement(
        'if not torch.cuda.is_available():\n    raise SystemExit("needs a GPU")\n'
    )
    assert falls_back_to_cpu(fallback, IMPORTS)
    assert not falls_back_to_cpu(required, IMPORTS)
