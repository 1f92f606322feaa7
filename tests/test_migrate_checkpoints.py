"""What a converted script saves and restores is the plain model's state (ddpify/migrate/
unwrap.py): a checkpoint written on any path has the original's keys, the original's
checkpoints load, and a copy of the model made after the wrap is a copy of the model.

fixtures/migrate/best_model_copy (a best-model snapshot restored at the end) runs in the
batched runner (tests/test_migrate_run.py), where a copy of the wrapper would fail to
load into `model.module`; these check what a user reads and what the files hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import libcst as cst
import pytest

from ddpify.analysis.tree import Tree
from ddpify.migrate import migrate_source, type_tests, unwrap
from ddpify.migrate.analyze import Options, Plan, Shape
from tests.helpers import FIXTURES

CASES = FIXTURES / "migrate"
PROJECTS = FIXTURES / "projects"


def test_a_best_model_copy_made_after_the_wrap_copies_the_module():
    before = (CASES / "best_model_copy" / "before.py").read_text()
    result = migrate_source(before, "train.py")
    assert result.migrated, result.reason
    out = result.output
    assert out.index("model = DDP(model") < out.index("best_model = copy.deepcopy(model.module)")
    # Restoring the snapshot into the wrapped model reads the same plain keys.
    assert "model.module.load_state_dict(best_model.state_dict())" in out
    assert "best_model.module" not in out
    assert any(
        change.code == "DDP051" and "copy of model made after its DDP wrap" in change.description
        for change in result.changes
    )


def test_a_copy_made_before_the_wrap_is_left_as_it_is():
    """An EMA started from the plain model before training: the wrap goes after it."""
    before = (CASES / "gan_dict_by_key" / "before.py").read_text()
    out = migrate_source(before, "train.py").output
    assert "generator_ema = copy.deepcopy(nets.generator)\n" in out


# One process writes the checkpoint the original writes on the CPU (its own network
# builder, no DataParallel without GPUs), then runs the converted project resuming from it;
# it prints both checkpoints' keys.
RESUME = """
import os, runpy, sys
import torch

original, converted = sys.argv[1:3]
sys.path.insert(0, original)
from models import networks  # the original's

folder = os.path.join(converted, "checkpoints", "denoise")
os.makedirs(folder)
torch.save(networks.define_G(32, gpu_ids=[]).state_dict(), os.path.join(folder, "latest_net_G.pth"))
print("original", sorted(torch.load(os.path.join(folder, "latest_net_G.pth"))))
for name in [m for m in sys.modules if m.split(".")[0] == "models"]:
    del sys.modules[name]
sys.path[0] = converted
os.chdir(converted)
sys.argv = ["train.py", "--n_epochs", "1", "--continue_train"]
runpy.run_path("train.py", run_name="__main__")
print("converted", sorted(torch.load(os.path.join(folder, "latest_net_G.pth"))))
"""


@pytest.mark.torchrun
def test_the_converted_registry_saves_and_resumes_the_originals_keys_on_the_cpu(tmp_path):
    """model_registry applies DataParallel on GPUs only; the conversion wraps in DDP on
    every path, so the network fetched by name (`getattr(self, "net" + name)`) saves and
    loads through `getattr(net, "module", net)`: no `module.` prefix on a CPU run."""
    pytest.importorskip("torch")
    original, converted = tmp_path / "original", tmp_path / "converted"
    shutil.copytree(PROJECTS / "model_registry" / "before", original)
    shutil.copytree(PROJECTS / "model_registry" / "after", converted)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", RESUME, str(original), str(converted)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " [" in line)
    assert "loading the model from" in done.stdout  # the converted run resumed
    assert lines["original"] == lines["converted"]
    assert "module." not in lines["converted"] and "body.0.weight" in lines["converted"]


WRAPPED_ON_ONE_PATH = """\
import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(model, loader, optimizer, distributed):
    if distributed:
        model = DDP(model)
    best = None
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        best = copy.deepcopy(model)
    return best
"""


def test_a_copy_of_a_model_wrapped_on_one_path_only_unwraps_where_it_is_wrapped():
    """Where the wrap ran on some paths only, `model.module` would fail on the others:
    the copy takes `getattr(model, "module", model)`, the plain module on every path."""
    module = cst.parse_module(WRAPPED_ON_ONE_PATH)
    tree = Tree(module, WRAPPED_ON_ONE_PATH)
    plan = Plan(Shape.SINGLE, Options())
    edits = unwrap.run(tree, plan)
    out = edits.apply(module, tree.parent).code
    assert 'best = copy.deepcopy(getattr(model, "module", model))' in out
    assert [change.code for change in plan.changes] == ["DDP051"]
    # Already through `.module`: a second run changes nothing.
    again = Tree(cst.parse_module(out), out)
    assert not unwrap.run(again, Plan(Shape.SINGLE, Options()))


# -- tests for DataParallel (migrate/type_tests.py) --------------------------------------

# Runs a project's train.py in one process on the CPU, then prints the keys of the
# checkpoint it wrote.
RUN_AND_LIST_KEYS = """
import os, runpy, sys
import torch

folder = sys.argv[1]
sys.path.insert(0, folder)
os.chdir(folder)
sys.argv = ["train.py", "--epochs", "1"]
runpy.run_path("train.py", run_name="__main__")
for name in sorted(os.listdir("checkpoints")):
    state = torch.load(os.path.join("checkpoints", name))
    for part, value in (state.items() if "model" in state else [("", state)]):
        print(f"{name}:{part}", sorted(value))
"""


def _checkpoint_keys(folder) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_KEYS, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " [" in line)


@pytest.mark.torchrun
def test_isinstance_unwraps_keep_the_originals_checkpoint_and_ema_keys(tmp_path):
    """ema_dataparallel unwraps with `isinstance(model, nn.DataParallel)` in its EMA helper
    and its save helper. The converted model is a DDP wrapper on every path: its tests
    also name DDP, so the checkpoint and the EMA hold the original's keys, not `module.`."""
    pytest.importorskip("torch")
    original, converted = tmp_path / "original", tmp_path / "converted"
    shutil.copytree(PROJECTS / "ema_dataparallel" / "before", original)
    shutil.copytree(PROJECTS / "ema_dataparallel" / "after", converted)
    before, after = _checkpoint_keys(original), _checkpoint_keys(converted)
    assert after == before
    assert "module." not in after["last.pt:model"] and "body.0.weight" in after["last.pt:ema"]


@pytest.mark.torchrun
def test_an_ema_helper_handed_the_wrapper_copies_and_reads_the_model(tmp_path):
    """ema_copy_helper's `ModelEMA(model)` deep-copies what it is given and reads
    `model.state_dict()` by key at each update; one save helper writes both the EMA copy
    (a plain module) and the trained model. Converted, the copy and the reads both go
    through the plain model (a copy of the wrapper would have `module.` keys, and the
    update would fail with KeyError), and the save reaches `.module` only where there is
    one: both checkpoints have the original's keys."""
    pytest.importorskip("torch")
    original, converted = tmp_path / "original", tmp_path / "converted"
    shutil.copytree(PROJECTS / "ema_copy_helper" / "before", original)
    shutil.copytree(PROJECTS / "ema_copy_helper" / "after", converted)
    before, after = _checkpoint_keys(original), _checkpoint_keys(converted)
    assert after == before
    assert set(after) == {"ema.pt:", "last.pt:"} and "module." not in after["ema.pt:"]


def _type_tests_out(source: str) -> tuple[str, Plan]:
    module = cst.parse_module(source)
    tree = Tree(module, source)
    plan = Plan(Shape.DATA_PARALLEL, Options())
    edits = type_tests.run(tree, plan)
    return edits.apply(module, tree.parent).code, plan


TYPE_TESTS = """\
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def unwrap(model):
    if isinstance(model, torch.nn.DataParallel):
        return model.module
    return model.module if isinstance(model, (nn.Sequential, nn.DataParallel)) else model
"""


def test_a_test_for_dataparallel_also_names_the_modules_own_ddp():
    out, plan = _type_tests_out(TYPE_TESTS)
    assert "if isinstance(model, (torch.nn.DataParallel, DistributedDataParallel)):" in out
    assert "isinstance(model, (nn.Sequential, nn.DataParallel, DistributedDataParallel))" in out
    assert [change.code for change in plan.changes] == ["DDP036", "DDP036"]
    assert "ddp" not in plan.needs  # the module's own import names it
    again, plan = _type_tests_out(out)
    assert again == out and not plan.changes


def test_a_module_without_a_ddp_import_gets_one_through_the_imports_pass():
    out, plan = _type_tests_out(
        "import torch.nn as nn\n\ndef bare(m):\n"
        "    return m.module if isinstance(m, nn.DataParallel) else m\n"
    )
    assert "return m.module if isinstance(m, (nn.DataParallel, DDP)) else m" in out
    assert "ddp" in plan.needs


@pytest.mark.parametrize(
    "body",
    [
        "return model.module if isinstance(model, (nn.DataParallel, DistributedDataParallel)) "
        "else model",
        "if isinstance(model, nn.DataParallel) or isinstance(model, DistributedDataParallel):\n"
        "        return model.module",
        "return model.module if isinstance(model, nn.DataParallel) or hasattr(model, 'module') "
        "else model",
        "return model.module if isinstance(model, nn.Linear) else model",
        "return model.module if isinstance(model, (*wrappers, nn.DataParallel)) else model",
        # a type check, and a reduction of a loss module's gathered values: no unwrap
        "assert isinstance(model, nn.DataParallel)",
        "return loss.mean() if isinstance(model, nn.DataParallel) else loss",
        # DataParallel's own code: the branch wraps the module in a DataParallel again
        "if isinstance(model, nn.DataParallel):\n"
        "        return DataParallelWithCallback(convert(model.module))",
    ],
)
def test_tests_that_accept_ddp_or_decide_no_unwrap_are_left_alone(body):
    source = (
        "import torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel\n\n"
        f"def plain(model, wrappers, loss):\n    {body}\n"
    )
    out, plan = _type_tests_out(source)
    assert out == source and not plan.changes


@pytest.mark.parametrize(
    "test, widened",
    [
        ("type(model) == nn.DataParallel", "type(model) in (nn.DataParallel, DDP)"),
        ("type(model) is nn.DataParallel", "type(model) in (nn.DataParallel, DDP)"),
        ("type(model) in (nn.DataParallel,)", "type(model) in (nn.DataParallel, DDP)"),
        ("nn.DataParallel == type(model)", "type(model) in (nn.DataParallel, DDP)"),
    ],
)
def test_a_type_comparison_for_dataparallel_also_accepts_ddp(test, widened):
    source = (
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        f"def plain(model):\n    return model.module if {test} else model\n"
    )
    out, plan = _type_tests_out(source)
    assert f"return model.module if {widened} else model" in out
    assert [change.code for change in plan.changes] == ["DDP036"]


@pytest.mark.parametrize("operator", ["!=", "is not"])
def test_a_negated_type_comparison_becomes_not_in(operator):
    source = (
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        "def plain(model):\n"
        f"    return model if type(model) {operator} nn.DataParallel else model.module\n"
    )
    out, _ = _type_tests_out(source)
    assert "return model if type(model) not in (nn.DataParallel, DDP) else model.module" in out


@pytest.mark.parametrize(
    "body",
    [
        "return model.module if type(model) in (nn.DataParallel, DDP) else model",
        "return model.module if type(model) == nn.DataParallel or type(model) == DDP else model",
        "assert type(model) != nn.DataParallel",
        "return 'dp' if type(model) == nn.DataParallel else 'plain'",
        "return model.module if type(model) == nn.Sequential else model",
    ],
)
def test_type_comparisons_that_accept_ddp_or_decide_no_unwrap_are_left_alone(body):
    source = (
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        f"def plain(model):\n    {body}\n"
    )
    out, plan = _type_tests_out(source)
    assert out == source and not plan.changes


def _saved_keys(script, out) -> list[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script), "--epochs", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    return sorted(torch.load(out))


@pytest.mark.torchrun
def test_type_equality_unwraps_keep_the_originals_checkpoint_keys(tmp_path):
    """dp_type_equality_unwrap saves through `model if type(model) != nn.DataParallel else
    model.module`: converted, the DDP wrapper is unwrapped too, so the keys match."""
    pytest.importorskip("torch")
    case = FIXTURES / "migrate" / "dp_type_equality_unwrap"
    before = _saved_keys(case / "before.py", tmp_path / "before.pt")
    after = _saved_keys(case / "after.py", tmp_path / "after.pt")
    assert after == before and not any(key.startswith("module.") for key in after)


REWRAPS = """\
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def copy_for_eval(model):
    if isinstance(model, nn.DataParallel):
        inner = type(model.module)()
        inner.load_state_dict(model.module.state_dict())
        return nn.DataParallel(inner)
    fresh = type(model)()
    fresh.load_state_dict(model.state_dict())
    return fresh


def main(model):
    model = DDP(model)
    CALL
"""


def test_a_test_whose_branch_builds_a_dataparallel_again_is_left_to_a_human():
    """Widened, the DDP wrapper would become a DataParallel copy; as written it takes the
    other branch, which rebuilds `type(model)` (DDP): a human must make that unwrap."""
    source = REWRAPS.replace("CALL", "return copy_for_eval(model)")
    out, plan = _type_tests_out(source)
    assert out == source and not plan.changes
    (item,) = plan.human
    assert "builds a DataParallel again" in item.why
    assert "if isinstance(model, nn.DataParallel):" in (item.anchor or "")


def test_dataparallel_code_no_wrapper_reaches_needs_no_one():
    source = REWRAPS.replace("CALL", "return model")
    out, plan = _type_tests_out(source)
    assert out == source and not plan.changes and not plan.human
