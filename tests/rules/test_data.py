"""The loader facts (ddpify.analysis.loaders), the data rules' shared helpers, and each
reason DDP020/DDP021/DDP022 stay quiet, each next to the finding it suppresses."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.loaders import collect
from ddpify.diagnostics import Severity
from ddpify.rules.data._common import looks_like_eval
from tests.helpers import codes, lint


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def facts_of(text: str):
    return collect(cst.parse_module(src(text)))


# -- loader facts ---------------------------------------------------------------------------


def test_loader_arguments_by_keyword_and_position():
    facts = facts_of(
        """
        import torch.utils.data as tud
        a = tud.DataLoader(ds, 8, True, s)
        self.b = tud.DataLoader(dataset=ds2, batch_size=4, sampler=None, **kw)
        """
    )
    a, b = facts.loaders
    assert (a.target, b.target) == ("a", "self.b")
    assert cst.Module([]).code_for_node(a.arg("shuffle").value) == "True"
    assert a.arg("sampler").value.value == "s"
    assert a.arg("batch_sampler") is None
    assert b.dataset.value == "ds2"
    assert b.arg("batch_size").value.value == "4"
    assert (a.has_star_args, b.has_star_args) == (False, True)


def test_samplers_their_receivers_and_shuffle():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler as DS
        train_sampler = DS(train_ds)
        loader = DataLoader(ds, sampler=DS(ds, shuffle=False))
        maybe = DS(ds, shuffle=flag) if distributed else None
        DataLoader(ds, sampler=DS(ds))
        """
    )
    named, inline, conditional, anonymous = facts.samplers
    assert named.receiver == "train_sampler" and named.shuffles is True
    assert inline.loader is facts.loaders[0]
    assert inline.receiver == "loader.sampler" and inline.shuffles is False
    assert conditional.receiver == "maybe" and conditional.shuffles is None
    assert anonymous.receiver is None
    assert facts.sampler_names() == {"train_sampler", "loader.sampler", "maybe"}
    assert facts.loader_names() == {"loader"}


def test_where_function_class_and_guards():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader
        class T:
          def build(self, ds):
            if rank == 0:
              self.loader = DataLoader(ds)
        """
    )
    (loader,) = facts.loaders
    assert loader.where.function.name.value == "build"
    assert loader.where.class_def.name.value == "T"
    assert loader.where.rank_zero
    assert loader.where.parameter_names() == {"self", "ds"}


def test_epoch_loops_nesting_and_epoch_name():
    facts = facts_of(
        """
        def main():
            for epoch in range(args.epochs):
                for i in range(steps_per_epoch):
                    pass
            for _ in range(num_epochs):
                pass
            while epoch < max_epochs:
                pass
            for batch in loader:
                pass
        """
    )
    loops = facts.epoch_loops
    assert [loop.nested for loop in loops] == [False, True, False, False]
    assert [loop.epoch_name for loop in loops] == ["epoch", "i", None, None]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("for e in range(3):\n    sampler.set_epoch(e)\n", True),
        ("getattr(loader.sampler, 'set_epoch')(e)\n", True),
        ("utils.set_sampler_epoch(loader, e)\n", True),
        ("from helpers import set_loader_epoch\n", True),
        ("def set_epoch_all(loaders, e):\n    pass\n", True),
        ("sampler.reset()\nepoch_offset = 1\n", False),
    ],
)
def test_may_set_epoch(text, expected):
    assert facts_of(text).may_set_epoch() is expected


def test_set_epoch_receivers():
    facts = facts_of("loader.sampler.set_epoch(e)\nself.s.set_epoch(e)\nf().set_epoch(e)\n")
    assert facts.set_epoch_receivers() == ["loader.sampler", "self.s", None]


@pytest.mark.parametrize(
    ("text", "streaming"),
    [
        ("class S(torch.utils.data.IterableDataset): pass\nds = S()\n", True),
        ("class S(IterableDataset): pass\nclass T(S): pass\nds = T()\n", True),
        ("import webdataset as wds\nds = wds.WebDataset(urls).decode()\n", True),
        ("ds = load_dataset('c4', streaming=True)\n", True),
        ("ds = load_dataset('c4').to_iterable_dataset()\n", True),
        ("ds = load_dataset('c4', streaming=False)\n", False),
        ("ds = TensorDataset(x, y)\n", False),
    ],
)
def test_is_streaming(text, streaming):
    facts = facts_of("import torch\nfrom torch.utils.data import IterableDataset\n" + text)
    assert facts.is_streaming(cst.Name("ds")) is streaming


# -- shared helpers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("val_loader", True),
        ("testLoader", True),
        ("self.eval_dl", True),
        ("build_dev_loader", True),
        ("train_loader", False),
        ("interval_loader", False),
        ("latest", False),
    ],
)
def test_looks_like_eval(name, expected):
    assert looks_like_eval(name) is expected


# -- DDP020: what stays quiet, next to what does not ----------------------------------------

DIST = (
    "import torch\nimport torch.distributed as dist\n"
    "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n"
    "dist.init_process_group('gloo')\n"
)


def ddp020(body: str) -> list:
    return lint(DIST + src(body), ["DDP020"])


def test_ddp020_reports_a_plain_training_loader():
    (finding,) = ddp020("ds = TensorDataset(x)\nloader = DataLoader(ds, shuffle=True)\n")
    assert finding.severity is Severity.ERROR
    assert "`loader`" in finding.message and "`ds`" in finding.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("loader = DataLoader(ds, sampler=s)\n", id="sampler"),
        pytest.param("loader = DataLoader(ds, batch_sampler=b)\n", id="batch-sampler"),
        pytest.param("val_loader = DataLoader(ds)\n", id="eval-name"),
        pytest.param("ds = MNIST('d', train=False)\nloader = DataLoader(ds)\n", id="train-false"),
        pytest.param("if dist.get_rank() == 0:\n    loader = DataLoader(ds)\n", id="rank-zero"),
        pytest.param("if world_size == 1:\n    loader = DataLoader(ds)\n", id="single-branch"),
        pytest.param("ds = Shards(rank=rank)\nloader = DataLoader(ds)\n", id="sharded"),
        pytest.param("loader = DataLoader(ds, **kwargs)\n", id="kwargs"),
        pytest.param(
            "def make(ds, sampler):\n    return DataLoader(ds, shuffle=sampler is None)\n",
            id="helper-given-sampler",
        ),
        pytest.param(
            "a = DataLoader(ds, sampler=DistributedSampler(ds))\nb = DataLoader(ds)\n",
            id="sharded-twin",
        ),
    ],
)
def test_ddp020_quiet(body):
    assert ddp020(body) == []


def test_ddp020_dataset_parameter_is_info():
    (finding,) = ddp020("def make(dataset):\n    return DataLoader(dataset, batch_size=4)\n")
    assert finding.severity is Severity.INFO


def test_ddp020_needs_a_distributed_script():
    body = "from torch.utils.data import DataLoader\nloader = DataLoader(ds, shuffle=True)\n"
    assert codes(body, ["DDP020"]) == []
    wrapped = body + "from torch.nn.parallel import DistributedDataParallel\n"
    wrapped += "model = DistributedDataParallel(net)\n"
    assert codes(wrapped, ["DDP020"]) == ["DDP020"]


# -- DDP021 --------------------------------------------------------------------------------

HEAD21 = "from torch.utils.data import DataLoader, DistributedSampler\n"


def test_ddp021_severity_of_helper_parameters():
    body = (
        "def a(ds, sampler=None):\n    return DataLoader(ds, shuffle=True, sampler=sampler)\n"
        "def b(ds, sampler):\n    return DataLoader(ds, shuffle=True, sampler=sampler)\n"
    )
    assert [d.severity for d in lint(HEAD21 + body, ["DDP021"])] == [
        Severity.INFO,
        Severity.ERROR,
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("s = None\nDataLoader(ds, shuffle=True, sampler=s)\n", []),
        (
            "s = None\ns = DistributedSampler(ds)\nDataLoader(ds, shuffle=True, sampler=s)\n",
            ["DDP021"],
        ),
        ("DataLoader(ds, shuffle=1, sampler=DistributedSampler(ds))\n", ["DDP021"]),
        ("DataLoader(ds, shuffle=flag, sampler=DistributedSampler(ds))\n", []),
    ],
)
def test_ddp021_sampler_values(body, expected):
    assert codes(HEAD21 + body, ["DDP021"]) == expected


# -- DDP022 --------------------------------------------------------------------------------

HEAD22 = (
    "import torch\nfrom torch.utils.data import DataLoader, DistributedSampler\n"
    "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n"
)
LOOP = "for epoch in range(3):\n    {}\n"


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("pass", ["DDP022"]),
        ("sampler.set_epoch(epoch)", []),
        ("loader.sampler.set_epoch(epoch)", []),
        ("run_epoch(model, loader)", []),  # an undefined helper may set it
        ("engine.fit(loader, epoch)", []),
        ("print(len(loader))", ["DDP022"]),
        ("torch.save(model, 'x')", ["DDP022"]),
    ],
)
def test_ddp022_set_epoch_and_escapes(statement, expected):
    assert codes(HEAD22 + LOOP.format(statement), ["DDP022"]) == expected


def test_ddp022_helper_defined_in_file_that_does_not_set_it():
    body = "def run_epoch(loader):\n    for b in loader:\n        pass\n"
    assert codes(HEAD22 + body + LOOP.format("run_epoch(loader)"), ["DDP022"]) == ["DDP022"]


def test_ddp022_quiet_under_frameworks_and_without_epochs():
    assert codes(HEAD22 + "for step in range(100):\n    pass\n", ["DDP022"]) == []
    framework = "from accelerate import Accelerator\n" + HEAD22 + LOOP.format("pass")
    assert codes(framework, ["DDP022"]) == []
