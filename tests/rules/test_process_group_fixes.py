"""DDP003's fix (both spellings, LOCAL_RANK from the environment as the default) and DDP005's
(the backend chosen at run time)."""

from __future__ import annotations

from tests.helpers import codes, fix, fix_cleanly, lint

HEADER = "import argparse\nimport os\n\nimport torch\n\nparser = argparse.ArgumentParser()\n"


def test_adds_the_spelling_and_env_default_keeping_comments():
    source = HEADER + (
        "parser.add_argument(\n"
        "    '--local_rank',  # set by the launcher\n"
        "    type=int,\n"
        "    default=-1,\n"
        ")\n"
    )
    fixed = fix(source, ["DDP003"], unsafe=True)
    assert fixed == HEADER + (
        "parser.add_argument(\n"
        "    '--local_rank', '--local-rank',  # set by the launcher\n"
        "    type=int,\n"
        '    default=int(os.environ.get("LOCAL_RANK", -1)),\n'
        ")\n"
    )
    compile(fixed, "fixed.py", "exec")
    assert "DDP003" not in codes(fixed, ["DDP003"])


def test_changing_the_default_is_unsafe_and_not_applied_by_default():
    source = HEADER + 'parser.add_argument("--local_rank", type=int, default=0)\n'
    assert fix(source, ["DDP003"]) == source


def test_spelling_only_is_safe_when_the_environment_is_read():
    source = HEADER + (
        'parser.add_argument("--local_rank", type=int, default=0)\n'
        'local_rank = int(os.environ["LOCAL_RANK"])\n'
    )
    fixed = fix(source, ["DDP003"])
    assert 'parser.add_argument("--local_rank", "--local-rank", type=int, default=0)' in fixed
    assert codes(fixed, ["DDP003"]) == []


def test_none_default_keeps_none_outside_any_launcher():
    source = HEADER + 'parser.add_argument("--local-rank", type=int, default=None)\n'
    fixed = fix(source, ["DDP003"], unsafe=True)
    expected = 'default=int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None)'
    assert expected in fixed
    assert codes(fixed, ["DDP003"]) == []


def test_no_fix_without_os_or_with_an_unknown_default():
    without_os = "import argparse\nimport torch\np = argparse.ArgumentParser()\n"
    source = without_os + 'p.add_argument("--local_rank", type=int, default=0)\n'
    assert [d.fix for d in lint(source, ["DDP003"])] == [None]
    computed = HEADER + 'parser.add_argument("--local_rank", type=int, default=rank())\n'
    assert [d.fix for d in lint(computed, ["DDP003"])] == [None]


def test_noop_on_a_compatible_script():
    source = HEADER + (
        'parser.add_argument("--local-rank", "--local_rank", type=int,\n'
        '                    default=int(os.environ.get("LOCAL_RANK", 0)))\n'
    )
    assert fix(source, ["DDP003"], unsafe=True) == source


# -- DDP005: nccl on CUDA, gloo on the CPU -----------------------------------------------------

FALLBACK = (
    "import torch\n"
    "import torch.distributed as dist\n"
    "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
)


def test_ddp005_chooses_the_backend_at_run_time():
    source = FALLBACK + "dist.init_process_group(backend='nccl')  # one group\n"
    fixed = fix_cleanly(source, "DDP005")
    assert fixed == FALLBACK + (
        "dist.init_process_group(backend='nccl' if torch.cuda.is_available() else 'gloo')"
        "  # one group\n"
    )


def test_ddp005_fixes_the_constant_the_init_reads():
    source = FALLBACK + 'BACKEND = "nccl"\n\ndef setup():\n    dist.init_process_group(BACKEND)\n'
    fixed = fix_cleanly(source, "DDP005")
    assert 'BACKEND = "nccl" if torch.cuda.is_available() else "gloo"\n' in fixed


def test_ddp005_cpu_tensors_have_no_fix():
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "t = torch.tensor([1.0])\n"
        "dist.all_reduce(t)\n"
    )
    (finding,) = lint(source, ["DDP005"])
    assert finding.fix is None
