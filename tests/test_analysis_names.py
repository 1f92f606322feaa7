"""Import-alias resolution: the names rules see, whatever the import spelling."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.names import ImportMap


def qualify(source: str, expr: str):
    imports = ImportMap()
    for stmt in cst.parse_module(source).body:
        for small in getattr(stmt, "body", ()):
            if isinstance(small, (cst.Import, cst.ImportFrom)):
                imports.add(small)
    return imports.qualify(cst.parse_expression(expr))


@pytest.mark.parametrize(
    ("source", "expr", "expected"),
    [
        ("import torch", "torch.nn.DataParallel", "torch.nn.parallel.DataParallel"),
        ("import torch.nn as nn", "nn.DataParallel", "torch.nn.parallel.DataParallel"),
        (
            "from torch import nn",
            "nn.parallel.DistributedDataParallel",
            "torch.nn.parallel.DistributedDataParallel",
        ),
        (
            "import torch.distributed as dist",
            "dist.init_process_group",
            "torch.distributed.init_process_group",
        ),
        (
            "from torch.nn.parallel import DistributedDataParallel as DDP",
            "DDP",
            "torch.nn.parallel.DistributedDataParallel",
        ),
        (
            "from torch.utils.data import DistributedSampler as DS",
            "DS",
            "torch.utils.data.DistributedSampler",
        ),
        (
            "from torch.utils.data.distributed import DistributedSampler",
            "DistributedSampler",
            "torch.utils.data.DistributedSampler",
        ),
        ("import torch.distributed", "torch.distributed.barrier", "torch.distributed.barrier"),
        ("from torch.cuda import amp", "amp.GradScaler", "torch.cuda.amp.GradScaler"),
    ],
)
def test_spellings_resolve_to_one_canonical_name(source, expr, expected):
    assert qualify(source, expr) == expected


@pytest.mark.parametrize(
    ("source", "expr"),
    [
        ("", "DDP"),  # never imported: unknown, not guessed
        ("from .parallel import DataParallel", "DataParallel"),  # a project's own module
        ("from torch.nn.parallel import *", "DataParallel"),
        ("import torch", "model.module"),
    ],
)
def test_unresolvable_names_stay_unknown(source, expr):
    assert qualify(source, expr) is None


def test_a_star_import_may_re_export_only_names_of_one_meaning():
    source = "from utils import *"
    assert qualify(source, "nn.DataParallel") == "torch.nn.parallel.DataParallel"
    assert qualify(source, "torch.load") == "torch.load"
    # PyTorch-GAN's cyclegan writes its progress with the `sys` its utils module imports
    assert qualify(source, "sys.stdout.write") == "sys.stdout.write"
    assert qualify(source, "os.makedirs") == "os.makedirs"
    assert qualify(source, "dist.barrier") is None  # `dist` may be anything
    assert qualify("import os", "nn.DataParallel") is None
    assert qualify("import torch", "sys.stdout.write") is None  # no star import: unbound


def test_torch_used_without_its_import_in_a_torch_script_is_torch():
    # pytorch/examples' minGPT main.py called `torch.cuda.set_device` with no `import torch`
    source = "from torch.distributed import init_process_group"
    assert qualify(source, "torch.cuda.set_device") == "torch.cuda.set_device"
    assert qualify("import os", "torch.cuda.set_device") is None  # not a torch script
    assert qualify("import torch as th", "th.load") == "torch.load"


def test_the_private_device_mesh_path_is_the_public_one():
    source = "from torch.distributed._tensor.device_mesh import init_device_mesh"
    expected = "torch.distributed.device_mesh.init_device_mesh"
    assert qualify(source, "init_device_mesh") == expected


def qualify_local(source: str, expr: str):
    imports = ImportMap()
    for stmt in cst.parse_module(source).body:
        for small in getattr(stmt, "body", ()):
            if isinstance(small, (cst.Import, cst.ImportFrom)):
                imports.add(small)
    return imports.qualify(cst.parse_expression(expr)), imports.qualify_local(
        cst.parse_expression(expr)
    )


@pytest.mark.parametrize(
    ("source", "expr", "expected"),
    [
        ("from .utils import save", "save", ".utils.save"),
        ("from ..data.loaders import build as make", "make", "..data.loaders.build"),
        ("from . import utils", "utils.save_on_master", ".utils.save_on_master"),
        ("import utils", "utils.save", "utils.save"),  # absolute: what qualify says
    ],
)
def test_relative_imports_are_qualified_for_the_project_only(source, expr, expected):
    plain, local = qualify_local(source, expr)
    assert local == expected
    # `qualify` keeps answering for libraries only: a relative name is never a library's.
    assert plain == (expected if not expected.startswith(".") else None)
