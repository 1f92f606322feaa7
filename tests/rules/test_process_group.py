"""Process-group rules: severities the fixtures cannot show, and the shared helpers."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.names import ImportMap
from ddpify.diagnostics import Severity
from ddpify.rules.process_group._common import (
    environ_call_key,
    environ_subscript_key,
    is_cleanup_name,
    is_setup_name,
    string_prefix,
)
from tests.helpers import FIXTURES, lint

CASES = FIXTURES / "rules"


def severities(path, code):
    return [d.severity for d in lint(path.read_text(), [code])]


def test_missing_init_is_an_error():
    assert severities(CASES / "DDP001" / "ddp_in_main.py", "DDP001") == [Severity.ERROR]


@pytest.mark.parametrize("case", ["local_setup_helper", "external_rank_helper"])
def test_a_helper_that_may_initialise_lowers_ddp001_to_info(case):
    assert severities(CASES / "DDP001" / f"{case}.py", "DDP001") == [Severity.INFO]


MAIN = """
import torch
import torch.distributed as dist

def main():
{body}

if __name__ == "__main__":
    main()
"""


def ddp001(body: str):
    source = MAIN.format(body="\n".join("    " + line for line in body.splitlines()))
    return [d.severity for d in lint(source, ["DDP001"])]


@pytest.mark.parametrize(
    "guarded",
    [
        "rank = dist.get_rank() if dist.is_initialized() else 0",
        "if dist.is_available() and dist.is_initialized():\n    dist.barrier()",
        "if not dist.is_initialized():\n    return\ndist.barrier()",
        "ready = dist.is_initialized()\nif ready:\n    dist.barrier()",
    ],
)
def test_uses_guarded_by_is_initialized_are_quiet_and_the_bare_use_is_not(guarded):
    assert ddp001(guarded) == []
    assert ddp001("dist.all_reduce(torch.ones(1))\n" + guarded) == [Severity.ERROR]


def test_an_imported_setup_helper_silences_ddp001_but_an_unrelated_call_does_not():
    assert ddp001("utils.init_distributed_mode(args)\ndist.barrier()") == []
    assert ddp001("utils.setup_logging(args)\ndist.barrier()") == [Severity.ERROR]


def test_ddp001_is_quiet_once_init_is_called():
    assert ddp001("dist.init_process_group('gloo')\ndist.barrier()") == []


def test_ddp002_is_info_in_a_library_module_and_a_warning_in_a_script():
    library = CASES / "DDP002" / "library_init.py"
    assert severities(library, "DDP002") == [Severity.INFO]
    script = (
        library.read_text() + "\n\nif __name__ == '__main__':\n    init_distributed_mode(None)\n"
    )
    assert [d.severity for d in lint(script, ["DDP002"])] == [Severity.WARNING]


def test_ddp004_self_contained_spawn_launcher_is_info_only():
    assert set(severities(CASES / "DDP004" / "spawn_tutorial.py", "DDP004")) == {Severity.INFO}


def test_ddp004_the_same_settings_warn_once_torchrun_env_is_read():
    source = (CASES / "DDP004" / "spawn_tutorial.py").read_text()
    source = source.replace(
        "    n_gpus = torch.cuda.device_count()",
        '    n_gpus = int(os.environ["WORLD_SIZE"])',
    )
    found = {(d.location.row, d.severity) for d in lint(source, ["DDP004"])}
    # The MASTER_* writes and the second launcher now fight torchrun; rank/world_size are
    # variables the analysis cannot tie to a literal, so they stay advisory.
    assert (10, Severity.WARNING) in found and (11, Severity.WARNING) in found
    assert (12, Severity.INFO) in found
    assert any(row == 23 and sev is Severity.WARNING for row, sev in found)


def test_ddp004_torchrun_overrides_are_warnings():
    found = severities(CASES / "DDP004" / "torchrun_overrides.py", "DDP004")
    assert found and set(found) == {Severity.WARNING}


@pytest.mark.parametrize(
    "name",
    ["init_distributed_mode", "init_dist", "setup", "ddp_setup", "setup_distributed", "dist_init"],
)
def test_setup_names(name):
    assert is_setup_name(name)


@pytest.mark.parametrize(
    "name", ["setup_seed", "setup_logging", "init_weights", "is_distributed", "get_dist_info"]
)
def test_names_that_are_not_setup(name):
    assert not is_setup_name(name)


def test_cleanup_names():
    assert all(map(is_cleanup_name, ["cleanup", "ddp_cleanup", "cleanup_distributed"]))
    assert not any(map(is_cleanup_name, ["shutdown", "close", "cleanup_checkpoints"]))


def _imports(*lines: str) -> ImportMap:
    imports = ImportMap()
    for line in lines:
        statement = cst.parse_statement(line)
        imports.add(statement.body[0])
    return imports


def test_environment_keys_through_import_spellings():
    imports = _imports("import os", "from os import environ, getenv")
    subscript = cst.parse_expression('environ["LOCAL_RANK"]')
    assert environ_subscript_key(subscript, imports) == "LOCAL_RANK"
    assert environ_call_key(cst.parse_expression('getenv("RANK")'), imports) == ("get", "RANK")
    call = cst.parse_expression('os.environ.setdefault("MASTER_PORT", "1")')
    assert environ_call_key(call, imports) == ("setdefault", "MASTER_PORT")
    assert environ_call_key(cst.parse_expression('config.get("RANK")'), imports) is None


def test_string_prefix_reads_the_start_of_an_f_string():
    assert string_prefix(cst.parse_expression('f"tcp://{host}:{port}"')) == "tcp://"
    assert string_prefix(cst.parse_expression('"env://"')) == "env://"
    assert string_prefix(cst.parse_expression("url")) is None


def test_ddp004_values_from_an_opaque_helper_stay_info_under_torchrun():
    found = severities(CASES / "DDP004" / "unknown_values.py", "DDP004")
    assert found == [Severity.INFO]


# -- DDP005 ------------------------------------------------------------------------------------

DDP005_HEAD = "import torch\nimport torch.distributed as dist\n"


def ddp005(body: str) -> list:
    return lint(DDP005_HEAD + body, ["DDP005"])


def test_ddp005_hard_coded_nccl_with_a_cpu_fallback_is_a_warning():
    (finding,) = ddp005("device = 'cpu' if args.cpu else 'cuda'\ndist.init_process_group('nccl')\n")
    assert finding.severity is Severity.WARNING
    assert "falls back to the CPU" in finding.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("dist.init_process_group('nccl')\n", id="no-cpu-path"),
        pytest.param(
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "dist.init_process_group('gloo')\n",
            id="gloo",
        ),
        pytest.param(
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "dist.init_process_group('cpu:gloo,cuda:nccl')\n",
            id="both-backends",
        ),
        pytest.param(
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "dist.init_process_group(args.dist_backend)\n",
            id="configured",
        ),
        pytest.param(
            "dist.init_process_group('gloo')\nt = torch.tensor([1.0])\ndist.all_reduce(t)\n",
            id="cpu-tensor-under-gloo",
        ),
        pytest.param(
            "dist.init_process_group('nccl')\nt = torch.tensor([1.0])\nt = t.cuda()\n"
            "dist.all_reduce(t)\n",
            id="moved-later",
        ),
        pytest.param(
            "dist.init_process_group('nccl')\ndist.all_reduce(loss.detach())\n",
            id="unknown-tensor",
        ),
    ],
)
def test_ddp005_quiet(body):
    assert ddp005(body) == []


def test_ddp005_cpu_tensor_fails_wherever_the_backend_is_nccl():
    (finding,) = ddp005(
        "dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')\n"
        "dist.all_reduce(torch.zeros(2))\n"
    )
    assert "`torch.zeros(2)` is created on the CPU" in finding.message
