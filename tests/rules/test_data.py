"""The loader facts (ddpify.analysis.loaders), the data rules' shared helpers, and each
reason DDP020/DDP021/DDP022 stay quiet, each next to the finding it suppresses."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from ddpify.analysis.loaders import collect
from ddpify.diagnostics import Severity
from ddpify.rules.data._common import looks_like_eval
from tests.helpers import FIXTURES, codes, fixture_line, lint


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


# -- loader facts for DDP023-DDP026 ------------------------------------------------------------


def test_sampler_seed_drop_last_and_the_loader_they_feed():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader, DistributedSampler
        s = DistributedSampler(ds, 2, 0, False, 7, True)
        a = DataLoader(ds, sampler=s)
        b = DataLoader(ds, sampler=DistributedSampler(ds, seed=3))
        c = DataLoader(ds, sampler=other)
        """
    )
    named, inline = facts.samplers
    assert named.seed.value.value == "7" and named.drop_last.value.value == "True"
    assert inline.seed.value.value == "3" and inline.drop_last is None
    a, b, c = facts.loaders
    assert facts.distributed_sampler_of(a) is named
    assert facts.distributed_sampler_of(b) is inline
    assert facts.distributed_sampler_of(c) is None


STREAMS = """
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import IterableDataset

class Plain(IterableDataset):
    def __iter__(self):
        yield from range(10)

class Child(Plain):
    pass

class Ranked(IterableDataset):
    def __iter__(self):
        yield from range(dist.get_rank(), 10, dist.get_world_size())

class RankedChild(Ranked):
    pass

hf = load_dataset("c4", split="train", streaming=True)
mapped = hf.map(f)
eager = load_dataset("c4", split="train")
"""


@pytest.mark.parametrize(
    "dataset, hf_split, expected",
    [
        ("Plain()", False, "class"),
        ("Child()", False, "class"),
        ("Plain(rank=r, world_size=w)", False, None),
        ("Ranked()", False, None),
        ("RankedChild()", False, None),
        ("hf", False, "hf"),
        ("mapped", False, "hf"),
        ("mapped", True, None),
        ("eager", False, None),
        ("eager.to_iterable_dataset()", False, "hf"),
        ("Imported()", False, None),
    ],
)
def test_unsharded_stream(dataset, hf_split, expected):
    facts = facts_of(STREAMS)
    assert facts.unsharded_stream(cst.parse_expression(dataset), hf_split) == expected


def test_splits_streams_by_node():
    assert facts_of(
        "from datasets.distributed import split_dataset_by_node\n"
        "split_dataset_by_node(ds, rank=0, world_size=2)\n"
    ).splits_streams_by_node()
    assert facts_of("ds = ds.shard(num_shards=w, index=r)\n").splits_streams_by_node()
    assert not facts_of("ds = ds.map(f)\n").splits_streams_by_node()


# -- DDP023 ------------------------------------------------------------------------------------


def test_ddp023_is_an_error_and_names_the_cause():
    (finding,) = lint(
        DIST + "s = DistributedSampler(ds, seed=args.seed + dist.get_rank())\n", ["DDP023"]
    )
    assert finding.severity is Severity.ERROR
    assert "`seed=args.seed + dist.get_rank()` depends on the rank" in finding.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("s = DistributedSampler(ds, rank=dist.get_rank())\n", id="rank-is-not-seed"),
        pytest.param("s = DistributedSampler(ds, seed=args.seed)\n", id="shared"),
        pytest.param("torch.manual_seed(args.seed + dist.get_rank())\n", id="model-seed"),
        pytest.param("s = DistributedSampler(ds, **kw)\n", id="kwargs"),
    ],
)
def test_ddp023_quiet(body):
    assert codes(DIST + src(body), ["DDP023"]) == []


# -- DDP024 ------------------------------------------------------------------------------------

STREAM_CLASS = (
    "class Stream(torch.utils.data.IterableDataset):\n    def __iter__(self):\n        yield 1\n"
)


def test_ddp024_reports_a_training_loader_over_an_unsharded_stream():
    (finding,) = lint(DIST + STREAM_CLASS + "loader = DataLoader(Stream())\n", ["DDP024"])
    assert finding.severity is Severity.WARNING
    assert "itertools.islice" in finding.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("val_loader = DataLoader(Stream())\n", id="evaluation"),
        pytest.param(
            "if dist.get_rank() == 0:\n    loader = DataLoader(Stream())\n", id="rank-zero"
        ),
        pytest.param("loader = DataLoader(Stream(rank=dist.get_rank()))\n", id="given-rank"),
    ],
)
def test_ddp024_quiet(body):
    assert codes(DIST + STREAM_CLASS + src(body), ["DDP024"]) == []


def test_ddp024_needs_a_distributed_script():
    source = "import torch\nfrom torch.utils.data import DataLoader\n" + STREAM_CLASS
    assert codes(source + "loader = DataLoader(Stream())\n", ["DDP024"]) == []


def test_ddp020_and_ddp024_do_not_both_report_a_stream():
    source = DIST + STREAM_CLASS + "loader = DataLoader(Stream())\n"
    assert codes(source, ["DDP020", "DDP024"]) == ["DDP024"]


# -- DDP025 ------------------------------------------------------------------------------------

VAL = "val_ds = TensorDataset(x)\nval_sampler = DistributedSampler(val_ds, shuffle=False)\n"


def test_ddp025_padding_and_drop_last_messages():
    (padded,) = lint(DIST + VAL, ["DDP025"])
    assert "pads the data with repeated samples" in padded.message
    dropped = VAL.replace("shuffle=False", "shuffle=False, drop_last=True")
    (finding,) = lint(DIST + dropped, ["DDP025"])
    assert "drops the samples" in finding.message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("train_sampler = DistributedSampler(train_ds)\n", id="training"),
        pytest.param(VAL + "preds = gathered[: len(val_ds)]\n", id="trimmed"),
        pytest.param(VAL + "n = len(val_sampler) * world_size\n", id="remainder"),
    ],
)
def test_ddp025_quiet(body):
    assert codes(DIST + src(body), ["DDP025"]) == []


def test_ddp025_rank_zero_reading_a_sharded_loader_is_reported_once():
    body = VAL + (
        "val_loader = DataLoader(val_ds, sampler=val_sampler)\n"
        "if dist.get_rank() == 0:\n"
        "    for x in tqdm(val_loader):\n"
        "        pass\n"
        "    print(len(val_loader))\n"  # a builtin, not an evaluation
    )
    findings = lint(DIST + body, ["DDP025"])
    assert [d.location.row for d in findings] == [9]  # the `for`, not the `print`
    assert "read on rank 0 only" in findings[0].message


# -- DDP026 ------------------------------------------------------------------------------------


def test_ddp026_is_off_by_default_and_info_when_selected():
    source = DIST + (
        "loader = DataLoader(\n"
        "    ds, batch_size=cfg.total_batch_size, sampler=DistributedSampler(ds)\n"
        ")\n"
    )
    assert "DDP026" not in codes(source)
    (finding,) = lint(source, ["DDP026"])
    assert finding.severity is Severity.INFO


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            "loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds))\n",
            id="no-evidence",
        ),
        pytest.param(
            "loader = DataLoader(ds, batch_size=cfg.total_batch_size)\n", id="not-sharded"
        ),
        pytest.param(
            "bs = cfg.total_batch_size // dist.get_world_size()\n"
            "loader = DataLoader(\n"
            "    ds, batch_size=cfg.total_batch_size, sampler=DistributedSampler(ds)\n"
            ")\n",
            id="divided-somewhere",
        ),
    ],
)
def test_ddp026_quiet(body):
    assert codes(DIST + src(body), ["DDP026"]) == []


# -- DDP027 ------------------------------------------------------------------------------------

TV = (
    "import torch.distributed as dist\n"
    "from torchvision import datasets\n"
    "dist.init_process_group('nccl')\n"
)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            "if dist.get_rank() == 0:\n    datasets.MNIST('d', download=True)\ndist.barrier()\n"
            "ds = datasets.MNIST('d', download=True)\n",
            id="guard-then-barrier",
        ),
        pytest.param(
            "if local_rank != 0:\n    dist.barrier()\nds = datasets.MNIST('d', download=True)\n"
            "if local_rank == 0:\n    dist.barrier()\n",
            id="barrier-sandwich",
        ),
        pytest.param(
            "with torch_distributed_zero_first(local_rank):\n"
            "    ds = datasets.MNIST('d', download=True)\n",
            id="zero-first-context",
        ),
        pytest.param(
            "def prepare():\n    datasets.MNIST('d', download=True)\n"
            "if dist.get_rank() == 0:\n    prepare()\n",
            id="helper-called-on-rank-zero",
        ),
        pytest.param("ds = datasets.MNIST('d', download=args.download)\n", id="computed-flag"),
    ],
)
def test_ddp027_quiet_when_rank_zero_goes_first(body):
    assert codes(TV + src(body), ["DDP027"]) == []


def test_ddp027_helper_called_on_every_rank_is_reported():
    body = (
        "def prepare():\n"
        "    datasets.MNIST('d', download=True)\n"
        "prepare()\n"
        "if dist.get_rank() == 0:\n"
        "    prepare()\n"
    )
    (finding,) = lint(TV + body, ["DDP027"])
    assert finding.severity is Severity.WARNING and finding.location.row == 5


# -- the data rules share one feeding of the loader facts -------------------------------------

DATA_CODES = ["DDP020", "DDP021", "DDP022", "DDP023", "DDP024", "DDP025", "DDP026", "DDP027"]
DATA_CASES = sorted(
    case for code in DATA_CODES for case in (FIXTURES / "rules" / code).glob("*.py")
)


@pytest.mark.parametrize("case", DATA_CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_data_rules_together_find_what_each_finds_alone(case):
    """Only the first data rule of a file feeds the shared facts; the others must still see
    them, whichever subset is enabled."""
    text = case.read_text()
    alone = sorted(fixture_line(d) for code in DATA_CODES for d in lint(text, [code]))
    together = sorted(fixture_line(d) for d in lint(text, DATA_CODES))
    assert together == alone
