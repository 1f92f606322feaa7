"""Converted scripts keep their tensors where the original kept them, and AMP wraps the loss.

On a GPU machine a script that trains on the CPU must get a gloo group and no device_ids
(nccl cannot carry CPU tensors; DDP rejects device_ids for a CPU module), and autocast
must cover the loss as well as the forward (a bf16 output against a float32 target fails
in backward on CUDA). Whether the converted scripts run is tests/test_migrate_run.py's
job; these tests read what the migration wrote.
"""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.devices import cuda_placement
from ddpify.analysis.tree import Tree
from ddpify.migrate import Options, migrate_source
from tests.helpers import FIXTURES

CASES_DIR = FIXTURES / "migrate"


def _placement(code: str) -> str | None:
    tree = Tree(cst.parse_module(code))
    node = cuda_placement(tree.nodes, tree.qualify, tree.parent)
    return None if node is None else tree.code(node)


# -- where tensors live -----------------------------------------------------------------


@pytest.mark.parametrize(
    "code, evidence",
    [
        ("import torch\nm = torch.nn.Linear(2, 2).cuda()\n", "torch.nn.Linear(2, 2).cuda()"),
        ('import torch\ndev = "cuda" if torch.cuda.is_available() else "cpu"\n', '"cuda"'),
        ('import torch\nx = torch.zeros(2, device=f"cuda:{rank}")\n', 'f"cuda:{rank}"'),
        ("import torch\ndef f(rank, m):\n    return m.to(rank)\n", "m.to(rank)"),
        ("import torch\nm = torch.nn.Linear(2, 2).to(0)\n", "torch.nn.Linear(2, 2).to(0)"),
        (
            "import torch\ndevice = torch.accelerator.current_accelerator()\n",
            "torch.accelerator.current_accelerator()",
        ),
        (
            "import torch\nfrom torch.nn import DataParallel\nm = DataParallel(net)\n",
            "DataParallel(net)",
        ),
        (
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "m = DDP(net, device_ids=[args.gpu])\n",
            "DDP(net, device_ids=[args.gpu])",
        ),
    ],
)
def test_cuda_placements_are_found(code, evidence):
    assert _placement(code) == evidence


@pytest.mark.parametrize(
    "code",
    [
        'import torch\ndevice = torch.device("cpu")\nm = torch.nn.Linear(2, 2).to(device)\n',
        "import torch\nif torch.cuda.is_available():\n    torch.cuda.set_device(gpu)\n",
        'import torch\nwith torch.autocast("cuda", enabled=False):\n    pass\n',
        'import torch\nuse_amp = device.type == "cuda"\n',
        'import torch\nscaler = torch.amp.GradScaler("cuda", enabled=False)\n',
        "import torch\nm = net.to(torch.float64)\nddp = DDP(net, device_ids=None)\n",
    ],
)
def test_device_types_and_cpu_devices_are_not_placements(code):
    assert _placement(code) is None


@pytest.mark.parametrize("case", ["launch_toplevel", "spawn_helper"])
def test_a_script_that_never_uses_a_gpu_gets_gloo_and_no_amp(case):
    result = migrate_source((CASES_DIR / case / "before.py").read_text(), "before.py")
    out = result.output
    assert 'init_process_group("gloo")' in out
    assert "cuda:nccl" not in out and "set_device" not in out
    assert "device_ids=" not in out and "autocast" not in out and "SCALER" not in out
    assert any("keeps its tensors on the CPU" in item.why for item in result.needs_human)


def test_a_gpu_script_gets_both_backends_bound_to_its_gpu():
    out = (CASES_DIR / "spawn_tutorial" / "after.py").read_text()
    assert '"cpu:gloo,cuda:nccl", torch.device("cuda", LOCAL_RANK)' in out
    assert out.count("device_id=device_id") == 2
    assert "device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None" in out


CPU_BARE_MODEL = """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16)
for x, y in loader:
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
"""


def test_a_cpu_model_is_wrapped_without_device_ids_or_sync_batchnorm():
    out = migrate_source(CPU_BARE_MODEL, "t.py").output
    assert "model = DDP(model)\n" in out
    assert "convert_sync_batchnorm" not in out  # it would raise on the CPU module


# -- the loss inside autocast -----------------------------------------------------------


def _step(body: str, before: str = "") -> str:
    """A GPU script whose training step is `body` (indented under the batch loop)."""
    lines = "\n".join("        " + line for line in body.splitlines())
    return f"""\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.MSELoss()
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
{before}
for epoch in range(2):
    for x, y in loader:
{lines}
"""


def _amp_block(out: str) -> str:
    """The autocast block and the line after it."""
    start = out.index("with torch.autocast(")
    lines = out[start:].splitlines()
    block = [lines[0]] + [line for line in lines[1:3]]
    return "\n".join(line.strip() for line in block)


def test_a_loss_computed_in_the_backward_line_moves_inside_autocast():
    code = _step("out = model(x)\nloss_fn(out, y).backward()\noptimizer.step()")
    out = migrate_source(code, "t.py").output
    assert _amp_block(out) == (
        'with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):\n'
        "out = model(x)\n"
        "loss = loss_fn(out, y)"
    )
    assert "        SCALER.scale(loss).backward()\n" in out


def test_a_one_line_forward_and_loss_becomes_statements():
    code = _step(
        "# forward and backward\nloss_fn(model(x), y).backward(retain_graph=False)\n"
        "optimizer.step()",
        before="loss = None\n",
    )
    result = migrate_source(code, "t.py")
    out = result.output
    # `loss` is taken in this scope, so the new name is another one.
    assert (
        "        # forward and backward\n"
        '        with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):\n'
        "            batch_loss = loss_fn(model(x), y)\n"
        "        SCALER.scale(batch_loss).backward(retain_graph=False)\n"
    ) in out
    assert migrate_source(out, "t.py").output == out


def test_a_named_loss_keeps_its_backward_line():
    code = _step("loss = loss_fn(model(x), y)\n(loss / 2).backward()\noptimizer.step()")
    out = migrate_source(code, "t.py").output
    assert "    loss = loss_fn(model(x), y)\n        SCALER.scale((loss / 2)).backward()" in out


def test_a_backward_inside_a_larger_statement_gets_no_amp():
    code = _step("total = loss_fn(model(x), y).backward() or 0\noptimizer.step()")
    result = migrate_source(code, "t.py")
    assert "autocast" not in result.output
    assert any("mixed precision not added" in item.why for item in result.needs_human)


def test_fp16_clipping_unscales_first_with_the_restructured_loss():
    code = _step(
        "loss_fn(model(x), y).backward()\n"
        "nn.utils.clip_grad_norm_(model.parameters(), 1.0)\noptimizer.step()"
    )
    out = migrate_source(code, "t.py", Options(amp="fp16")).output
    backward = out.index("SCALER.scale(loss).backward()")
    unscale = out.index("SCALER.unscale_(optimizer)")
    assert backward < unscale < out.index("clip_grad_norm_") < out.index("SCALER.step(optimizer)")
    assert "AMP_DTYPE = torch.float16\n" in out


GAN = """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
gen = nn.Linear(8, 4).to(device)
disc = nn.Linear(4, 1).to(device)
opt_g = torch.optim.Adam(gen.parameters())
opt_d = torch.optim.Adam(disc.parameters())
criterion = nn.BCEWithLogitsLoss()
loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8)
for (real,) in loader:
    real = real.to(device)
    noise = torch.randn(real.size(0), 8, device=device)
    opt_g.zero_grad()
    fake = gen(noise)
    g_loss = criterion(disc(fake), torch.ones(real.size(0), 1, device=device))
    g_loss.backward()
    opt_g.step()
    opt_d.zero_grad()
    d_real = disc(real)
    d_loss = criterion(d_real, torch.ones_like(d_real)) + criterion(
        disc(fake.detach()), torch.zeros_like(d_real)
    )
    d_loss.backward()
    opt_d.step()
"""


def test_each_of_two_steps_in_one_loop_gets_its_own_autocast_block():
    out = migrate_source(GAN, "gan.py").output
    lines = [line.strip() for line in out[out.index("for (real,) in loader:") :].splitlines()]
    autocast = 'with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):'
    assert lines.count(autocast) == 2
    first, second = (i for i, line in enumerate(lines) if line == autocast)
    assert lines[first + 1 : first + 3] == [
        "fake = gen(noise)",
        "g_loss = criterion(disc(fake), torch.ones(real.size(0), 1, device=device))",
    ]
    assert lines[first + 3 : second] == [
        "SCALER.scale(g_loss).backward()",
        "SCALER.step(opt_g)",
        "SCALER.update()",
        "opt_d.zero_grad()",
    ]
    assert lines[second + 1] == "d_real = disc(real)"


def test_two_backwards_before_one_step_update_the_scaler_once():
    code = _step(
        "loss = loss_fn(model(x), y)\nloss.backward()\n"
        "extra = loss_fn(model(x * 2), y)\nextra.backward()\noptimizer.step()"
    )
    out = migrate_source(code, "t.py").output
    assert out.count("SCALER.update()") == 1 and out.count("SCALER.step(optimizer)") == 1
    assert out.count("with torch.autocast(") == 2


# -- a device an option picks -----------------------------------------------------------


def migrate_case(case: str) -> str:
    return migrate_source((CASES_DIR / case / "before.py").read_text(), "before.py").output


def test_a_model_on_an_options_device_gets_no_device_ids():
    """`--device` defaults to "cpu": on a GPU machine DDP would reject device_ids for the
    CPU module; without them DDP takes whatever device the option put the model on."""
    out = migrate_case("device_option_cpu_default")
    assert "model = DDP(model)\n" in out
    assert "device_ids" not in out.split("def main")[1]


def test_an_options_accepted_spellings_are_not_rewritten():
    out = migrate_case("device_option_cpu_default")
    assert 'choices=["cpu", "cuda"]' in out  # `--device cuda` must still parse


def test_a_device_chosen_by_availability_keeps_device_ids():
    code = _step("loss = loss_fn(model(x), y)\nloss.backward()\noptimizer.step()")
    out = migrate_source(code, "t.py").output
    assert "device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None" in out


# -- gradient penalties -----------------------------------------------------------------


def _penalty_items(result) -> list:
    return [item for item in result.needs_human if "gradient penalty" in item.why]


def test_a_gradient_penalty_keeps_the_script_in_full_precision():
    """gan_r1_penalty differentiates `torch.autograd.grad(..., create_graph=True)`: a
    GradScaler would not scale those gradients, so no AMP, and the report says why."""
    result = migrate_source((CASES_DIR / "gan_r1_penalty" / "before.py").read_text(), "b.py")
    assert "autocast" not in result.output and "SCALER" not in result.output
    (item,) = _penalty_items(result)
    assert result.output.splitlines()[item.line - 1].strip().startswith("(grads,) = torch.autograd")


@pytest.mark.parametrize(
    "step, amp",
    [
        ("loss = loss_fn(model(x), y)\nloss.backward(create_graph=True)\noptimizer.step()", False),
        (
            "loss = loss_fn(model(x), y)\n"
            "(g,) = torch.autograd.grad(loss, x, create_graph=False)\n"
            "loss.backward()\noptimizer.step()",
            True,
        ),
    ],
)
def test_only_a_graph_of_gradients_keeps_amp_off(step, amp):
    result = migrate_source(_step(step), "t.py")
    assert ("autocast" in result.output) is amp
    assert bool(_penalty_items(result)) is not amp


def test_a_penalty_helper_nobody_calls_leaves_amp_on():
    helper = (
        "\ndef gradient_penalty(critic, real):\n"
        "    (g,) = torch.autograd.grad(critic(real).sum(), real, create_graph=True)\n"
        "    return g.pow(2).sum()\n"
    )
    code = _step("loss = loss_fn(model(x), y)\nloss.backward()\noptimizer.step()", helper)
    result = migrate_source(code, "t.py")
    assert "autocast" in result.output and not _penalty_items(result)


@pytest.mark.parametrize("spelling", ['"cuda"', "'cuda:0'", '"\\x63uda"', "'''cuda'''"])
def test_every_spelling_of_the_cuda_string_becomes_the_process_gpu(spelling):
    # The pass reads a literal's text before evaluating it; an escape spells it too.
    source = (CASES_DIR / "single_main_argparse" / "before.py").read_text()
    source = source.replace("import torch\n", f"import torch\nDEVICE = {spelling}\n", 1)
    result = migrate_source(source, "train.py")
    line = next(x for x in result.output.splitlines() if x.startswith("DEVICE = "))
    assert line.startswith("DEVICE = f") and "cuda:{LOCAL_RANK}" in line
