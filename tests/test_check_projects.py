"""`ddpify check` with evidence in another module of the project: a helper that saves, a
helper that guards, a call site that guards; and the cache when that module changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpify.analysis.project import importers
from ddpify.api import check_paths
from ddpify.rules import select_rules

TRAIN = """\
import torch
import torch.distributed as dist

import utils
from utils import save_on_master

dist.init_process_group("gloo")
model = torch.nn.Linear(2, 2)
{body}
"""

UTILS = """\
import torch
import torch.distributed as dist


def is_main_process():
    return dist.get_rank() == 0


def save_checkpoint(state, path):
{save}


def save_on_master(state, path):
    if is_main_process():
        torch.save(state, path)
"""
UNGUARDED = "    torch.save(state, path)"
GUARDED = "    if is_main_process():\n        torch.save(state, path)"


def _project(tmp_path: Path, body: str, save: str = UNGUARDED) -> Path:
    (tmp_path / "utils.py").write_text(UTILS.format(save=save))
    train = tmp_path / "train.py"
    train.write_text(TRAIN.format(body=body))
    return train


def _findings(path: Path, cache_dir: Path | None = None) -> list[str]:
    report = check_paths([str(path)], select_rules(["DDP050"]), cache_dir=cache_dir)
    return [f"{d.location.row} {d.message}" for d in report.diagnostics]


def test_a_saving_helper_of_another_module_called_on_every_rank(tmp_path):
    train = _project(tmp_path, 'utils.save_checkpoint(model.state_dict(), "a.pt")')
    [finding] = _findings(train)
    assert finding.startswith("9 `utils.save_checkpoint()` (defined in utils.py) calls")


def test_a_helper_that_guards_itself_is_quiet(tmp_path):
    train = _project(tmp_path, 'save_on_master(model.state_dict(), "a.pt")')
    assert _findings(train) == []


def test_a_call_site_under_a_guard_helper_of_another_module_is_quiet(tmp_path):
    body = 'if utils.is_main_process():\n    utils.save_checkpoint(model.state_dict(), "a.pt")'
    assert _findings(_project(tmp_path, body)) == []


def test_a_helper_that_guards_inside_is_quiet(tmp_path):
    body = 'utils.save_checkpoint(model.state_dict(), "a.pt")'
    assert _findings(_project(tmp_path, body, save=GUARDED)) == []


def test_a_per_rank_path_in_the_helper_is_quiet(tmp_path):
    save = '    torch.save(state, f"{path}.rank{dist.get_rank()}")'
    body = 'utils.save_checkpoint(model.state_dict(), "a.pt")'
    assert _findings(_project(tmp_path, body, save=save)) == []


def test_a_per_rank_path_assigned_before_the_save_is_quiet(tmp_path):
    save = '    target = f"{path}.rank{dist.get_rank()}"\n    torch.save(state, target)'
    body = 'utils.save_checkpoint(model.state_dict(), "a.pt")'
    assert _findings(_project(tmp_path, body, save=save)) == []


def test_a_helper_that_saves_into_a_memory_buffer_is_quiet(tmp_path):
    # `torch.save` into io.BytesIO to hand an object to a loader that wants a file.
    save = "    buffer = io.BytesIO()\n    torch.save(state, buffer)\n    return buffer"
    (tmp_path / "utils.py").write_text("import io\n" + UTILS.format(save=save))
    train = tmp_path / "train.py"
    train.write_text(TRAIN.format(body='utils.save_checkpoint(model.state_dict(), "a.pt")'))
    assert _findings(train) == []


def test_a_path_reassigned_to_a_shared_file_is_reported(tmp_path):
    save = (
        '    target = f"{path}.rank{dist.get_rank()}"\n'
        "    target = path\n"
        "    torch.save(state, target)"
    )
    body = 'utils.save_checkpoint(model.state_dict(), "a.pt")'
    assert len(_findings(_project(tmp_path, body, save=save))) == 1


def test_the_helper_module_checked_alone_says_nothing(tmp_path):
    _project(tmp_path, 'utils.save_checkpoint(model.state_dict(), "a.pt")')
    assert _findings(tmp_path / "utils.py") == []


def test_the_cache_notices_a_change_in_the_helper_module(tmp_path):
    train = _project(tmp_path, 'utils.save_checkpoint(model.state_dict(), "a.pt")')
    cache = tmp_path / ".cache"
    assert len(_findings(train, cache)) == 1
    assert len(_findings(train, cache)) == 1  # served from the cache
    (tmp_path / "utils.py").write_text(UTILS.format(save=GUARDED))
    assert _findings(train, cache) == []  # train.py is unchanged, its helper is not


# -- DDP027: a dataset getter of another module downloads ---------------------------------

WORKER = """\
import os

import torch.distributed as dist
{imports}

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
{body}
"""

DATA = """\
from torchvision import datasets


def get_cifar10(root):
    return datasets.CIFAR10(root, train=True, download={download})


def get_mnist(root):
    return datasets.MNIST(root, train=True, download=False)


GETTERS = {{"cifar10": get_cifar10, "mnist": get_mnist}}


class CifarData:
    def __init__(self, root):
        self.root = root

    def train_set(self):
        return datasets.CIFAR10(self.root, train=True, download={download})
"""


def _download_findings(path: Path) -> list[str]:
    report = check_paths([str(path)], select_rules(["DDP027"]))
    return [f"{d.location.row} {d.message}" for d in report.diagnostics]


def _download_project(tmp_path: Path, imports: str, body: str, download: str = "True") -> Path:
    (tmp_path / "data.py").write_text(DATA.format(download=download))
    train = tmp_path / "train.py"
    train.write_text(WORKER.format(imports=imports, body=body))
    return train


def test_a_dataset_getter_of_another_module_called_on_every_rank(tmp_path):
    train = _download_project(tmp_path, "from data import get_cifar10", 'ds = get_cifar10("d")')
    [finding] = _download_findings(train)
    assert finding.startswith("8 `get_cifar10()` (defined in data.py), which downloads")


def test_a_table_of_getters_is_read_through(tmp_path):
    body = 'ds = data.GETTERS["cifar10"]("d")'
    [finding] = _download_findings(_download_project(tmp_path, "import data", body))
    assert finding.startswith("8 `data.GETTERS[...]` may call `get_cifar10` (defined in data.py)")


def test_a_dataset_class_of_a_package_imported_relatively(tmp_path):
    package = tmp_path / "proj"
    package.mkdir()
    (package / "__init__.py").write_text("")
    train = _download_project(package, "from .data import CifarData", 'ds = CifarData("d")')
    [finding] = _download_findings(train)
    assert finding.startswith("8 `CifarData` (defined in data.py), which downloads")


def test_rank_zero_first_around_the_getter_is_quiet(tmp_path):
    body = (
        "if rank != 0:\n    dist.barrier()\n"
        'ds = get_cifar10("d")\n'
        "if rank == 0:\n    dist.barrier()"
    )
    train = _download_project(tmp_path, "from data import get_cifar10", body)
    assert _download_findings(train) == []


def test_the_others_waiting_only_after_the_getter_is_reported(tmp_path):
    body = 'ds = get_cifar10("d")\nif rank != 0:\n    dist.barrier()\n'
    body += "if rank == 0:\n    dist.barrier()"
    train = _download_project(tmp_path, "from data import get_cifar10", body)
    assert [f.split()[0] for f in _download_findings(train)] == ["8"]


def test_a_getter_called_on_rank_zero_only_is_quiet(tmp_path):
    body = 'if rank == 0:\n    get_cifar10("d")\ndist.barrier()'
    train = _download_project(tmp_path, "from data import get_cifar10", body)
    assert _download_findings(train) == []


def test_a_getter_that_does_not_download_is_quiet(tmp_path):
    imports = "from data import get_cifar10, get_mnist"
    body = 'a = get_mnist("d")\nb = get_cifar10("d")'
    assert _download_findings(_download_project(tmp_path, imports, body, "False")) == []


def test_the_data_module_checked_alone_says_nothing(tmp_path):
    _download_project(tmp_path, "from data import get_cifar10", 'ds = get_cifar10("d")')
    assert _download_findings(tmp_path / "data.py") == []


# -- DDP050: a method that saves, called on every rank by another module -------------------

MODEL_MODULE = """\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


class Model:
    def __init__(self, net, rank):
        self.rank = rank
        self.net = DDP(net.cuda(rank), device_ids=[rank])

    def save_state(self, path):
        torch.save({{"net": self.net.module.state_dict()}}, path)

    def save_guarded(self, path):
        if self.rank == 0:
            torch.save(self.net.module.state_dict(), path)
"""

TRAINER_MODULE = """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import Model


def train_loop(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = Model(torch.nn.Linear(2, 2), rank)
    for epoch in range(3):
{body}


if __name__ == "__main__":
    mp.spawn(train_loop, args=(2,), nprocs=2)
"""


def _method_project(tmp_path: Path, body: str) -> Path:
    (tmp_path / "model.py").write_text(MODEL_MODULE.format())
    (tmp_path / "trainer.py").write_text(TRAINER_MODULE.format(body=body))
    return tmp_path / "model.py"


def test_a_saving_method_another_module_calls_on_every_rank_is_reported(tmp_path):
    helper = _method_project(tmp_path, '        model.save_state("last.pt")')
    [finding] = _findings(helper)
    assert finding.startswith("11 `torch.save` in `Model.save_state()` runs on every rank:")
    assert "trainer.py (distributed) calls `.save_state()` on its `Model`" in finding


def test_a_saving_method_called_under_a_rank_guard_is_quiet(tmp_path):
    body = '        if rank == 0:\n            model.save_state("last.pt")'
    assert _findings(_method_project(tmp_path, body)) == []


def test_a_method_that_guards_its_save_is_quiet(tmp_path):
    assert _findings(_method_project(tmp_path, '        model.save_guarded("last.pt")')) == []


def test_a_saving_method_no_module_calls_is_quiet(tmp_path):
    assert _findings(_method_project(tmp_path, "        pass")) == []


# -- DDP012: a load helper of another module drops the caller's device --------------------

CHECKPOINTS = """\
import torch


def load_checkpoint(path, map_location=None):
    return torch.load(path{passed})


def load_weights(path, device):
    state = torch.load(path{passed_device})
    return {{k: v.to(device) for k, v in state.items()}}


def load_plain(path):
    return torch.load(path)
"""

DISTRIBUTED_TRAIN = """\
import torch.distributed as dist

from ckpt import load_checkpoint, load_plain, load_weights

dist.init_process_group("nccl")
state = load_checkpoint("a.pt", map_location="cpu")
"""


def _load_findings(path: Path) -> list[str]:
    report = check_paths([str(path)], select_rules(["DDP012"]))
    return [f"{d.location.row} {d.message}" for d in report.diagnostics]


def _load_project(tmp_path: Path, train: str = DISTRIBUTED_TRAIN, fixed: bool = False) -> Path:
    helper = tmp_path / "ckpt.py"
    helper.write_text(
        CHECKPOINTS.format(
            passed=", map_location=map_location" if fixed else "",
            passed_device=", map_location=device" if fixed else "",
        )
    )
    (tmp_path / "train.py").write_text(train)
    return helper


def test_a_load_helper_that_drops_the_callers_device_is_reported_in_its_module(tmp_path):
    findings = _load_findings(_load_project(tmp_path))
    assert [f.split()[0] for f in findings] == ["5", "9"]
    assert "`load_checkpoint()` takes `map_location` but its `torch.load` ignores it" in findings[0]
    assert "(train.py runs distributed)" in findings[0]
    assert "then moves them to `device`; pass `map_location=device`" in findings[1]


def test_a_load_helper_that_passes_the_device_is_quiet(tmp_path):
    assert _load_findings(_load_project(tmp_path, fixed=True)) == []


def test_a_load_helper_of_a_single_process_project_is_quiet(tmp_path):
    train = 'from ckpt import load_checkpoint\n\nstate = load_checkpoint("a.pt", "cpu")\n'
    assert _load_findings(_load_project(tmp_path, train=train)) == []


def _severity_findings(path: Path) -> list[tuple[int, str, str]]:
    report = check_paths([str(path)], select_rules(["DDP012"]))
    return [(d.location.row, d.severity.value, d.message) for d in report.diagnostics]


def test_a_plain_load_a_distributed_module_calls_is_reported_at_info(tmp_path):
    train = DISTRIBUTED_TRAIN + 'plain = load_plain("b.pt")\n'
    findings = _severity_findings(_load_project(tmp_path, train=train, fixed=True))
    assert [(row, severity) for row, severity, _ in findings] == [(14, "info")]
    assert "and train.py (distributed) uses `load_plain`" in findings[0][2]


def test_a_plain_load_a_distributed_module_only_imports_is_quiet(tmp_path):
    # DISTRIBUTED_TRAIN imports load_plain but never calls it.
    assert _severity_findings(_load_project(tmp_path, fixed=True)) == []


def test_a_plain_load_called_by_a_single_process_module_is_quiet(tmp_path):
    train = 'from ckpt import load_plain\n\nstate = load_plain("a.pt")\n'
    assert _severity_findings(_load_project(tmp_path, train=train, fixed=True)) == []


EMA = """\
import torch


class Ema:
    def __init__(self, model, resume=None):
        self.model = model
        if resume:
            self._load(resume)

    def _load(self, path):
        self.model.load_state_dict(torch.load(path)["ema"])


def restore(path):
    if torch.cuda.is_available():
        return torch.load(path)
    return torch.load(path, map_location="cpu")


def restore_chosen(path, gpu):
    if gpu is None:
        state = torch.load(path)
    else:
        state = torch.load(path, map_location=f"cuda:{gpu}")
    return state
"""

STAR_TRAIN = """\
import torch
import torch.distributed as dist

from ema import *

dist.init_process_group("nccl")
model = torch.nn.Linear(2, 2).cuda()
ema = Ema(model, resume="ema.pt")
state = restore("last.pt")
other = restore_chosen("last.pt", None)
"""


def test_a_class_and_the_cuda_branch_of_a_star_imported_helper_are_reported(tmp_path):
    (tmp_path / "ema.py").write_text(EMA)
    (tmp_path / "train.py").write_text(STAR_TRAIN)
    findings = _severity_findings(tmp_path / "ema.py")
    # Not `restore_chosen`: its branches are the author's choice (a process per GPU or not).
    assert [(row, severity) for row, severity, _ in findings] == [(11, "info"), (16, "info")]
    assert (
        "in `Ema._load()` has no `map_location`, and train.py (distributed) uses `Ema`"
        in (findings[0][2])
    )


LAUNCHER = """\
from ema import Ema


class Launcher:
    def __init__(self, model, resume):
        self.ema = Ema(model, resume=resume)
"""

DDP_ENTRY = """\
import torch
import torch.distributed as dist

import launcher

dist.init_process_group("nccl")
run = launcher.Launcher(torch.nn.Linear(2, 2).cuda(), resume="ema.pt")
"""


def test_a_load_two_imports_away_from_the_distributed_module_is_reported(tmp_path):
    (tmp_path / "ema.py").write_text(EMA)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "ddp_train.py").write_text(DDP_ENTRY)
    findings = _severity_findings(tmp_path / "ema.py")
    assert [(row, severity) for row, severity, _ in findings] == [(11, "info")]
    assert (
        "ddp_train.py (distributed) uses `Launcher` of launcher.py, which uses `Ema`"
        in (findings[0][2])
    )


def test_a_load_two_imports_away_from_a_single_process_module_is_quiet(tmp_path):
    (tmp_path / "ema.py").write_text(EMA)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "sample.py").write_text("import launcher\n\nrun = launcher.Launcher(None, None)\n")
    assert _severity_findings(tmp_path / "ema.py") == []


# -- DDP040: a trainer module accumulates; another module wraps the model in DDP ----------

TRAINER = """\
import torch.distributed as dist


class Trainer:
    def __init__(self, model, optimizer, accum):
        self.model = model
        self.optimizer = optimizer
        self.accum = accum

    def train_epoch(self, loader):
        for step, (x, y) in enumerate(loader):
            loss = self.model(x).sub(y).pow(2).mean()
            loss.backward()
            if (step + 1) % self.accum == 0:
                self.optimizer.step()
                self.optimizer.zero_grad()
        dist.barrier()
"""

LAUNCH = """\
import torch
import torch.distributed as dist

from trainer import Trainer

dist.init_process_group("gloo")
model = {model}
Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), 4).train_epoch([])
"""


def _accumulation_findings(tmp_path: Path, model: str, imports: str = "") -> list[str]:
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "launch.py").write_text(imports + LAUNCH.format(model=model))
    report = check_paths([str(tmp_path / "trainer.py")], select_rules(["DDP040"]))
    return [f"{d.location.row} {d.severity.value} {d.message}" for d in report.diagnostics]


def test_a_trainer_whose_model_another_module_wraps_in_ddp_is_told_at_info(tmp_path):
    [finding] = _accumulation_findings(tmp_path, "DistributedDataParallel(torch.nn.Linear(2, 2))")
    assert finding.startswith("13 info `loss.backward()` runs on every micro-step")
    assert "if `self.model` is a DistributedDataParallel wrapper" in finding


def test_a_trainer_in_a_project_that_never_wraps_in_ddp_is_quiet(tmp_path):
    assert _accumulation_findings(tmp_path, "torch.nn.Linear(2, 2)") == []


IMPORTS_DDP = "from torch.nn.parallel import DistributedDataParallel\n"


def test_a_trainer_every_caller_builds_with_a_ddp_wrapper_is_warned(tmp_path):
    model = "DistributedDataParallel(torch.nn.Linear(2, 2))"
    [finding] = _accumulation_findings(tmp_path, model, IMPORTS_DDP)
    assert finding.startswith("13 warning `loss.backward()` all-reduces the gradients on every")
    assert "under `self.model.no_sync()`" in finding


def test_a_trainer_a_caller_may_build_unwrapped_stays_at_info(tmp_path):
    model = "DistributedDataParallel(torch.nn.Linear(2, 2)) if dist.is_initialized() else None"
    [finding] = _accumulation_findings(tmp_path, model, IMPORTS_DDP)
    assert finding.startswith("13 info ")


# The optimizer steps in the batch loop; the backward runs in a rollout loop inside it.
ROLLOUT_TRAINER = """\
import torch.distributed as dist


class RolloutTrainer:
    def __init__(self, model, optimizer, conf):
        self.model = model
        self.optimizer = optimizer
        self.grad_accum_every = conf["grad_accum_every"]
        self.forecast_len = conf["forecast_len"]

    def train_one_epoch(self, loader, batches_per_epoch):
        batches = iter(loader)
        for steps in range(batches_per_epoch):
{control}
            for t in range(1, self.forecast_len + 1):
                x, y = next(batches)
                loss = self.model(x).sub(y).pow(2).mean()
                loss.backward()
            if (steps + 1) % self.grad_accum_every == 0 or steps == batches_per_epoch - 1:
                self.optimizer.step()
                self.optimizer.zero_grad()
        dist.barrier()
"""
NO_CONTROL = "            pass"
# The fix real trainers apply: the flag `no_sync` toggles, set on the window's boundary.
SYNC_FLAG = (
    "            boundary = (steps + 1) % self.grad_accum_every == 0\n"
    "            self.model.require_backward_grad_sync = boundary"
)


def _rollout_findings(tmp_path: Path, control: str) -> list[str]:
    (tmp_path / "trainer.py").write_text(ROLLOUT_TRAINER.format(control=control))
    (tmp_path / "launch.py").write_text(
        LAUNCH.replace("Trainer", "RolloutTrainer").format(
            model="DistributedDataParallel(torch.nn.Linear(2, 2))"
        )
    )
    report = check_paths([str(tmp_path / "trainer.py")], select_rules(["DDP040"]))
    return [f"{d.location.row} {d.severity.value} {d.message}" for d in report.diagnostics]


def test_a_rollout_trainer_whose_model_another_module_wraps_is_told_at_info(tmp_path):
    [finding] = _rollout_findings(tmp_path, NO_CONTROL)
    assert finding.startswith("18 info `loss.backward()` runs on every micro-step")
    assert "`(steps + 1) % self.grad_accum_every == 0 or steps" in finding


def test_a_rollout_trainer_that_sets_require_backward_grad_sync_is_quiet(tmp_path):
    assert _rollout_findings(tmp_path, SYNC_FLAG) == []


# -- guards judged by their body, wherever they are defined --------------------------------

PRIMARY = """\
import os

import torch.distributed as dist


def check_primary():
    if not dist.is_initialized():
        return True
    return dist.get_rank() == 0


def output_ready(path):
    return os.path.isdir(path)
"""

SAVE_UNDER = """\
import torch
import torch.distributed as dist

{imports}

dist.init_process_group("gloo")
model = torch.nn.Linear(2, 2)
if {test}:
    torch.save(model.state_dict(), "a.pt")
"""


def _guarded_save_findings(folder: Path, imports: str, test: str) -> list[str]:
    (folder / "helpers.py").write_text(PRIMARY)
    train = folder / "train.py"
    train.write_text(SAVE_UNDER.format(imports=imports, test=test))
    return _findings(train)


def test_a_guard_helper_with_an_unusual_name_in_another_module_is_a_guard(tmp_path):
    assert _guarded_save_findings(tmp_path, "import helpers", "helpers.check_primary()") == []


def test_a_helper_that_is_not_about_ranks_is_no_guard(tmp_path):
    imports = "from helpers import output_ready"
    [finding] = _guarded_save_findings(tmp_path, imports, 'output_ready("out")')
    assert finding.startswith("9 `torch.save` runs on every rank")


def test_a_guard_helper_imported_relatively_in_a_package(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    imports = "from .helpers import check_primary"
    assert _guarded_save_findings(tmp_path, imports, "check_primary()") == []


def test_a_guard_helper_of_the_same_file_is_judged_by_its_body(tmp_path):
    train = tmp_path / "train.py"
    own = "def check_primary():\n    return dist.get_rank() == 0\n"
    train.write_text(SAVE_UNDER.format(imports=own, test="check_primary()"))
    assert _findings(train) == []


# -- DDP023: a loader factory seeds its sampler with what the caller put in `flags` -------

LOADERS = """\
from torch.utils.data import DataLoader, DistributedSampler


def get_data_loaders(flags, num_shards, global_rank):
    dataset = list(range(64))
    sampler = DistributedSampler(dataset, seed=flags.{attribute}, drop_last=True)
    return DataLoader(dataset, batch_size=flags.batch_size, sampler=sampler)


def build_loader(dataset, batch_size, seed):
    return DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, seed=seed))
"""

MAIN = """\
import argparse
import random

import torch.distributed as dist

from data_loading.loaders import build_loader, get_data_loaders


def setup_seeds(master_seed, world_size):
    rng = random.Random(master_seed)
    return [rng.randint(0, 2**31) for _ in range(world_size)], [rng.randint(0, 2**31)]


def main():
    flags = argparse.ArgumentParser().parse_args()
    dist.init_process_group("gloo")
    local_rank = dist.get_rank()
    worker_seeds, shuffling_seeds = setup_seeds(flags.seed, dist.get_world_size())
    worker_seed = worker_seeds[local_rank]
{body}
"""


def _seed_findings(tmp_path: Path, body: str, attribute: str = "seed", cache=None) -> list[str]:
    (tmp_path / "data_loading").mkdir(exist_ok=True)
    (tmp_path / "data_loading" / "loaders.py").write_text(LOADERS.format(attribute=attribute))
    (tmp_path / "main.py").write_text(MAIN.format(body=body))
    path = tmp_path / "data_loading" / "loaders.py"
    report = check_paths([str(path)], select_rules(["DDP023"]), cache_dir=cache)
    return [f"{d.location.row} {d.severity.value} {d.message}" for d in report.diagnostics]


PER_RANK_FLAGS = (
    "    flags.seed = worker_seed\n"
    "    loaders = get_data_loaders(flags, dist.get_world_size(), local_rank)"
)


def test_a_seed_the_caller_sets_per_rank_is_reported_in_the_loader_module(tmp_path):
    [finding] = _seed_findings(tmp_path, PER_RANK_FLAGS)
    assert finding.startswith(
        "6 warning `seed=flags.seed` comes from the callers of `get_data_loaders()`: "
        "main.py sets `flags.seed = worker_seed` before calling it, which depends on the rank"
    )


def test_a_shuffling_seed_shared_by_every_rank_is_quiet(tmp_path):
    body = (
        "    flags.seed = worker_seed\n"
        "    flags.shuffling_seed = shuffling_seeds[0]\n"
        "    loaders = get_data_loaders(flags, dist.get_world_size(), local_rank)"
    )
    assert _seed_findings(tmp_path, body, attribute="shuffling_seed") == []


def test_a_per_rank_seed_set_only_after_the_call_is_quiet(tmp_path):
    body = (
        "    loaders = get_data_loaders(flags, dist.get_world_size(), local_rank)\n"
        "    flags.seed = worker_seed"
    )
    assert _seed_findings(tmp_path, body) == []


def test_a_seed_argument_computed_from_the_rank_is_reported(tmp_path):
    body = "    loader = build_loader(list(range(8)), 4, seed=flags.seed + local_rank)"
    [finding] = _seed_findings(tmp_path, body)
    assert finding.startswith(
        "11 warning `seed=seed` comes from the callers of `build_loader()`: main.py passes "
        "`seed=flags.seed + local_rank`, which depends on the rank"
    )


def test_a_seed_argument_shared_by_every_rank_is_quiet(tmp_path):
    body = "    loader = build_loader(list(range(8)), 4, flags.seed)"
    assert _seed_findings(tmp_path, body) == []


def test_the_cache_notices_a_change_in_the_caller(tmp_path):
    cache = tmp_path / ".cache"
    assert len(_seed_findings(tmp_path, PER_RANK_FLAGS, cache=cache)) == 1
    assert len(_seed_findings(tmp_path, PER_RANK_FLAGS, cache=cache)) == 1
    shared = PER_RANK_FLAGS.replace("= worker_seed", "= shuffling_seeds[0]")
    assert _seed_findings(tmp_path, shared, cache=cache) == []


def test_a_seed_passed_through_a_relative_import_in_a_package(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text(LOADERS.format(attribute="seed"))
    (package / "train.py").write_text(
        "import os\n\nimport torch.distributed as dist\n\nfrom .data import build_loader\n\n"
        "rank = int(os.environ['RANK'])\n"
        "loader = build_loader(list(range(8)), 4, seed=1234 + rank)\n"
    )
    report = check_paths([str(package / "data.py")], select_rules(["DDP023"]))
    [finding] = [f"{d.location.row} {d.message}" for d in report.diagnostics]
    assert finding.startswith("11 `seed=seed` comes from the callers of `build_loader()`: train.py")


# -- DDP060: a seeding helper of another module, datasets found by a registry -------------

SEEDED_TRAIN = """\
import torch
import torch.distributed as dist
{imports}
from mylib.data import create_dataset


def main(opt):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seed = opt["seed"]
    {seeding}
    dataset = create_dataset(opt["train"])
    {loop}


def train_one_epoch(dataset, epoch):
    return [dataset[index] for index in range(len(dataset))]


def predict(dataset):
    return len(dataset)
"""
EPOCHS = 'for epoch in range(opt["epochs"]):\n        train_one_epoch(dataset, epoch)'

SEED_UTIL = """\
import random

import numpy as np
import torch


def set_random_seed(seed):
    \"\"\"Seed random, NumPy and torch.\"\"\"
{body}
"""
SEEDS_ALIKE = "    random.seed(seed)\n    np.random.seed(seed)\n    torch.manual_seed(seed)"

# The package scans its own folder for datasets (importlib), so no module names them.
DATA_PACKAGE = """\
import importlib
from pathlib import Path

_modules = [
    importlib.import_module(f"mylib.data.{path.stem}")
    for path in Path(__file__).parent.glob("*_dataset.py")
]


def create_dataset(opt):
    for module in _modules:
        if hasattr(module, opt["type"]):
            return getattr(module, opt["type"])(opt)
    raise ValueError(opt["type"])
"""

TRANSFORMS = """\
import random


def augment(images, hflip=True):
    flip = hflip and random.random() < 0.5
    return [image.flip(-1) if flip else image for image in images]
"""

PAIRED_DATASET = """\
import torch
from torch.utils import data

from {transforms} import augment


class PairedDataset(data.Dataset):
    def __init__(self, opt):
        self.pairs = torch.randn(8, 2, 3, 4, 4)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        low, high = self.pairs[index]
        {item}
"""
AUGMENTS = "return augment([low, high])"


def _seeded_project(
    tmp_path: Path,
    seeding: str = "set_random_seed(seed)",
    imports: str = "from mylib import set_random_seed",
    seed_body: str = SEEDS_ALIKE,
    item: str = AUGMENTS,
    transforms: str = "mylib.data.transforms",
    loop: str = EPOCHS,
) -> Path:
    data = tmp_path / "mylib" / "data"
    data.mkdir(parents=True)
    (tmp_path / "mylib" / "__init__.py").write_text("from .util import set_random_seed\n")
    (tmp_path / "mylib" / "util.py").write_text(SEED_UTIL.format(body=seed_body))
    (data / "__init__.py").write_text(DATA_PACKAGE)
    (data / "transforms.py").write_text(TRANSFORMS)
    dataset = PAIRED_DATASET.format(transforms=transforms, item=item)
    (data / "paired_dataset.py").write_text(dataset)
    train = tmp_path / "train.py"
    train.write_text(SEEDED_TRAIN.format(imports=imports, seeding=seeding, loop=loop))
    return train


def _helper_seed_findings(path: Path, cache_dir: Path | None = None) -> list[str]:
    report = check_paths([str(path)], select_rules(["DDP060"]), cache_dir=cache_dir)
    return [f"{d.location.row} {d.message}" for d in report.diagnostics]


@pytest.mark.parametrize(
    ("imports", "seeding"),
    [
        ("from mylib import set_random_seed", "set_random_seed(seed)"),
        ("import mylib", "mylib.set_random_seed(seed=seed)"),
        ("from mylib import util", "util.set_random_seed(seed)"),
        ("from mylib.util import set_random_seed as seed_all", "seed_all(seed)"),
    ],
)
def test_a_seeding_helper_of_another_module_seeds_every_rank_alike(tmp_path, imports, seeding):
    [finding] = _helper_seed_findings(_seeded_project(tmp_path, seeding, imports))
    assert finding.startswith(f"11 `{seeding}` seeds every rank alike")
    assert finding.endswith("(`paired_dataset.py` draws random augmentations)")


def test_the_rank_added_to_the_helpers_seed_is_quiet(tmp_path):
    assert _helper_seed_findings(_seeded_project(tmp_path, "set_random_seed(seed + rank)")) == []


def test_a_helper_that_adds_the_rank_itself_is_quiet(tmp_path):
    body = "    seed += torch.distributed.get_rank()\n" + SEEDS_ALIKE
    assert _helper_seed_findings(_seeded_project(tmp_path, seed_body=body)) == []


def test_a_helper_that_seeds_nothing_is_quiet(tmp_path):
    assert _helper_seed_findings(_seeded_project(tmp_path, seed_body="    return seed")) == []


def test_datasets_that_draw_nothing_are_no_evidence(tmp_path):
    train = _seeded_project(tmp_path, item="return low, high")
    assert _helper_seed_findings(train) == []


def test_an_inference_script_beside_augmenting_datasets_is_quiet(tmp_path):
    # No epoch loop: the package's datasets are no evidence about this script's data.
    train = _seeded_project(tmp_path, loop="return predict(dataset)")
    assert _helper_seed_findings(train) == []


def test_a_dataset_importing_its_augmentation_relatively_is_evidence(tmp_path):
    [finding] = _helper_seed_findings(_seeded_project(tmp_path, transforms=".transforms"))
    assert finding.startswith("11 `set_random_seed(seed)` seeds every rank alike")


def test_the_cache_notices_a_dataset_that_starts_augmenting(tmp_path):
    train = _seeded_project(tmp_path, item="return low, high")
    cache = tmp_path / ".cache"
    assert _helper_seed_findings(train, cache) == []
    assert _helper_seed_findings(train, cache) == []  # served from the cache
    dataset = PAIRED_DATASET.format(transforms="mylib.data.transforms", item=AUGMENTS)
    (tmp_path / "mylib" / "data" / "paired_dataset.py").write_text(dataset)
    assert len(_helper_seed_findings(train, cache)) == 1  # train.py is unchanged, a dataset is not


# -- where the importers of a helper module are looked for ------------------------------


def _write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_importers_are_found_in_the_folder_above_a_helper_folder(tmp_path):
    helper = _write(tmp_path / "work" / "seg" / "data_loading" / "loader.py", "def make(): pass\n")
    main = _write(tmp_path / "work" / "seg" / "main.py", "from data_loading.loader import make\n")
    assert [path for path, _ in importers(helper)] == [main.resolve()]


def test_importers_are_not_looked_for_above_a_repository_root(tmp_path):
    helper = _write(tmp_path / "work" / "repo" / "loader.py", "def make(): pass\n")
    _write(tmp_path / "work" / "repo" / "pyproject.toml")
    _write(tmp_path / "work" / "other.py", "from repo.loader import make\n")
    assert importers(helper) == []


def test_a_file_that_only_mentions_the_module_is_not_an_importer(tmp_path):
    helper = _write(tmp_path / "work" / "seg" / "data.py", "def make(): pass\n")
    _write(tmp_path / "work" / "seg" / "notes.py", "data = 1  # not an import of data.py\n")
    _write(tmp_path / "work" / "seg" / "train.py", "from data import (\n    make,\n)\n")
    found = [path.name for path, _ in importers(helper)]
    assert found == ["train.py"]


# -- a process group created by a helper of another module (DDP001) -----------------------

GROUP_HELPERS = """\
import os

import torch


def init():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend=backend, init_method="env://")


def seed_everything(seed):
    torch.manual_seed(seed + int(os.environ.get("RANK", "0")))
"""

USES_GROUP = """\
import torch

from torch_utils import distributed as dist


def main():
    dist.{call}
    seed = torch.randint(1 << 31, size=[])
    torch.distributed.broadcast(seed, src=0)


if __name__ == "__main__":
    main()
"""


def _group_findings(folder: Path, call: str) -> list[str]:
    (folder / "torch_utils").mkdir()
    (folder / "torch_utils" / "__init__.py").write_text("")
    (folder / "torch_utils" / "distributed.py").write_text(GROUP_HELPERS)
    train = folder / "train.py"
    train.write_text(USES_GROUP.format(call=call))
    report = check_paths([str(train)], select_rules(["DDP001"]))
    return [f"{d.location.row} {d.severity.value} {d.message}" for d in report.diagnostics]


def test_a_helper_of_another_module_that_creates_the_group_whatever_its_name(tmp_path):
    assert _group_findings(tmp_path, "init()") == []


def test_a_helper_of_another_module_that_creates_no_group_is_no_excuse(tmp_path):
    [finding] = _group_findings(tmp_path, "seed_everything(0)")
    assert finding.startswith("9 error `torch.distributed.broadcast(...)` needs a process group")


# -- a rank-0 test kept in a flag (DDP050) --------------------------------------------------

FLAG_TRAINER = """\
import torch


def train(model, args):
    for epoch in range(args.epochs):
        if args.should_save and epoch % 5 == 0:
            torch.save(model.state_dict(), f"{args.out}/epoch{epoch}.pt")
"""

FLAG_MAIN = """\
import torch
import torch.distributed as dist

from trainer import train


def main(args):
    dist.init_process_group("gloo")
    args.should_save = {flag}
    model = torch.nn.Linear(2, 2)
    train(model, args)
    if args.should_save:
        torch.save(model.state_dict(), f"{{args.out}}/last.pt")


if __name__ == "__main__":
    main(parse_args())
"""


def _flag_findings(folder: Path, flag: str) -> list[str]:
    (folder / "trainer.py").write_text(FLAG_TRAINER)
    main_file = folder / "main.py"
    main_file.write_text(FLAG_MAIN.format(flag=flag))
    return _findings(main_file)


def test_a_save_under_a_flag_set_to_a_rank_zero_test_is_quiet(tmp_path):
    assert _flag_findings(tmp_path, 'args.out != "" and dist.get_rank() == 0') == []


def test_a_save_under_a_flag_that_every_rank_sets_is_reported(tmp_path):
    findings = _flag_findings(tmp_path, 'args.out != ""')
    assert [f.split(" ")[0] for f in findings] == ["11", "13"]


WRAPPING = """\
from torch.nn.parallel import DistributedDataParallel


def wrap(model, local_rank, enabled=True):
    if not enabled:
        return model
    wrapped = DistributedDataParallel(model, device_ids=[local_rank])
    return wrapped


def place(model, local_rank):
    return model.cuda(local_rank)
"""

RANK_ZERO_FORWARD = """\
import torch
import torch.distributed as dist
import torch.nn as nn

from wrapping import {helper}

dist.init_process_group("nccl")
net = {helper}(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda(), 0)
if dist.get_rank() == 0:
    net(torch.randn(8, 4, device="cuda"))
"""


@pytest.mark.parametrize(("helper", "expected"), [("wrap", 1), ("place", 0)])
def test_a_wrapper_returned_by_a_helper_of_another_module(tmp_path, helper, expected):
    # `net = wrap(net, rank)` holds the DDP wrapper when the local module's helper returns
    # one, so rank 0's lone forward is a collective; a helper that only moves it is not.
    (tmp_path / "wrapping.py").write_text(WRAPPING)
    train = tmp_path / "train.py"
    train.write_text(RANK_ZERO_FORWARD.format(helper=helper))
    report = check_paths([str(train)], select_rules(["DDP053"]))
    assert [d.location.row for d in report.diagnostics] == [10] * expected


SETUP = """\
import os

import torch
import torch.distributed as dist


def init_distributed():
    if int(os.environ.get("RANK", -1)) == -1:
        return 0
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return local_rank


def finish():
    if dist.is_initialized():
        dist.destroy_process_group()
"""

ENTRY = """\
import torch

from setup_utils import {imported}


def main():
    local_rank = init_distributed()
    model = torch.nn.Linear(4, 4).cuda(local_rank)
    print(model(torch.randn(2, 4, device="cuda")).sum().item())
{ending}

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(
    ("imported", "ending", "expected"),
    [
        ("init_distributed", "", [7]),  # the helper initialises; nothing destroys
        ("init_distributed, finish", "    finish()\n", []),  # a helper of the module destroys
    ],
)
def test_a_process_group_initialised_by_a_helper_of_another_module(
    tmp_path, imported, ending, expected
):
    (tmp_path / "setup_utils.py").write_text(SETUP)
    train = tmp_path / "train.py"
    train.write_text(ENTRY.format(imported=imported, ending=ending))
    report = check_paths([str(train)], select_rules(["DDP002"]))
    assert [d.location.row for d in report.diagnostics] == expected


EVALUATION = """\
import torch
import torch.distributed as dist


def evaluate(net, batches):
    if dist.get_rank() != 0:
        return None
{unwrap}    with torch.no_grad():
        return sum(net(x).mean().item() for x in batches)
"""

EVALUATING_ENTRY = """\
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from evaluation import evaluate


def main():
    dist.init_process_group("nccl")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda()
    {wrap}
    batches = [torch.randn(8, 4, device="cuda")]
    print(evaluate(model, batches))


main()
"""


@pytest.mark.parametrize(
    ("wrap", "unwrap", "expected"),
    [
        ("model = DDP(model)", "", [9]),  # the entry hands the wrapper to rank 0's forward
        ("model = DDP(model)", "    net = net.module\n", []),  # unwrapped first
        # compiled after the wrap, through an alias: the compiled forward is DDP's
        ("model = DDP(model)\n    bare = model\n    model = torch.compile(bare)", "", [9]),
        ("model = DDP(model, broadcast_buffers=False)", "", []),  # no collective in forward
        ("model = model.half()", "", []),  # never wrapped
    ],
)
def test_a_rank_zero_function_given_the_wrapper_by_another_module(tmp_path, wrap, unwrap, expected):
    # `evaluate()` runs on rank 0 only (it returns early on the others) and calls the
    # model it gets; the module importing it passes the DDP wrapper.
    (tmp_path / "evaluation.py").write_text(EVALUATION.format(unwrap=unwrap))
    (tmp_path / "train.py").write_text(EVALUATING_ENTRY.format(wrap=wrap))
    report = check_paths([str(tmp_path / "evaluation.py")], select_rules(["DDP053"]))
    assert [d.location.row for d in report.diagnostics] == expected


LOSSES = """\
def sequence_scores(model, ids):
    return token_scores(model, ids).sum(-1)


def token_scores(model, ids):
    return model(ids)
"""

SCORING_ENTRY = """\
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from losses import sequence_scores


def final_eval(policy, ids):
    with torch.no_grad():
        return sequence_scores(policy, ids).mean().item()


def main():
    dist.init_process_group("nccl")
    policy = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda())
    ids = torch.randn(8, 4, device="cuda")
    if dist.get_rank() == 0:
        print(final_eval({passed}, ids))


main()
"""


@pytest.mark.parametrize(("passed", "expected"), [("policy", [19]), ("policy.module", [])])
def test_a_wrapper_handed_to_a_helper_that_runs_it_in_another_module(tmp_path, passed, expected):
    # rank 0 hands the wrapper to `final_eval`, which hands it to a local module's
    # helper, which hands it to another that runs its forward.
    (tmp_path / "losses.py").write_text(LOSSES)
    (tmp_path / "train.py").write_text(SCORING_ENTRY.format(passed=passed))
    report = check_paths([str(tmp_path / "train.py")], select_rules(["DDP053"]))
    assert [d.location.row for d in report.diagnostics] == expected
