"""Projects, not files: fixtures/projects/<case>/before/ is a training project of our own
(an entry script `train.py` and the local modules it imports), after/ what `ddpify migrate
train.py` makes of it. `DDPIFY_UPDATE_FIXTURES=1` rewrites after/ (read the diff).

The converted projects also run as one process and under torchrun with the migrate cases
(tests/test_migrate_run.py) and are verified here against their originals.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpify.cli import main as ddpify_main
from ddpify.gates import GateError
from ddpify.migrate import pipeline
from ddpify.migrate.project import load_project, migrate_project
from tests.helpers import FIXTURES

PROJECTS = FIXTURES / "projects"
CASES = sorted(p.name for p in PROJECTS.iterdir() if (p / "before" / "train.py").is_file())
UPDATE = os.environ.get("DDPIFY_UPDATE_FIXTURES") == "1"


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _migrated(case: str, tmp_path: Path) -> tuple[Path, object]:
    work = tmp_path / case
    shutil.copytree(PROJECTS / case / "before", work)
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    return work, migration


@pytest.mark.parametrize("case", CASES)
def test_project_migrates_to_the_expected_files(case, tmp_path):
    work, migration = _migrated(case, tmp_path)
    assert migration.migrated, migration.entry.reason
    assert len(migration.project.modules) > 1
    expected = dict(_files(work))
    for result in migration.results:
        expected[result.filename] = result.output
    after = PROJECTS / case / "after"
    if UPDATE:
        shutil.rmtree(after, ignore_errors=True)
        for name, text in expected.items():
            (after / name).parent.mkdir(parents=True, exist_ok=True)
            (after / name).write_text(text, encoding="utf-8")
    assert _files(after) == expected


@pytest.mark.parametrize("case", CASES)
def test_migrating_a_migrated_project_changes_nothing(case, tmp_path):
    work = tmp_path / case
    shutil.copytree(PROJECTS / case / "after", work)
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert migration.migrated
    assert not migration.changed, [r.filename for r in migration.changed_results]


def test_the_report_lists_the_changes_of_every_file(tmp_path, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "trainer_module" / "before", work)
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "train.py: project of 2 local modules; 2 files to change" in out
    assert "trainer.py: imported by train.py" in out
    assert "self.model.state_dict -> self.model.module.state_dict" in out
    assert (work / "trainer.py").read_text() == (
        PROJECTS / "trainer_module" / "after" / "trainer.py"
    ).read_text()


def test_diff_shows_every_changed_file_and_writes_nothing(tmp_path, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "data_module" / "before", work)
    before = _files(work)
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py", "--diff"]) == 0
    out = capsys.readouterr().out
    assert "+++ b/train.py" in out and "+++ b/data.py" in out
    assert _files(work) == before


def test_a_directory_migrates_its_one_entry_script(tmp_path, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "package_relative" / "before", work)
    assert ddpify_main(["migrate", str(work), "--check"]) == 1
    assert "project of 5 local modules" in capsys.readouterr().out


def test_a_pass_failure_in_one_file_writes_no_file(tmp_path, monkeypatch, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "data_module" / "before", work)
    before = _files(work)
    real = pipeline.PASSES

    def broken_in_data_py(tree, plan):
        if "get_loaders" in tree.functions():
            raise RuntimeError("planted bug")
        return real[-1][1](tree, plan)

    monkeypatch.setattr(pipeline, "PASSES", [*real[:-1], ("imports", broken_in_data_py)])
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "data.py: RuntimeError: planted bug" in err and "nothing was written" in err
    assert _files(work) == before


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs file permissions")
def test_a_file_that_cannot_be_written_leaves_every_file_untouched(tmp_path, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "data_module" / "before", work)
    (work / "train.py").chmod(stat.S_IRUSR)  # written last? no: checked before any write
    before = _files(work)
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py"]) == 2
    assert "read-only" in capsys.readouterr().err
    assert _files(work) == before


def test_output_elsewhere_is_refused_for_a_project(tmp_path, capsys):
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "trainer_module" / "before", work)
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py", "-o", "out.py"]) == 2
    assert "-o/--output takes a single script" in capsys.readouterr().err
    assert not (work / "out.py").exists()


def test_a_gate_failure_names_the_file():
    texts = {"train.py": "import torch\n", "helper.py": "import torch\nx = (\n"}
    with pytest.raises(GateError) as caught:
        pipeline.migrate_sources(texts)
    assert caught.value.reason.startswith("helper.py: ")


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """case -> the verify result of its after/ against its before/, all in one batch
    (ddpify/verify/batch.py: one torchrun launch for the conversions)."""
    from ddpify.verify.batch import VerifyJob, run_verify_many

    jobs = []
    for case in CASES:
        work, migration = _migrated(case, tmp_path_factory.mktemp(case))
        summary = migration.summary()
        options = {
            "batch_policy": "global" if summary.hand_made else summary.batch_policy,
            "lr_scale": summary.lr_scale_for(2),
            "fixed_codes": sorted({c for r in migration.results for c in r.fixed_codes}),
            "cwd": work,
        }
        jobs.append(
            VerifyJob(
                PROJECTS / case / "before" / "train.py",
                PROJECTS / case / "after" / "train.py",
                options,
            )
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        return dict(zip(CASES, run_verify_many(jobs)))


@pytest.mark.torchrun
@pytest.mark.xdist_group("verify_projects")
@pytest.mark.parametrize("case", CASES)
def test_migrated_project_verifies(case, verified):
    pytest.importorskip("torch")
    result = verified[case]
    assert result.exit_code == 0, result.message


def test_the_readme_command_runs_a_project_end_to_end(tmp_path):
    """The literal command, in a subprocess, on a package with relative imports."""
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "package_relative" / "before", work)
    done = subprocess.run(
        [sys.executable, "-m", "ddpify", "migrate", "train.py"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (work / "minigpt" / "engine.py").read_text() == (
        PROJECTS / "package_relative" / "after" / "minigpt" / "engine.py"
    ).read_text()


def test_no_step_found_names_the_imports_chosen_at_run_time(tmp_path):
    """A model registry (`importlib.import_module("models." + name + "_model")`) hides
    the module that trains; the refusal says where the search stopped and what to do."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text(
        "import importlib\n\n\n"
        "def create_model(name):\n"
        '    lib = importlib.import_module("models." + name + "_model")\n'
        "    return lib.Model()\n",
        encoding="utf-8",
    )
    (tmp_path / "train.py").write_text(
        "import torch\nfrom models import create_model\n\n"
        "model = create_model('gan')\n"
        "for batch in torch.randn(4, 2):\n"
        "    model.optimize_parameters(batch)\n",
        encoding="utf-8",
    )
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert not migration.migrated
    reason = migration.entry.reason
    assert reason.startswith("no training step (`loss.backward()`)")
    assert '`lib = importlib.import_module("models." + name + "_model")` imports' in reason
    assert "import the module that trains explicitly" in reason


def test_a_model_trained_through_an_optimizer_factory_is_wrapped(tmp_path):
    """`get_optimizer(config, model.parameters())` in a helper module that builds
    `optim.Adam(parameters)`: `model` is what trains, so its DataParallel becomes DDP
    (left as it was, the ranks would train separate copies)."""
    (tmp_path / "functions.py").write_text(
        "import torch.optim as optim\n\n\n"
        "def get_optimizer(config, parameters):\n"
        "    return optim.Adam(parameters, lr=config['lr'])\n",
        encoding="utf-8",
    )
    (tmp_path / "runner.py").write_text(
        "import torch\nfrom functions import get_optimizer\n\n\n"
        "def train(config):\n"
        "    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))\n"
        "    loader = torch.utils.data.DataLoader(data, batch_size=4)\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "    model = torch.nn.DataParallel(model)\n"
        "    optimizer = get_optimizer(config, model.parameters())\n"
        "    for x, y in loader:\n"
        "        optimizer.zero_grad()\n"
        "        loss = ((model(x) - y) ** 2).mean()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n",
        encoding="utf-8",
    )
    (tmp_path / "train.py").write_text(
        "from runner import train\n\ntrain({'lr': 0.1})\n",
        encoding="utf-8",
    )
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    runner = next(r for r in migration.results if r.filename.endswith("runner.py"))
    assert "model = DDP(model" in runner.output
    assert "nn.DataParallel" not in runner.output


def _result(migration, suffix: str):
    return next(r for r in migration.results if r.filename.endswith(suffix))


def test_dataparallel_of_the_encoder_alone_becomes_ddp_of_the_whole_trained_model(tmp_path):
    """`if cuda: if device_count() > 1: model.encoder = DataParallel(model.encoder)` with an
    optimizer over all of `model` (the head too): DDP of the encoder alone would leave the
    head's gradients unaveraged, and only on GPUs. The whole model is wrapped, on every
    path, after its move; the saved state then holds the model's own keys."""
    _, migration = _migrated("encoder_dataparallel", tmp_path)
    train = _result(migration, "train.py").output
    set_model = train[train.index("def set_model") : train.index("def train(")]
    assert "torch.nn.DataParallel(" not in train and "model.encoder = DDP" not in train
    # outside the `if`: CPU runs are wrapped too, after the model is on its GPU
    assert set_model.index("model = model.cuda(LOCAL_RANK)") < set_model.index(
        "\n    model = DDP(model, device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None)"
    )
    assert "'model': model.module.state_dict()," in _result(migration, "util.py").output
    assert any("the optimizer trains all of `model`" in h.why for h in migration.entry.needs_human)


def test_a_wrapped_part_leaves_the_models_own_state_dict_alone(tmp_path):
    """`model.encoder = DDP(model.encoder)`: `model` is no wrapper, so a helper module's
    `model.state_dict()` must not become `model.module.state_dict()` (AttributeError)."""
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "encoder_dataparallel" / "after", work)
    train = (work / "train.py").read_text()
    whole = "    model = DDP(model, device_ids="
    assert whole in train
    (work / "train.py").write_text(
        train.replace(whole, "    model.encoder = DDP(model.encoder, device_ids=")
    )
    util = (work / "util.py").read_text().replace("model.module.state_dict()", "model.state_dict()")
    (work / "util.py").write_text(util)
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    assert "'model': model.state_dict()," in _result(migration, "util.py").output
    assert not _result(migration, "util.py").changed


def test_evaluation_loaders_a_loader_helper_builds_are_reported_where_they_are_kept(tmp_path):
    """`data_provider(args, flag)` builds the train, val and test loaders: the sampler added
    for training shards evaluation too, and the report names the lines that keep them."""
    _, migration = _migrated("loader_helper_splits", tmp_path)
    factory = _result(migration, "factory.py").output
    assert "sampler=DistributedSampler(data_set, shuffle=shuffle_flag)" in factory
    exp = _result(migration, "exp_forecast.py")
    lines = exp.output.splitlines()
    noted = {lines[h.line - 1].strip(): h.why for h in exp.needs_human if "comes from" in h.why}
    assert set(noted) == {
        "vali_data, vali_loader = self._get_data(flag='val')",
        "test_data, test_loader = self._get_data(flag='test')",
    }
    assert all("`data_provider`" in why and "DDP025" in why for why in noted.values())


def test_a_trained_part_under_conditions_is_wrapped_on_every_path(tmp_path):
    """The same script with an optimizer over `model.encoder` alone: the encoder is the DDP
    module, wrapped after the conditions (not left to GPUs with several devices), and
    `model` stays a plain module whose `state_dict()` the helper keeps as it is."""
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "encoder_dataparallel" / "before", work)
    util = (work / "util.py").read_text()
    (work / "util.py").write_text(util.replace("model.parameters()", "model.encoder.parameters()"))
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    train = _result(migration, "train.py").output
    set_model = train[train.index("def set_model") : train.index("def train(")]
    assert "torch.nn.DataParallel(" not in train
    assert set_model.index("model = model.cuda(LOCAL_RANK)") < set_model.index(
        "\n    model.encoder = DDP(model.encoder, device_ids="
    )
    assert "'model': model.state_dict()," in _result(migration, "util.py").output


def test_a_model_module_picked_by_an_option_default_is_followed_and_named(tmp_path, capsys):
    """`importlib.import_module("models." + name + "_model")` with `--model` defaulting
    to `denoise`: models/denoise_model.py is migrated, and the report says which module
    was followed, why, and which other candidates a different `--model` would run."""
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "model_registry" / "before", work)
    os.chdir(work)
    assert ddpify_main(["migrate", "train.py", "--diff"]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "models/denoise_model.py: imported by train.py" in out
    assert (
        "followed `modellib = importlib.import_module(model_filename)` (models/__init__.py:11) "
        "to models/denoise_model.py: `models.denoise_model`, from the default of `--model` "
        "('denoise'); a run that picks another module (models/base_model.py) runs code ddpify "
        "did not migrate"
    ) in out
    assert "no training step" not in out


_LAZY_HEAD = '''

class LazyHead(nn.Module):
    """A projection whose input width is read from the first batch."""

    def __init__(self, width):
        super().__init__()
        self.width = width
        self.built = False

    def build(self, x):
        self.proj = nn.Linear(x.shape[-1], self.width).to(x.device)
        self.built = True

    def forward(self, x):
        if not self.built:
            self.build(x)
        return self.proj(x)


def define_F(width, init_gain=0.02, gpu_ids=[]):
    return init_net(LazyHead(width), init_gain, gpu_ids)
'''


def _with_data_dependent_head(work: Path, head: str) -> None:
    """model_registry with a second net, `netF`, whose optimizer is made in
    `data_dependent_initialize` after a first forward (the CUT style)."""
    model = work / "models" / "denoise_model.py"
    text = model.read_text()
    text = text.replace(
        "        self.criterionL1 = torch.nn.L1Loss()\n",
        "        self.netF = networks.define_F(opt.width, gpu_ids=self.gpu_ids)\n"
        "        self.criterionL1 = torch.nn.L1Loss()\n",
    )
    text = text.replace(
        "    def set_input(self, input):",
        "    def data_dependent_initialize(self, data):\n"
        "        self.set_input(data)\n"
        "        self.forward()\n"
        "        self.netF(self.fake_B)\n"
        "        self.optimizer_F = torch.optim.Adam(self.netF.parameters(), lr=self.opt.lr)\n"
        "        self.optimizers.append(self.optimizer_F)\n\n"
        "    def set_input(self, input):",
    )
    model.write_text(text)
    networks = work / "models" / "networks.py"
    networks.write_text(networks.read_text() + head)
    train = work / "train.py"
    train.write_text(
        train.read_text().replace(
            "    model.setup(opt)\n",
            "    model.data_dependent_initialize(next(iter(dataset)))\n    model.setup(opt)\n",
        )
    )


def test_a_net_whose_layers_are_built_by_its_first_forward_is_refused_where_to_wrap(tmp_path):
    """DDP made where `netF` is built would miss the layers its first forward adds; here
    the DataParallel that `init_net` applies as it builds the net would become that DDP,
    so the refusal names the method, the optimizer line before which to wrap, and the
    wrap (without such a DataParallel, ddpify wraps it there itself:
    tests/test_migrate_project_lazy_head.py)."""
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "model_registry" / "before", work)
    _with_data_dependent_head(work, _LAZY_HEAD)
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert not migration.migrated
    reason = migration.entry.reason
    assert reason.startswith(
        "`self.netF` gets its optimizer in `data_dependent_initialize` after a forward "
        "(`self.forward()`)"
    )
    assert "the DataParallel that wraps it where it is built becomes DDP there" in reason
    assert (
        "just before `self.optimizer_F = torch.optim.Adam(self.netF.parameters(), "
        "lr=self.opt.lr)` (`self.netF = DDP(self.netF, device_ids=[LOCAL_RANK] if "
        "torch.cuda.is_available() else None)`)"
    ) in reason


def test_an_optimizer_made_after_a_forward_of_a_net_built_whole_still_migrates(tmp_path):
    """The same order of calls, but every layer of the head is made in its __init__:
    nothing is built late, so the project migrates (DDP where the net is built)."""
    eager = _LAZY_HEAD.replace(
        "        self.built = False\n", "        self.proj = nn.Linear(16, width)\n"
    ).replace("        if not self.built:\n            self.build(x)\n", "")
    eager = eager.replace(
        "    def build(self, x):\n"
        "        self.proj = nn.Linear(x.shape[-1], self.width).to(x.device)\n"
        "        self.built = True\n\n",
        "",
    )
    work = tmp_path / "p"
    shutil.copytree(PROJECTS / "model_registry" / "before", work)
    _with_data_dependent_head(work, eager)
    migration = migrate_project(load_project(work / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason


def test_a_loop_over_a_class_that_hands_out_its_dataloaders_batches_shards_that_loader(
    tmp_path,
):
    """`dataset = create_dataset(opt)` returning an object whose `__iter__` yields the
    batches of the DataLoader it holds: that DataLoader is sharded where the class builds
    it, and the epoch loop reshuffles its sampler through the object."""
    (tmp_path / "data.py").write_text(
        "import torch\n\n\n"
        "class LoaderWrapper:\n"
        "    def __init__(self, n):\n"
        "        ds = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randn(n, 1))\n"
        "        self.dataloader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)\n\n"
        "    def __iter__(self):\n"
        "        for i, data in enumerate(self.dataloader):\n"
        "            yield data\n\n\n"
        "def create_dataset(n):\n"
        "    return LoaderWrapper(n)\n",
        encoding="utf-8",
    )
    (tmp_path / "train.py").write_text(
        "import torch\nfrom data import create_dataset\n\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "dataset = create_dataset(32)\n"
        "for epoch in range(2):\n"
        "    for x, y in dataset:\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        opt.zero_grad()\n"
        "        loss.backward()\n"
        "        opt.step()\n",
        encoding="utf-8",
    )
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    outputs = {r.filename: r.output for r in migration.results}
    assert (
        "self.dataloader = torch.utils.data.DataLoader(ds, batch_size=4, "
        "sampler=DistributedSampler(ds, shuffle=True))"
    ) in outputs["data.py"]
    assert "    dataset.dataloader.sampler.set_epoch(epoch)\n" in outputs["train.py"]


def test_the_first_of_a_list_is_this_process_gpu_only_when_the_list_holds_gpu_ids(tmp_path):
    """`net.to(gpu_ids[0])` with `DataParallel(net, gpu_ids)`: every rank would sit on the
    first GPU, so it becomes LOCAL_RANK; `x.to(devices[0])` of a list never handed to
    DataParallel may name the CPU and stays, as does the first device of a DataParallel
    that no optimizer trains (it stays DataParallel)."""
    (tmp_path / "nets.py").write_text(
        "import torch\n\n\n"
        "def init_net(net, gpu_ids=[]):\n"
        "    if len(gpu_ids) > 0:\n"
        "        net.to(gpu_ids[0])\n"
        "        net = torch.nn.DataParallel(net, gpu_ids)\n"
        "    return net\n\n\n"
        "def feature_net(device_ids):\n"
        "    # an evaluation network: its DataParallel stays, on its first device\n"
        "    net = torch.nn.Linear(4, 4).to(device_ids[0])\n"
        "    return torch.nn.DataParallel(net, device_ids=device_ids)\n",
        encoding="utf-8",
    )
    (tmp_path / "train.py").write_text(
        "import torch\nfrom nets import init_net\n\n"
        "devices = ['cpu']\n"
        "gpu_ids = [0] if torch.cuda.is_available() else []\n"
        "model = init_net(torch.nn.Linear(4, 1), gpu_ids)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)\n"
        "for epoch in range(2):\n"
        "    for x, y in loader:\n"
        "        x, y = x.to(devices[0]), y.to(devices[0])\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        opt.zero_grad()\n"
        "        loss.backward()\n"
        "        opt.step()\n",
        encoding="utf-8",
    )
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    outputs = {result.filename: result.output for result in migration.results}
    assert "net.to(LOCAL_RANK)" in outputs["nets.py"]
    assert "net = torch.nn.DataParallel(net, gpu_ids)" not in outputs["nets.py"]
    assert "x.to(devices[0]), y.to(devices[0])" in outputs["train.py"]
    assert "torch.nn.Linear(4, 4).to(device_ids[0])" in outputs["nets.py"]


def test_an_imported_modules_demo_block_is_left_as_written(tmp_path):
    """model.py ends in an `if __name__ == "__main__":` demo that prints the network and
    tries it under DataParallel: importing model.py never runs it, so the project is a
    single-GPU one (not refused as a DataParallel wrap under a condition) and the demo's
    prints get no rank guard."""
    work, migration = _migrated("model_demo_block", tmp_path)
    assert migration.migrated, migration.entry.reason
    assert migration.summary().shape == "single-GPU"
    changed = {result.filename for result in migration.changed_results}
    assert changed == {"train.py"}
    assert 'if RANK == 0:\n            print(f"epoch' in migration.results[0].output


def test_a_module_with_nothing_to_change_still_shows_what_a_human_must_do(tmp_path):
    """The report lists an imported module that keeps its code but holds a needs-human
    item (before, only changed modules were listed, and the item was lost)."""
    import io

    from ddpify.migrate.report import HumanItem

    _, migration = _migrated("model_demo_block", tmp_path)
    helper = migration.results[1]
    assert helper.filename == "model.py" and not helper.changed
    out = io.StringIO()
    migration.render(out)
    assert "model.py: imported by" not in out.getvalue()
    helper.needs_human.append(HumanItem("planted: something to do by hand", None))
    out = io.StringIO()
    migration.render(out)
    text = out.getvalue()
    assert "model.py: imported by train.py (unchanged)" in text
    assert "planted: something to do by hand" in text
    assert "1 file to change" in text


_TRAIN_WITH_EVALUATE = (
    "import torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n\n"
    "from evaluation import evaluate\n\n"
    "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
    "loader = DataLoader(data, batch_size=8, shuffle=True)\n"
    "model = torch.nn.Linear(4, 1)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "for epoch in range(2):\n"
    "    for x, y in loader:\n"
    "        optimizer.zero_grad()\n"
    "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
    "        optimizer.step()\n"
    "    print(epoch, evaluate(model, data))\n"
)
_EVALUATE = (
    "import torch\n"
    "from torch.utils.data import DataLoader\n\n\n"
    "def evaluate(model, dataset):\n"
    "    loader = DataLoader(dataset, batch_size=64)\n"
    "    total = 0.0\n"
    "    with torch.no_grad():\n"
    "        for x, y in loader:\n"
    "            total += torch.nn.functional.mse_loss(model(x), y, reduction='sum').item()\n"
    "    return total / len(dataset)\n"
)


def _project(tmp_path: Path, helper: str) -> object:
    (tmp_path / "train.py").write_text(_TRAIN_WITH_EVALUATE, encoding="utf-8")
    (tmp_path / "evaluation.py").write_text(helper, encoding="utf-8")
    return migrate_project(load_project(tmp_path / "train.py"), "train.py")


def test_a_helpers_local_loader_is_not_the_training_loader_by_its_name(tmp_path):
    """`evaluate(model, dataset)` in another module builds its own local `loader`, the
    same name the script's training loop iterates: it evaluates, so it stays whole (before,
    it was sharded as "the training loader" and rank 0 scored its own shard only)."""
    migration = _project(tmp_path, _EVALUATE)
    assert migration.migrated, migration.entry.reason
    outputs = {result.filename: result for result in migration.results}
    assert not outputs["evaluation.py"].changed
    assert "sampler=DistributedSampler(data, shuffle=True)" in outputs["train.py"].output


def test_a_helpers_local_loader_handed_to_a_training_function_is_sharded(tmp_path):
    """Noop of the above: a helper that builds a local `loader` and hands it to the
    function that trains (`train_epoch(model, optimizer, loader)`) builds the training
    loader, so it is sharded where it is built."""
    (tmp_path / "train.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n\n"
        "from engine import fit\n\n"
        "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
        "model = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "fit(model, optimizer, data, epochs=2)\n",
        encoding="utf-8",
    )
    (tmp_path / "engine.py").write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader\n\n\n"
        "def train_epoch(model, optimizer, loader):\n"
        "    for x, y in loader:\n"
        "        optimizer.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "        optimizer.step()\n\n\n"
        "def fit(model, optimizer, dataset, epochs):\n"
        "    loader = DataLoader(dataset, batch_size=8, shuffle=True)\n"
        "    for epoch in range(epochs):\n"
        "        train_epoch(model, optimizer, loader)\n",
        encoding="utf-8",
    )
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    outputs = {result.filename: result.output for result in migration.results}
    assert "sampler=DistributedSampler(dataset, shuffle=True)" in outputs["engine.py"]


_MODEL_WITH_UNCALLED_TEST = (
    "import torch\n"
    "import torch.nn as nn\n\n\n"
    "class Net(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc = nn.Linear(4, 1)\n\n"
    "    def forward(self, x):\n"
    "        return self.fc(x)\n\n\n"
    "def test():\n"
    "    net = Net()\n"
    "    y = net(torch.randn(2, 4))\n"
    "    print(y.size())\n\n"
    "# test()\n"
)
_TRAIN_WITH_NET = (
    "import torch\n"
    "from torch.utils.data import DataLoader, TensorDataset\n\n"
    "from models import *\n\n\n"
    "def test(epoch):\n"
    "    print('testing', epoch)\n\n\n"
    "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
    "loader = DataLoader(data, batch_size=8, shuffle=True)\n"
    "net = Net()\n"
    "optimizer = torch.optim.SGD(net.parameters(), lr=0.1)\n"
    "for epoch in range(2):\n"
    "    for x, y in loader:\n"
    "        optimizer.zero_grad()\n"
    "        torch.nn.functional.mse_loss(net(x), y).backward()\n"
    "        optimizer.step()\n"
    "    test(epoch)\n"
)


def _model_project(tmp_path: Path, train: str) -> dict[str, object]:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("from .net import *\n", encoding="utf-8")
    (tmp_path / "models" / "net.py").write_text(_MODEL_WITH_UNCALLED_TEST, encoding="utf-8")
    (tmp_path / "train.py").write_text(train, encoding="utf-8")
    migration = migrate_project(load_project(tmp_path / "train.py"), "train.py")
    assert migration.migrated, migration.entry.reason
    return {result.filename: result for result in migration.results}


def test_a_model_files_uncalled_test_function_is_left_as_written(tmp_path):
    """`def test(): ... print(y.size())` at the end of a model file, its call commented
    out, never runs: its print gets no rank guard, so the model file stays as written
    (the script's own `test(epoch)` shadows the star-imported one)."""
    outputs = _model_project(tmp_path, _TRAIN_WITH_NET)
    assert not outputs[str(Path("models") / "net.py")].changed
    assert "if RANK == 0:\n        print('testing', epoch)" in outputs["train.py"].output


def test_a_model_files_test_function_the_script_calls_is_guarded(tmp_path):
    """Noop of the above: the script calls the model file's `test()` (star-imported, no
    function of its own by that name), so its print runs and gets the rank guard."""
    train = _TRAIN_WITH_NET.replace(
        "def test(epoch):\n    print('testing', epoch)\n\n\n", ""
    ).replace("    test(epoch)\n", "    test()\n")
    outputs = _model_project(tmp_path, train)
    net = outputs[str(Path("models") / "net.py")]
    assert net.changed and "if RANK == 0:\n        print(y.size())" in net.output


def test_a_function_a_computed_name_may_reach_counts_as_run(tmp_path):
    """`getattr(models, name)()` may reach any function of the model file: its print is
    guarded as before."""
    train = _TRAIN_WITH_NET.replace(
        "    test(epoch)\n", "    getattr(__import__('models'), 'te' + 'st')()\n"
    )
    outputs = _model_project(tmp_path, train)
    assert outputs[str(Path("models") / "net.py")].changed


def test_loaders_drawn_together_are_each_sharded_and_a_datasets_own_download_left_alone(
    tmp_path,
):
    """`zip(source_loader, target_loader)` trains on both: each gets its DistributedSampler
    and its set_epoch (the second was taken for an unsharded evaluation loader). The
    target dataset builds itself from the source one in its own `download()`: the entry
    builds each dataset on rank 0 first, so rank 0 runs that method alone and the others
    run it with the files there: a barrier in it would pair with the entry's wait (its
    prints and writes may still be kept to rank 0)."""
    work, migration = _migrated("paired_domains", tmp_path)
    train = next(r for r in migration.results if r.filename.endswith("train.py"))
    for loader in ("source", "target"):
        assert f"sampler=DistributedSampler({loader}_dataset, shuffle=True)" in train.output
        assert f"    {loader}_loader.sampler.set_epoch(epoch)\n" in train.output
    assert not any("not sharded" in h.why or "DDP020" in h.why for h in train.needs_human)
    helper = next(r for r in migration.results if r.filename.endswith("digits.py"))
    assert "barrier" not in helper.output
    assert not helper.needs_human
