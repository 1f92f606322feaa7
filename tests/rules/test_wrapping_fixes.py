"""Fixes of the wrapping rules: DDP031 and DDP035 reorder, DDP032 inserts `.module`,
DDP033 calls the wrapper. Each fix compiles and removes its finding; where no fix is
provably right, none is offered."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import fix, fix_cleanly, lint

HEAD = (
    "import os\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch import nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "local_rank = int(os.environ['LOCAL_RANK'])\n"
    "dist.init_process_group('nccl')\n"
)


def src(text: str) -> str:
    return HEAD + textwrap.dedent(text).lstrip("\n")


def fix_offered(source: str, code: str) -> bool:
    return any(d.fix is not None for d in lint(source, [code]) if d.code == code)


# -- DDP031 modify-after-wrap: swap the wrap with the change right after it ---------------


def test_cast_after_the_wrap_moves_before_it_keeping_comments():
    before = src(
        """
        def main():
            model = nn.Linear(2, 2).cuda()
            # wrap for data parallel training
            model = DDP(model, device_ids=[local_rank])
            model.half()  # fp16 weights
            return model
        """
    )
    assert fix_cleanly(before, "DDP031") == src(
        """
        def main():
            model = nn.Linear(2, 2).cuda()
            model.half()  # fp16 weights
            # wrap for data parallel training
            model = DDP(model, device_ids=[local_rank])
            return model
        """
    )


def test_move_of_the_raw_model_after_its_wrap_at_top_level():
    before = src("net = nn.Linear(2, 2)\nddp = DDP(net)\nnet.cuda(local_rank)\n")
    fixed = fix_cleanly(before, "DDP031")
    assert fixed.endswith("net = nn.Linear(2, 2)\nnet.cuda(local_rank)\nddp = DDP(net)\n")


def test_freezing_loop_is_an_unsafe_reorder():
    before = src(
        """
        model = nn.Linear(2, 2).cuda()
        model = DDP(model, device_ids=[local_rank])
        for p in model.parameters():
            p.requires_grad = False
        """
    )
    assert fix(before, ["DDP031"]) == before  # not among the safe fixes
    fixed = fix_cleanly(before, "DDP031", unsafe=True)
    assert fixed.endswith(
        "for p in model.parameters():\n    p.requires_grad = False\n"
        "model = DDP(model, device_ids=[local_rank])\n"
    )


@pytest.mark.parametrize(
    "body",
    [
        # Not right after the wrap: what runs in between may need the wrapper.
        "model = DDP(model)\nopt = torch.optim.SGD(model.parameters(), lr=1)\nmodel.half()\n",
        # Through the wrapper's `.module`: that name does not exist before the wrap.
        "model = DDP(model)\nmodel.module.fc.half()\n",
        # The wrapper's name while the change is written on it: moving it would read it unbound.
        "ddp = DDP(net)\nddp.half()\n",
        # A replaced submodule: the model must be rebuilt before the wrap by hand.
        "model = DDP(model)\nmodel.module.fc = nn.Linear(2, 2)\n",
        # `.cpu()` before `DDP(device_ids=...)` would raise.
        "model = nn.Linear(2, 2)\nmodel = DDP(model)\nmodel.cpu()\n",
    ],
)
def test_no_reorder_where_it_is_not_provably_the_same(body):
    source = src(body)
    assert "DDP031" in [d.code for d in lint(source, ["DDP031"])]
    assert not fix_offered(source, "DDP031")


# -- DDP032 wrapper-attribute-access: `.module.x` -----------------------------------------


def test_attribute_read_goes_through_module():
    before = src(
        """
        class Trainer:
            def __init__(self, net):
                self.model = DDP(net, device_ids=[local_rank])

            def sample(self, x):
                return self.model.generate(x, max_new_tokens=5)  # greedy
        """
    )
    fixed = fix_cleanly(before, "DDP032")
    assert "return self.model.module.generate(x, max_new_tokens=5)  # greedy\n" in fixed


def test_every_access_in_a_statement_is_fixed():
    before = src("model = DDP(net)\nprint(model.config, model.generate(model.bos))\n")
    fixed = fix_cleanly(before, "DDP032")
    assert fixed.endswith("print(model.module.config, model.module.generate(model.module.bos))\n")


# -- DDP033 bypass-wrapper-forward: call the wrapper --------------------------------------


@pytest.mark.parametrize(
    ("call", "expected"),
    [("model.module(x)", "model(x)"), ("model.module.forward(x)", "model(x)")],
)
def test_forward_goes_through_the_wrapper(call, expected):
    loop = "model = DDP(net)\nfor x in data:\n    loss = {}.mean()  # step\n    loss.backward()\n"
    fixed = fix_cleanly(src(loop.format(call)), "DDP033")
    assert fixed == src(loop.format(expected))


def test_raw_model_call_uses_the_wrapper_name():
    before = src(
        """
        def train(net, data, opt):
            ddp_net = DDP(net, device_ids=[local_rank])
            for x, y in data:
                loss = (net(x) - y).pow(2).mean()
                loss.backward()
                opt.step()
        """
    )
    fixed = fix_cleanly(before, "DDP033")
    assert "loss = (ddp_net(x) - y).pow(2).mean()\n" in fixed


def test_no_fix_when_the_wrapper_is_conditional():
    source = src(
        """
        def train(net, data, distributed):
            model = DDP(net) if distributed else net
            for x in data:
                model.module(x).sum().backward()
        """
    )
    # `model.module` fails when `model` is the raw net, so the path that runs is the DDP
    # one: reported, but `model(x)` would be a different call on the other path.
    assert [d.code for d in lint(source, ["DDP033"])] == ["DDP033"]
    assert not fix_offered(source, "DDP033")


# -- DDP035 compile-order: compile the inner model (unsafe) -------------------------------


def test_compile_of_a_wrap_expression_moves_inside():
    before = src("model = torch.compile(DDP(net, device_ids=[local_rank]), mode='max-autotune')\n")
    assert fix(before, ["DDP035"]) == before
    fixed = fix_cleanly(before, "DDP035", unsafe=True)
    assert fixed.endswith(
        "model = DDP(torch.compile(net, mode='max-autotune'), device_ids=[local_rank])\n"
    )


def test_compile_line_after_the_wrap_swaps_with_it():
    before = src("model = nn.Linear(2, 2)\nmodel = DDP(model)\nmodel = torch.compile(model)\n")
    fixed = fix_cleanly(before, "DDP035", unsafe=True)
    assert fixed.endswith("model = torch.compile(model)\nmodel = DDP(model)\n")


def test_in_place_compile_of_the_wrapper_has_no_fix():
    source = src("model = DDP(model)\nmodel.compile()\n")
    assert not fix_offered(source, "DDP035")


def test_optimizer_factory_gets_the_inner_model():
    before = src(
        "from timm.optim import create_optimizer_v2\n"
        "model = DDP(net, device_ids=[local_rank])\n"
        "opt = create_optimizer_v2(model, opt='adamw', weight_decay=0.05)\n"
    )
    fixed = fix_cleanly(before, "DDP032")
    assert fixed.endswith(
        "opt = create_optimizer_v2(model.module, opt='adamw', weight_decay=0.05)\n"
    )


# -- DDP036 isinstance-dataparallel-only: also accept DDP (safe) ----------------------------


def test_a_test_for_dataparallel_also_accepts_the_files_ddp():
    before = src(
        """
        model = DDP(nn.Linear(2, 2))
        net = model.module if isinstance(model, nn.DataParallel) else model
        """
    )
    fixed = fix_cleanly(before, "DDP036")
    assert fixed.endswith(
        "net = model.module if isinstance(model, (nn.DataParallel, DDP)) else model\n"
    )


def test_a_file_without_a_name_for_ddp_gets_no_fix():
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
        "dist.init_process_group('nccl')\n"
        "model = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2).cuda())\n"
        "net = model.module if isinstance(model, nn.DataParallel) else model\n"
    )
    assert [d.code for d in lint(source, ["DDP036"])] == ["DDP036"]
    assert not fix_offered(source, "DDP036")
