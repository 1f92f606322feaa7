"""Fixes of the training-loop rules: DDP043's rename to torch.amp, DDP044's unscale_."""

from __future__ import annotations

import textwrap
import warnings

import pytest

from ddpify.fixes import apply_fixes
from tests.helpers import codes, fix, fix_cleanly, lint


def _dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# -- DDP043 -----------------------------------------------------------------------------

AMP_CASES = [
    pytest.param(
        "import torch\nscaler = torch.cuda.amp.GradScaler()\n",
        'import torch\nscaler = torch.amp.GradScaler("cuda")\n',
        id="scaler-no-args",
    ),
    pytest.param(
        "import torch as th\nscaler = th.cuda.amp.GradScaler(2.0**10, enabled=True)\n",
        'import torch as th\nscaler = th.amp.GradScaler("cuda", 2.0**10, enabled=True)\n',
        id="alias-positional-scaler-args-keep-their-place",
    ),
    pytest.param(
        "import torch\nwith torch.cuda.amp.autocast(True, torch.bfloat16):\n    pass\n",
        'import torch\nwith torch.amp.autocast("cuda", enabled=True, dtype=torch.bfloat16):\n'
        "    pass\n",
        id="autocast-positional-args-become-keywords",
    ),
    pytest.param(
        "import torch\nwith torch.cpu.amp.autocast(dtype=torch.bfloat16):\n    pass\n",
        'import torch\nwith torch.amp.autocast("cpu", dtype=torch.bfloat16):\n    pass\n',
        id="cpu",
    ),
    pytest.param(
        "import torch\n"
        "scaler = torch.cuda.amp.GradScaler(\n"
        "    init_scale=1024,  # small models\n"
        "    growth_interval=100,\n"
        ")\n",
        "import torch\n"
        "scaler = torch.amp.GradScaler(\n"
        '    "cuda",\n'
        "    init_scale=1024,  # small models\n"
        "    growth_interval=100,\n"
        ")\n",
        id="multi-line-with-comment",
    ),
    pytest.param(
        "import torch\nfrom torch.cuda import amp\nwith amp.autocast():\n    pass\n",
        'import torch\nfrom torch.cuda import amp\nwith torch.amp.autocast("cuda"):\n    pass\n',
        id="module-alias-through-top-level-torch",
    ),
    pytest.param(
        "import torch\n"
        "\n"
        "\n"
        "class Trainer:\n"
        "    @torch.cuda.amp.autocast()\n"
        "    def forward(self, x):\n"
        "        return x\n",
        "import torch\n"
        "\n"
        "\n"
        "class Trainer:\n"
        '    @torch.amp.autocast("cuda")\n'
        "    def forward(self, x):\n"
        "        return x\n",
        id="decorator-in-class",
    ),
]


@pytest.mark.parametrize(("source", "expected"), AMP_CASES)
def test_amp_call_sites_are_renamed(source, expected):
    assert fix_cleanly(source, "DDP043") == expected


def test_from_import_is_rewritten_with_every_call_in_one_fix():
    source = _dedent(
        """
        import torch
        from torch.cuda.amp import GradScaler, autocast as amp_autocast  # legacy


        def main(model, x):
            scaler = GradScaler(enabled=True)
            with amp_autocast():
                loss = model(x).sum()
            with amp_autocast(False):
                loss = loss + model(x).sum()
            return scaler, loss
        """
    )
    expected = _dedent(
        """
        import torch
        from torch.amp import GradScaler, autocast as amp_autocast  # legacy


        def main(model, x):
            scaler = GradScaler("cuda", enabled=True)
            with amp_autocast("cuda"):
                loss = model(x).sum()
            with amp_autocast("cuda", enabled=False):
                loss = loss + model(x).sum()
            return scaler, loss
        """
    )
    diagnostics = lint(source, ["DDP043"])
    assert len(diagnostics) == 3
    # Any one diagnostic's fix alone leaves a working script: it carries all the edits.
    assert all(apply_fixes(source, [d]) == expected for d in diagnostics)
    assert fix_cleanly(source, "DDP043") == expected


def test_fixed_cpu_code_runs_without_deprecation_warnings():
    torch = pytest.importorskip("torch")
    source = _dedent(
        """
        import torch
        from torch.cpu.amp import autocast

        model = torch.nn.Linear(4, 4)
        with autocast(True, torch.bfloat16):
            out = model(torch.randn(2, 4))
        scaler = torch.cpu.amp.GradScaler(enabled=False)
        """
    )
    fixed = fix_cleanly(source, "DDP043")
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(fixed, "fixed.py", "exec"), namespace)
    assert namespace["out"].dtype is torch.bfloat16
    assert namespace["scaler"].is_enabled() is False


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            "import contextlib\nfrom torch.cuda.amp import autocast\n"
            "ctx = autocast if True else contextlib.nullcontext\nwith autocast():\n    pass\n",
            id="name-also-used-as-a-value",
        ),
        pytest.param(
            "from torch.cuda.amp import autocast, custom_fwd\nwith autocast():\n    pass\n",
            id="import-holds-other-names",
        ),
        pytest.param(
            "import torch\nargs = (True,)\nwith torch.cuda.amp.autocast(*args):\n    pass\n",
            id="star-args-hide-positions",
        ),
        pytest.param(
            "from torch.cuda import amp\nwith amp.autocast():\n    pass\n",
            id="no-torch-name-to-spell-torch-amp",
        ),
    ],
)
def test_amp_fix_is_withheld_when_it_could_break_the_script(source):
    assert "DDP043" in codes(source, ["DDP043"])
    assert fix(source, ["DDP043"], unsafe=True) == source


# -- DDP044 -----------------------------------------------------------------------------


def test_unscale_is_inserted_above_the_clip_and_its_comment():
    source = _dedent(
        """
        import torch
        from torch import nn


        def train(model, loader, optimizer, scaler):
            for x, y in loader:
                scaler.scale(model(x).sub(y).pow(2).mean()).backward()

                # keep updates bounded
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # max norm
                scaler.step(optimizer)
                scaler.update()
        """
    )
    expected = source.replace(
        "\n        # keep updates bounded\n",
        "\n        # keep updates bounded\n        scaler.unscale_(optimizer)\n",
    )
    assert fix_cleanly(source, "DDP044") == expected


def test_unscale_goes_into_the_accumulation_block_of_a_method():
    source = _dedent(
        """
        import torch


        class Trainer:
            def step(self, i, loss):
                self.scaler.scale(loss).backward()
                if (i + 1) % 4 == 0:
                    norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
        """
    )
    expected = source.replace(
        "            norm =",
        "            self.scaler.unscale_(self.optimizer)\n            norm =",
    )
    assert fix_cleanly(source, "DDP044") == expected


def test_unscale_at_module_level():
    source = _dedent(
        """
        import torch
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        scaler.step(opt)
        """
    )
    expected = source.replace("torch.nn.utils.clip", "scaler.unscale_(opt)\ntorch.nn.utils.clip")
    assert fix_cleanly(source, "DDP044") == expected


def test_clip_outside_the_amp_branch_needs_unsafe_fixes():
    source = _dedent(
        """
        import torch


        def train(model, loss, optimizer, scaler, use_amp):
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if use_amp:
                scaler.step(optimizer)
        """
    )
    assert fix(source, ["DDP044"]) == source
    fixed = fix_cleanly(source, "DDP044", unsafe=True)
    assert "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip" in fixed


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            "import torch\n"
            "scaler.scale(loss).backward()\n"
            "for group in opt.param_groups:\n"
            "    torch.nn.utils.clip_grad_norm_(group['params'], 1.0)\n"
            "scaler.step(opt)\n",
            id="clip-in-a-loop-the-step-is-not-in",
        ),
        pytest.param(
            "import torch\n"
            "scaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(params, 1.0)\n"
            "scaler.step(optimizers[0])\n",
            id="optimizer-is-not-a-plain-name",
        ),
        pytest.param(
            "import torch\n"
            "scaler.scale(loss).backward()\n"
            "log(torch.nn.utils.clip_grad_norm_(params, 1.0))\n"
            "scaler.step(opt)\n",
            id="clip-is-not-a-statement-of-its-own",
        ),
    ],
)
def test_unscale_fix_is_withheld_when_ambiguous(source):
    assert "DDP044" in codes(source, ["DDP044"])
    assert fix(source, ["DDP044"], unsafe=True) == source


def test_fixed_loop_clips_the_true_gradient_norm():
    """Run before and after the fix on CPU: only the fixed loop sees the unscaled norm."""
    torch = pytest.importorskip("torch")
    source = _dedent(
        """
        import torch

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        x = torch.randn(8, 4)
        scaler.scale(model(x).pow(2).mean()).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        scaler.step(optimizer)
        scaler.update()
        """
    )

    def clipped_norm(code: str) -> float:
        namespace: dict = {}
        exec(compile(code, "loop.py", "exec"), namespace)
        return float(namespace["norm"])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    true_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))

    assert clipped_norm(source) == pytest.approx(1024.0 * true_norm, rel=1e-5)
    assert clipped_norm(fix_cleanly(source, "DDP044")) == pytest.approx(true_norm, rel=1e-5)


# -- DDP040 -----------------------------------------------------------------------------

ACCUMULATION = _dedent(
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    calls = []

    def count_allreduce(state, bucket):
        calls.append(1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, count_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 4)
    accum = 4
    for i, x in enumerate(data.split(1)):
        loss = model(x).pow(2).mean() / accum  # forward
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    """
)


def _run_single_rank(code: str) -> dict:
    """Run `code` as rank 0 of a one-process gloo group (DDP needs a process group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        namespace: dict = {}
        exec(compile(code, "loop.py", "exec"), namespace)
        return namespace
    finally:
        dist.destroy_process_group()


def test_no_sync_fix_wraps_forward_and_backward_and_imports_contextlib():
    fixed = fix_cleanly(ACCUMULATION, "DDP040")
    assert fixed.startswith("import contextlib\nimport torch\n")
    assert (
        "    with contextlib.nullcontext() if (i + 1) % accum == 0 else model.no_sync():\n"
        "        loss = model(x).pow(2).mean() / accum  # forward\n"
        "        loss.backward()\n"
        "    if (i + 1) % accum == 0:\n"
    ) in fixed
    assert fix(fixed, ["DDP040"]) == fixed  # idempotent


def test_no_sync_fix_skips_the_micro_step_allreduces_and_keeps_the_weights():
    """Run before and after the fix: the same weights, one all-reduce per window."""
    pytest.importorskip("torch")
    before = _run_single_rank(ACCUMULATION)
    after = _run_single_rank(fix_cleanly(ACCUMULATION, "DDP040"))
    assert len(before["calls"]) == 8
    assert len(after["calls"]) == 2
    for a, b in zip(before["model"].parameters(), after["model"].parameters()):
        assert a.detach().allclose(b.detach())


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            ACCUMULATION.replace(
                "    if (i + 1) % accum == 0:", "    step += 1\n    if step % accum == 0:"
            ),
            id="test-reads-a-counter-the-loop-changes",
        ),
        pytest.param(
            ACCUMULATION + "optimizer.step()\n",
            id="a-flushing-step-after-the-loop",
        ),
        pytest.param(
            ACCUMULATION.replace("model = DDP(", "model = torch.nn.Linear(4, 2) if cpu else DDP("),
            id="wrapper-may-be-a-plain-module",
        ),
        pytest.param(
            ACCUMULATION.replace(
                "if (i + 1) % accum == 0:",
                "if should_step(i, accum):\n        pass\n    if (i + 1) % accum == 0 and ready():",
            ),
            id="test-calls-a-function",
        ),
    ],
)
def test_no_sync_fix_is_withheld_when_the_test_could_change_meaning(source):
    assert "DDP040" in codes(source, ["DDP040"])
    assert fix(source, ["DDP040"], unsafe=True) == source


# -- DDP042 -----------------------------------------------------------------------------

SCHEDULE = _dedent(
    """
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train_ds = TensorDataset(torch.randn(100, 2))
    sampler = DistributedSampler(train_ds, num_replicas=4, rank=0)
    loader = DataLoader(train_ds, batch_size=5, sampler=sampler)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    total = len(train_ds) // 5 * 2
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total)
    for epoch in range(2):
        for batch in loader:
            optimizer.step()
            scheduler.step()
    dist.destroy_process_group()
    """
)


def test_schedule_fix_counts_the_loader_and_reaches_the_end_of_the_schedule():
    """Run before and after on 1 of 4 shards: only the fix decays the LR to its floor."""
    pytest.importorskip("torch")
    fixed = fix_cleanly(SCHEDULE, "DDP042", unsafe=True)
    assert "total = len(loader) * 2\n" in fixed

    def final_lr(code: str) -> float:
        namespace: dict = {}
        exec(compile(code, "schedule.py", "exec"), namespace)
        return namespace["optimizer"].param_groups[0]["lr"]

    assert final_lr(SCHEDULE) == pytest.approx(0.75)  # 10 of 40 steps taken
    assert final_lr(fixed) == pytest.approx(0.0)


def test_schedule_fix_needs_unsafe_fixes_and_the_same_batch_size():
    assert fix(SCHEDULE, ["DDP042"]) == SCHEDULE  # safe fixes only: unchanged
    other_batch = SCHEDULE.replace("len(train_ds) // 5", "len(train_ds) // 10")
    assert "DDP042" in codes(other_batch, ["DDP042"])
    assert fix(other_batch, ["DDP042"], unsafe=True) == other_batch
