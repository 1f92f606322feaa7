"""Wrapping decisions that the fixture lines do not show: DDP011 and DDP030 order and
severity; the wrapper facts (ddpify.analysis.wrappers); DDP031-DDP035, each finding next
to the reasons the same rule stays quiet on code that looks alike."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.names import dotted
from ddpify.analysis.wrappers import FED_TYPES, Place, collect, may_follow
from ddpify.diagnostics import Severity
from ddpify.walk import subtree, walk
from tests.helpers import codes, lint

HEAD = (
    "import os\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch import nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "local_rank = int(os.environ['LOCAL_RANK'])\n"
    "dist.init_process_group('nccl')\n"
)


def _found(body: str, code: str) -> list[tuple[int, Severity]]:
    return [(d.location.row, d.severity) for d in lint(HEAD + body, [code])]


def test_a_move_after_the_wrap_does_not_count():
    body = "model = nn.Linear(2, 2)\nddp = DDP(model, device_ids=[local_rank])\nmodel.cuda()\n"
    assert _found(body, "DDP011") == [(9, Severity.ERROR)]


def test_a_move_before_the_wrap_counts_in_every_spelling():
    for move in ("model.cuda()", "model = model.to(local_rank)", "model.to(device=local_rank)"):
        body = f"model = nn.Linear(2, 2)\n{move}\nmodel = DDP(model, device_ids=[local_rank])\n"
        assert _found(body, "DDP011") == [], move


def test_rebinding_the_wrapped_name_judges_the_model_before_the_wrap():
    body = "model = nn.Linear(2, 2).cuda()\nmodel = DDP(model, device_ids=[local_rank])\n"
    assert _found(body, "DDP011") == []


def test_moves_in_another_function_are_not_judged():
    body = (
        "def build():\n    return nn.Linear(2, 2)\n"
        "def wrap(model):\n    return DDP(model, device_ids=[local_rank])\n"
    )
    assert _found(body, "DDP011") == []


def test_batchnorm_without_sync_is_info_and_after_the_wrap_an_error():
    unsynced = "model = nn.BatchNorm1d(2).cuda()\nmodel = DDP(model, device_ids=[local_rank])\n"
    late = unsynced + "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"
    assert _found(unsynced, "DDP030") == [(9, Severity.INFO)]
    assert _found(late, "DDP030") == [(10, Severity.ERROR)]


def test_conversion_in_an_earlier_function_is_not_after_the_wrap():
    body = (
        "def wrap(model):\n    return DDP(model, device_ids=[local_rank])\n"
        "def build():\n    model = nn.BatchNorm1d(2).cuda()\n"
        "    return nn.SyncBatchNorm.convert_sync_batchnorm(model)\n"
    )
    assert _found(body, "DDP030") == []


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


HEADER = src(
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    """
)


def found(body: str, code: str) -> list[str]:
    """`line:col message` of `code`'s findings in HEADER + body (lines count from the body)."""
    offset = HEADER.count("\n")
    return [
        f"{d.location.row - offset}: {d.message}"
        for d in lint(HEADER + src(body), [code])
        if d.code == code
    ]


# -- the wrapper facts --------------------------------------------------------------------


def facts_of(text: str):
    module = cst.parse_module(src(text))
    return collect(module), module


def place_of(facts, module: cst.Module, predicate) -> Place:
    """The place of the first call whose code satisfies `predicate`."""
    places: list[Place] = []
    ancestors: list[cst.CSTNode] = []
    seq = 0

    def enter(node):
        nonlocal seq
        ancestors.append(node)
        seq += 1
        if isinstance(node, cst.Call) and predicate(module.code_for_node(node)) and not places:
            # Sequence numbers of `collect` count the same pre-order walk.
            places.append(Place(tuple(ancestors), _seq_of(facts, node, seq)))

    walk(module, enter, lambda node: ancestors.pop())
    return places[0]


def _seq_of(facts, node, fallback):
    for wrap in facts.wraps:
        if wrap.call is node:
            return wrap.place.seq
    return fallback


WRAPPED_IN_EVERY_SCOPE = """
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def setup(net):
        model = DDP(net)
        return model

    class Trainer:
        def __init__(self, net):
            self.model = DDP(net).to(0)

    def maybe(net, flag):
        ddp = DDP(net) if flag else net
        return ddp

    def evaluate():
        model = nn.Linear(2, 2)
        return model

    first, second = DDP(nn.Linear(2, 2)), nn.Linear(2, 2)
    """


def test_wrapped_names_are_read_by_name_in_every_scope():
    facts, _ = facts_of(WRAPPED_IN_EVERY_SCOPE)
    assert facts.wrapped_names() == {"model", "self.model", "ddp", "first"}
    # `model` is also a plain Linear in `evaluate`; `ddp` only maybe a wrapper.
    assert [facts.always_wrapped(n) for n in ("self.model", "first", "model", "ddp")] == [
        True,
        True,
        False,
        False,
    ]
    assert not facts.always_wrapped("second") and not facts.always_wrapped("unknown")


def test_a_file_without_a_wrap_has_no_wrapped_names():
    facts, _ = facts_of("from torch import nn\nmodel = nn.Linear(2, 2)\n")
    assert facts.wrapped_names() == set()


def test_the_engine_feeds_one_wrapper_facts_whichever_rules_run():
    """Every rule reads `context.wrappers`, fed by the engine's walk: the same facts as a
    walk of their own, with no wrapping rule enabled (DDP040 alone)."""
    from ddpify import engine
    from ddpify.rules import select_rules

    module = cst.parse_module(src(WRAPPED_IN_EVERY_SCOPE))
    seen = {}

    class Probe(select_rules(["DDP040"])[0]):
        def leave_Module(self, node):
            seen["facts"] = self.context.wrappers
            super().leave_Module(node)

    engine.run_rules(module, [Probe])
    fed, own = seen["facts"], collect(module)
    assert fed.wrapped_names() == own.wrapped_names()
    assert [(w.call, w.target, w.inner) for w in fed.wraps] == [
        (w.call, w.target, w.inner) for w in own.wraps
    ]


def test_wraps_know_their_target_and_inner_module():
    facts, _ = facts_of(
        """
        import torch.nn.parallel as par
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model.to(dev), device_ids=[0])
        ddp = par.DistributedDataParallel(module=net.cuda().half())
        self.model = DDP(Net().cuda()).to(dev)
        maybe = DDP(m) if distributed else m
        DDP(x)
        """
    )
    assert [(w.target, w.inner) for w in facts.wraps] == [
        ("model", "model"),
        ("ddp", "net"),
        ("self.model", None),
        ("maybe", "m"),
        (None, "x"),
    ]


def test_wrap_held_follows_scopes_and_rebinding():
    text = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        def train(model):
            model = DDP(model)
            model.step_a()
            model = model.module
            model.step_b()
        def other(model):
            model.step_c()
        """
    facts, module = facts_of(text)
    wrap = facts.wraps[0]
    for call, expected in (("step_a", wrap), ("step_b", None), ("step_c", None)):
        place = place_of(facts, module, lambda code, c=call: code.endswith(f"{c}()"))
        receiver = place.node.func.value
        assert facts.wrap_held(receiver, place) is expected, call


def test_self_attribute_wrapped_in_init_holds_in_other_methods():
    text = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        class Trainer:
            def __init__(self, net):
                self.model = DDP(net)
            def step(self):
                self.model.in_step()
        class Lazy:
            def wrap(self, net):
                self.model = DDP(net)
            def step(self):
                self.model.in_lazy()
        """
    facts, module = facts_of(text)
    in_step = place_of(facts, module, lambda code: code.endswith("in_step()"))
    in_lazy = place_of(facts, module, lambda code: code.endswith("in_lazy()"))
    assert facts.wrap_held(in_step.node.func.value, in_step) is facts.wraps[0]
    # `wrap` may run before or after `step`: unknown, so no answer.
    assert facts.wrap_held(in_lazy.node.func.value, in_lazy) is None


def test_may_follow_and_held_on_every_path():
    text = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        def main(args, model):
            if args.distributed:
                model = DDP(model)
                model.inside()
            else:
                model.other_branch()
            model.after()
        """
    facts, module = facts_of(text)
    wrap = facts.wraps[0]
    inside, other, after = (
        place_of(facts, module, lambda code, c=c: code.endswith(f"{c}()"))
        for c in ("inside", "other_branch", "after")
    )
    assert may_follow(wrap.place, inside) and may_follow(wrap.place, after)
    assert not may_follow(wrap.place, other)
    assert facts.held_on_every_path(inside.node.func.value, inside)
    assert not facts.held_on_every_path(after.node.func.value, after)


# -- DDP031 modify-after-wrap ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("m = nn.Linear(2, 2)\nm = DDP(m)\nm.half()\n", "`m.half()` changes the parameters' dtype"),
        ("d = DDP(net)\nnet.bfloat16()\n", "`net.bfloat16()` changes the parameters' dtype"),
        (
            "m = DDP(m)\nfor n, p in m.module.named_parameters():\n    p.requires_grad = False\n",
            "`p.requires_grad = False` changes which parameters need gradients",
        ),
        ("m = DDP(m)\nm.module.head = nn.Linear(2, 2)\n", "`m.module.head = nn.Linear(2, 2)`"),
        ("m = nn.Linear(2, 2)\nm = DDP(m)\nm = m.cuda()\n", "`m.cuda()` moves the parameters"),
    ],
)
def test_modify_after_wrap_reports(body, expected):
    (finding,) = found(body, "DDP031")
    assert expected in finding


@pytest.mark.parametrize(
    "body",
    [
        "m.half()\nm = DDP(m)\n",  # before the wrap
        "m = nn.Linear(2, 2).cuda()\nm = DDP(m, device_ids=[0])\nm.to(0)\n",  # no-op move
        "m = DDP(m.cuda())\nm.cuda()\n",  # moved on the way in
        "m = DDP(m)\nm.train()\nm.eval()\nm.zero_grad()\n",
        "m = DDP(m)\nteacher.half()\nx = x.half()\n",  # something else
        "if ddp:\n    m = DDP(m)\nelse:\n    m.half()\n",  # the other branch
        "d = DDP(net)\nnet = nn.Linear(2, 2)\nnet.half()\n",  # a new model under the name
    ],
)
def test_modify_after_wrap_quiet(body):
    assert found(body, "DDP031") == []


def test_modify_after_wrap_needs_the_same_function():
    body = "def a(m):\n    m = DDP(m)\n    return m\ndef b(m):\n    m.half()\n"
    assert found(body, "DDP031") == []


# -- DDP032 wrapper-attribute-access ------------------------------------------------------


def test_wrapper_attribute_access_is_an_error():
    (d,) = [d for d in lint(HEADER + "m = DDP(net)\nm.generate(x)\n", ["DDP032"])]
    assert d.severity is Severity.ERROR
    assert d.message == (
        "`m.generate` is not an attribute of the DDP wrapper and raises AttributeError; "
        "use `m.module.generate`"
    )


@pytest.mark.parametrize(
    "body",
    [
        "m = DDP(net)\nm.module.generate(x)\nm.parameters()\nm.no_sync()\nm.join()\n",
        "m = DDP(net)\nm.state_dict()\nm.load_state_dict(s)\nm.device_ids\nm.training\n",
        "m = DDP(net)\nm._private\n",
        "m = DDP(net)\nm.tag = 1\nprint(m.tag)\n",
        "m = DDP(net)\nif hasattr(m, 'module'):\n    pass\nelse:\n    m.generate(x)\n",
        "m = DDP(net)\ntry:\n    m.generate(x)\nexcept AttributeError:\n    pass\n",
        "net.generate(x)\nm = DDP(net)\n",
        "m = nn.DataParallel(net)\nm.generate(x)\n",
    ],
)
def test_wrapper_attribute_access_quiet(body):
    assert found(body, "DDP032") == []


@pytest.mark.parametrize(
    "body",
    [
        "m = DDP(net) if dist.is_initialized() else net\nm.generate(x)\n",
        "if use_cuda and torch.cuda.device_count() > 1:\n    m = DDP(net)\nm.generate(x)\n",
    ],
)
def test_conditional_wrap_is_reported_without_a_fix(body):
    """On the distributed path the access raises; `.module` would break the other path."""
    (d,) = lint(HEADER + body, ["DDP032"])
    assert d.fix is None


@pytest.mark.parametrize(
    "body",
    [
        "if args.ddp:\n    m = DDP(net)\nif not args.ddp:\n    m.generate(x)\n",
        "if ddp:\n    m = DDP(net)\nif world_size == 1:\n    m.generate(x)\n",
        "if ddp:\n    m = DDP(net)\nelse:\n    m.generate(x)\n",
    ],
)
def test_conditional_wrap_quiet_where_the_access_may_be_on_the_other_path(body):
    assert found(body, "DDP032") == []


def test_wrapper_attribute_access_silent_without_distribution():
    text = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
    # DDP itself makes a script distributed; a framework import makes it someone else's.
    assert codes(text + "m = DDP(net)\nm.generate(x)\n", ["DDP032"]) == ["DDP032"]
    framework = text + "import accelerate\nm = DDP(net)\nm.generate(x)\n"
    assert codes(framework, ["DDP032"]) == []


# -- DDP033 bypass-wrapper-forward -------------------------------------------------------


LOOP = "m = DDP(net)\nfor x in data:\n    loss = {call}\n    loss.backward()\n"


@pytest.mark.parametrize("call", ["m.module(x)", "m.module.forward(x)", "net(x)", "net.forward(x)"])
def test_bypass_reports_each_spelling(call):
    body = (
        LOOP.format(call=call)
        if not call.startswith("net")
        else LOOP.replace("m = ", "d = ").format(call=call)
    )
    (finding,) = found(body, "DDP033")
    assert f"`{call.split('(')[0]}(...)`" in finding


@pytest.mark.parametrize(
    "body",
    [
        LOOP.format(call="m(x)"),
        # DDP's gradient sync lives in DistributedDataParallel.forward: no bypass.
        LOOP.format(call="m.forward(x)"),
        "m = DDP(net)\nfor x in data:\n    with torch.no_grad():\n        y = m.module(x)\n"
        "    loss.backward()\n",
        "m = DDP(net)\nfor x in data:\n    if dist.get_rank() == 0:\n        y = m.module(x)\n"
        "    loss.backward()\n",
        "m = DDP(net)\ny = m.module(x0)\nfor x in data:\n    m(x).sum().backward()\n",
        "m = DDP(net)\nfor x in data:\n    y = m.module(x)\n",  # no backward at all
        "def validate(m, data):\n    for x in data:\n        m.module(x).sum().backward()\n",
        "m = DDP(net)\n@torch.no_grad()\ndef ema(e):\n    for x in d:\n        m.module(x)\n"
        "        x.backward()\n",
        "net(x).sum().backward()\nd = DDP(net)\n",  # the raw model before its wrap
    ],
)
def test_bypass_quiet(body):
    assert found(body, "DDP033") == []


# -- DDP034 unused-parameters -------------------------------------------------------------

MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.drop = nn.Dropout(0.1)
        self.scale = 2.0

    def forward(self, x):
        return self.a(x) * self.scale
"""


def test_unused_layer_reported_at_the_wrap_as_info():
    (d,) = lint(HEADER + src(MODEL) + "model = Net()\nmodel = DDP(model)\n", ["DDP034"])
    assert d.severity is Severity.INFO
    assert d.message.startswith("`Net.b` is built in `__init__` but never used by the model")


@pytest.mark.parametrize(
    "tail",
    [
        "model = DDP(Net(), find_unused_parameters=True)\n",
        "model = DDP(Net(), find_unused_parameters=args.unused)\n",
        "model = DDP(build())\n",
        "model = Net()\n",
    ],
)
def test_unused_layer_quiet(tail):
    assert found(src(MODEL) + tail, "DDP034") == []


def test_layer_used_in_another_method_counts_as_used():
    model = src(MODEL) + "\n    def aux_loss(self, x):\n        return self.b(x).sum()\n"
    assert found(model + "model = DDP(Net())\n", "DDP034") == []


# -- DDP035 compile-order -----------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "m = DDP(m)\nm = torch.compile(m)\n",
        "m = torch.compile(DDP(m), mode='max-autotune')\n",
        "m = DDP(m)\nm.compile()\n",
    ],
)
def test_compile_of_the_wrapper_is_info(body):
    (d,) = lint(HEADER + body, ["DDP035"])
    assert d.severity is Severity.INFO


@pytest.mark.parametrize(
    "body",
    [
        "m = torch.compile(m)\nm = DDP(m)\n",
        "m.compile()\nm = DDP(m)\n",
        "m = DDP(m)\nf = torch.compile(m.module)\n",
        "m = DDP(m)\nf = torch.compile(loss_fn)\n",
    ],
)
def test_compile_order_quiet(body):
    assert found(body, "DDP035") == []


def _engine_wrappers(source: str):
    """The wrapper facts the engine's walk feeds, seen at the end of the walk."""
    from ddpify import engine
    from ddpify.rules import select_rules

    module = cst.parse_module(src(source))
    seen = {}

    class Probe(select_rules(["DDP051"])[0]):
        def leave_Module(self, node):
            seen["facts"] = self.context.wrappers
            super().leave_Module(node)

    engine.run_rules(module, [Probe])
    return module, seen["facts"]


def _place_of(facts, module, node):
    """The place `node` has in the facts' numbering (calls and assignments, pre-order)."""
    ancestors, found = [], []

    def enter(visited):
        ancestors.append(visited)
        if visited is node:
            found.append(tuple(ancestors))

    walk(module, enter, lambda visited: ancestors.pop())
    fed = [n for n in subtree(module) if type(n) in FED_TYPES]
    return Place(found[0], fed.index(node) + 1)


def _saves(module: cst.Module) -> list[cst.Call]:
    return [c for c in subtree(module) if type(c) is cst.Call and dotted(c.func) == "torch.save"]


def test_wrapper_binding_counts_a_helper_returning_the_wrapper():
    module, facts = _engine_wrappers("""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    def wrap(m):
        return DDP(m)

    model = torch.nn.Linear(2, 2)
    torch.save(model, "before.pt")
    model = wrap(model)
    torch.save(model, "after.pt")
    """)
    before, after = [
        c for c in subtree(module) if type(c) is cst.Call and dotted(c.func) == "torch.save"
    ]
    name = before.args[0].value
    assert facts.wrapper_names == {"model"}
    assert facts.wrapper_binding(name, _place_of(facts, module, before)) is None
    binding = facts.wrapper_binding(after.args[0].value, _place_of(facts, module, after))
    assert binding is not None and dotted(binding.value.func) == "wrap"


def test_wrapper_binding_reads_source_order_whatever_the_branch():
    """Unlike `binding_of`, an assignment in the other branch of an `if` still counts:
    the rank-0 rules read the latest assignment before a point in source order."""
    module, facts = _engine_wrappers("""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(distributed):
        model = torch.nn.Linear(2, 2)
        if distributed:
            model = DDP(model)
        else:
            torch.save(model, "m.pt")
    """)
    [save] = _saves(module)
    place = _place_of(facts, module, save)
    assert facts.wrapper_binding(save.args[0].value, place) is not None
    assert facts.binding_of("model", place).value.func.attr.value == "Linear"
