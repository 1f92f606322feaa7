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
from ddpify.migrate import migrate_source, unwrap
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
