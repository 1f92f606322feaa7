"""The probe: runs one training script with verify's hooks installed, without editing it.

Run as a file, `python probe.py SCRIPT ARGS...` or under torchrun, so it needs only the standard
library and torch. The settings come from the JSON file named by $DDPIFY_VERIFY_CONFIG; each
process writes what it saw to `<out_dir>/<role>-rank<R>.pt` and its pid to `<out_dir>/pids/`.

What it does to the run (the same in both runs unless said otherwise):
- seeds torch, random and numpy before the script starts (the script's own seeding still wins);
- DataLoaders load in the main process (num_workers=0) so that data and random draws stay visible;
  the original's batch size is multiplied by N under the per-rank policy;
- RandomSampler and DistributedSampler(shuffle=True) draw from one canonical permutation per
  epoch, so the N ranks' step-i batches together are the original's step-i batch;
- dropout is switched off (the masks of one process and of N cannot be made equal);
- the original's learning rate is multiplied by the migration's LR scale for each step;
- records initial weights, gradients before every optimizer step, and weights after K steps,
  then stops the script with SystemExit(0) on every rank (all ranks reach step K together);
- notes what makes a comparison inconclusive: BatchNorm batch statistics, sum-reduced losses,
  random numbers drawn by the data pipeline or the training loop, autocast.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import signal
import sys
import time
import traceback
import types
import warnings

CONFIG_ENV = "DDPIFY_VERIFY_CONFIG"
SEED = 1234
SUM_REDUCED_LOSSES = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
)
DROPOUTS = (
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class StopRun(SystemExit):
    """Raised from the optimizer hook after step K; a SystemExit, so `except Exception` passes."""


class Probe:
    def __init__(self, config: dict) -> None:
        import torch

        self.torch = torch
        self.config = config
        self.role = config["role"]
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.steps_wanted = int(config["steps"])
        self.optimizers: list = []
        self.loaders: list = []
        self.last_loader: int | None = None
        self.pending_data: dict[int, list[float]] = {}
        self.rng_checkpoint = None
        self.record = {
            "role": self.role,
            "rank": self.rank,
            "world_size": self.world,
            "status": "running",
            "error": None,
            "optimizers": [],
            "loaders": [],
            "steps": [],
            "initial": {},
            "final": {},
            "names": {},
            "flags": {},
        }
        self.written = False

    # -- flags ---------------------------------------------------------------------------------

    def flag(self, name: str, value=True) -> None:
        self.record["flags"].setdefault(name, value)

    def count(self, name: str) -> None:
        flags = self.record["flags"]
        flags[name] = flags.get(name, 0) + 1

    # -- installation --------------------------------------------------------------------------

    def install(self) -> None:
        self.seed_everything()
        self.patch_data()
        self.patch_functional()
        self.patch_autocast()
        self.patch_optimizers()

    def seed_everything(self) -> None:
        random.seed(SEED)
        self.torch.manual_seed(SEED)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(SEED)

    def rng_state(self):
        numpy = sys.modules.get("numpy")
        state = [self.torch.get_rng_state(), random.getstate()]
        if numpy is not None:
            state.append(repr(numpy.random.get_state()[1][:4].tolist()))
        return state

    def rng_changed(self, before, after) -> bool:
        if before is None:
            return False
        if not self.torch.equal(before[0], after[0]):
            return True
        return before[1:] != after[1:]

    def patch_data(self) -> None:
        import inspect

        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
        from torch.utils.data import dataloader as dataloader_module

        probe = self
        loader_init = DataLoader.__init__
        signature = inspect.signature(loader_init)

        def init(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            arguments["batch_size"] = probe.loader_batch_size(self, arguments)
            arguments["num_workers"] = 0
            arguments["persistent_workers"] = False
            arguments["prefetch_factor"] = None
            loader_init(*bound.args, **bound.kwargs)

        DataLoader.__init__ = init

        iter_init = dataloader_module._BaseDataLoaderIter.__init__
        iter_next = dataloader_module._BaseDataLoaderIter.__next__

        def make_iter(self, loader):
            # The iterator draws a worker seed from the global RNG; with no workers it is unused,
            # and leaving it drawn would look like randomness in the training loop.
            state = probe.torch.get_rng_state()
            iter_init(self, loader)
            probe.torch.set_rng_state(state)
            self._ddpify_loader = getattr(loader, "_ddpify_index", None)

        def next_batch(self):
            before = probe.rng_state()
            if probe.rng_changed(probe.rng_checkpoint, before):
                probe.flag("loop_rng")
            batch = iter_next(self)
            after = probe.rng_state()
            if probe.rng_changed(before, after):
                probe.flag("augmentation")
            probe.rng_checkpoint = after if probe.rng_checkpoint is not None else None
            probe.note_batch(getattr(self, "_ddpify_loader", None), batch)
            return batch

        dataloader_module._BaseDataLoaderIter.__init__ = make_iter
        dataloader_module._BaseDataLoaderIter.__next__ = next_batch

        random_iter = RandomSampler.__iter__

        def canonical_random_iter(self):
            if self.replacement or self._num_samples is not None:
                probe.flag("unaligned_sampler", "RandomSampler with replacement or num_samples")
                yield from random_iter(self)
                return
            self._ddpify_epoch = getattr(self, "_ddpify_epoch", -1) + 1
            yield from probe.permutation(len(self.data_source), self._ddpify_epoch)

        RandomSampler.__iter__ = canonical_random_iter

        def canonical_distributed_iter(self):
            size = len(self.dataset)
            if self.shuffle:
                # Epoch numbers count in order of first use, so set_epoch(1), set_epoch(2), ...
                # lines up with the original's first and second pass; no set_epoch stays at 0.
                seen = self.__dict__.setdefault("_ddpify_epochs", [])
                if self.epoch not in seen:
                    seen.append(self.epoch)
                indices = probe.permutation(size, seen.index(self.epoch))
            else:
                indices = list(range(size))
            if self.drop_last:
                indices = indices[: self.total_size]
            else:
                padding = self.total_size - len(indices)
                indices += (indices * math.ceil(max(padding, 0) / max(size, 1)))[:padding]
            return iter(indices[self.rank : self.total_size : self.num_replicas])

        DistributedSampler.__iter__ = canonical_distributed_iter

    def permutation(self, size: int, epoch: int) -> list[int]:
        generator = self.torch.Generator()
        generator.manual_seed(SEED + epoch)
        return self.torch.randperm(size, generator=generator).tolist()

    def loader_batch_size(self, loader, arguments: dict):
        from torch.utils.data import IterableDataset

        index = len(self.loaders)
        loader._ddpify_index = index
        native = arguments["batch_size"]
        dataset = arguments["dataset"]
        info = {
            "batch_size": native,
            "used_batch_size": native,
            "policy": None,
            "dataset_size": len(dataset) if hasattr(dataset, "__len__") else None,
            "sampler": type(arguments["sampler"]).__name__ if arguments["sampler"] else None,
            "iterable": isinstance(dataset, IterableDataset),
        }
        self.loaders.append(info)
        self.record["loaders"].append(info)
        if info["iterable"]:
            self.flag("unaligned_sampler", "an IterableDataset decides its own order")
        if self.role != "original" or native is None:
            return native
        policy, factor = self.original_batch_policy(index, native)
        info.update(policy=policy, used_batch_size=native * factor)
        return native * factor

    def original_batch_policy(self, index: int, native: int) -> tuple[str | None, int]:
        nproc = int(self.config["nproc"])
        policy = self.config["batch_policy"]
        if policy == "per-rank":
            return policy, nproc
        if policy == "global":
            return policy, 1
        converted = self.config.get("converted_batch_sizes") or []
        theirs = converted[index] if index < len(converted) else None
        if theirs == native:
            return "per-rank", nproc
        if theirs is not None and theirs * nproc == native:
            return "global", 1
        return None, 1

    def note_batch(self, loader_index, batch) -> None:
        if loader_index is None:
            return
        self.last_loader = loader_index
        tensor = first_tensor(batch, self.torch)
        if tensor is None or tensor.dim() == 0:
            return
        values = tensor.detach().double().cpu()
        stats = self.pending_data.setdefault(loader_index, [0.0, 0.0, 0.0])
        stats[0] += values.shape[0]
        stats[1] += float(values.sum())
        stats[2] += float((values * values).sum())

    def patch_functional(self) -> None:
        import torch.nn.functional as F

        probe = self

        def no_dropout(original):
            def dropout(input, p=0.5, training=True, inplace=False):
                if training and p > 0:
                    probe.count("dropout")
                    return input
                return original(input, p, training, inplace)

            return dropout

        for name in DROPOUTS:
            if hasattr(F, name):
                setattr(F, name, no_dropout(getattr(F, name)))

        batch_norm = F.batch_norm

        def watched_batch_norm(input, running_mean, running_var, *args, **kwargs):
            training = kwargs.get("training", args[2] if len(args) > 2 else False)
            if training or running_mean is None:
                probe.flag("batch_norm")
            return batch_norm(input, running_mean, running_var, *args, **kwargs)

        F.batch_norm = watched_batch_norm

        def watch_reduction(name, loss):
            def watched(*args, **kwargs):
                if kwargs.get("reduction") == "sum":
                    probe.flag("sum_loss", name)
                return loss(*args, **kwargs)

            return watched

        for name in SUM_REDUCED_LOSSES:
            if hasattr(F, name):
                setattr(F, name, watch_reduction(name, getattr(F, name)))

    def patch_autocast(self) -> None:
        from torch.amp import autocast_mode

        probe = self
        enter = autocast_mode.autocast.__enter__

        def watched_enter(self):
            if getattr(self, "_enabled", False):
                probe.flag("amp", str(getattr(self, "fast_dtype", "")).replace("torch.", ""))
            return enter(self)

        autocast_mode.autocast.__enter__ = watched_enter

    def patch_optimizers(self) -> None:
        from torch.optim import Optimizer, optimizer

        probe = self
        optimizer_init = Optimizer.__init__

        def init(self, *args, **kwargs):
            optimizer_init(self, *args, **kwargs)
            self._ddpify_index = len(probe.optimizers)
            self._ddpify_steps = 0
            self._ddpify_lr_scale = None
            probe.optimizers.append(self)
            probe.record["optimizers"].append({"class": type(self).__name__, "lr_scale": None})

        Optimizer.__init__ = init
        optimizer.register_optimizer_step_pre_hook(self.before_step)
        optimizer.register_optimizer_step_post_hook(self.after_step)

    # -- optimizer steps -----------------------------------------------------------------------

    def params(self, opt) -> list:
        return [p for group in opt.param_groups for p in group["params"]]

    def before_step(self, opt, args, kwargs) -> None:
        index = getattr(opt, "_ddpify_index", None)
        if index is None:
            return
        if self.rng_changed(self.rng_checkpoint, self.rng_state()):
            self.flag("loop_rng")
        step = opt._ddpify_steps + 1
        if step == 1:
            self.record["initial"][index] = [snapshot(p) for p in self.params(opt)]
            self.record["names"][index] = parameter_names(self.params(opt), self.torch)
        native_lrs = [lr_value(group["lr"]) for group in opt.param_groups]
        scale = self.lr_scale(opt, native_lrs)
        if scale != 1.0:
            for group in opt.param_groups:
                group["_ddpify_native_lr"] = group["lr"]
                group["lr"] = group["lr"] * scale
        data = self.pending_data.get(self.last_loader) if self.last_loader is not None else None
        self.record["steps"].append(
            {
                "optimizer": index,
                "step": step,
                "lrs": [lr_value(group["lr"]) for group in opt.param_groups],
                "native_lrs": native_lrs,
                "grads": [None if p.grad is None else snapshot(p.grad) for p in self.params(opt)],
                "loader": self.last_loader,
                "data": list(data) if data else None,
            }
        )
        self.pending_data.clear()

    def lr_scale(self, opt, native_lrs: list[float]) -> float:
        """The original's LR multiplier, decided at its first step and kept for every step."""
        if self.role != "original":
            return 1.0
        if opt._ddpify_lr_scale is None:
            opt._ddpify_lr_scale = self.choose_lr_scale(opt._ddpify_index, native_lrs)
            self.record["optimizers"][opt._ddpify_index]["lr_scale"] = opt._ddpify_lr_scale
        return opt._ddpify_lr_scale

    def choose_lr_scale(self, index: int, native_lrs: list[float]) -> float:
        given = self.config.get("lr_scale")
        if given is not None:
            return float(given)
        candidates = [float(c) for c in self.config.get("lr_scale_candidates", [1.0])]
        theirs = self.config.get("converted_lrs") or []
        target = theirs[index] if index < len(theirs) else None
        if not target or len(target) != len(native_lrs):
            return 1.0
        for candidate in candidates:
            if all(close(n * candidate, t) for n, t in zip(native_lrs, target)):
                return candidate
        return 1.0

    def after_step(self, opt, args, kwargs) -> None:
        index = getattr(opt, "_ddpify_index", None)
        if index is None:
            return
        for group in opt.param_groups:
            if "_ddpify_native_lr" in group:
                group["lr"] = group.pop("_ddpify_native_lr")
        opt._ddpify_steps += 1
        self.rng_checkpoint = self.rng_state()
        if index == 0 and opt._ddpify_steps >= self.steps_wanted:
            for optimizer in self.optimizers:
                self.record["final"][optimizer._ddpify_index] = [
                    snapshot(p) for p in self.params(optimizer)
                ]
            self.finish("stopped")
            raise StopRun(0)

    # -- output --------------------------------------------------------------------------------

    def finish(self, status: str, error: str | None = None) -> None:
        if self.written:
            return
        self.written = True
        self.record["status"] = status
        self.record["error"] = error
        base = os.path.join(self.config["out_dir"], f"{self.role}-rank{self.rank}")
        self.torch.save(self.record, base + ".tmp")
        os.replace(base + ".tmp", base + ".pt")
        with open(base + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(self.summary(), handle)
        os.replace(base + ".tmp", base + ".json")

    def summary(self) -> dict:
        """What the launcher needs without importing torch: status, steps, batch sizes, LRs."""
        first_lrs: dict[int, list[float]] = {}
        for step in self.record["steps"]:
            first_lrs.setdefault(step["optimizer"], step["lrs"])
        return {
            "status": self.record["status"],
            "error": self.record["error"],
            "time": time.time(),
            "rank": self.rank,
            "steps": sum(1 for s in self.record["steps"] if s["optimizer"] == 0),
            "batch_sizes": [loader["batch_size"] for loader in self.loaders],
            "first_lrs": [first_lrs.get(i, []) for i in range(len(self.optimizers))],
        }


def first_tensor(batch, torch):
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = first_tensor(item, torch)
            if found is not None:
                return found
    return None


def snapshot(tensor):
    return tensor.detach().to("cpu", copy=True)


def lr_value(lr) -> float:
    return float(lr.item()) if hasattr(lr, "item") else float(lr)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def parameter_names(params: list, torch) -> list[str]:
    """Names from the module tree that owns the parameters, without DDP's `module.` prefix."""
    wanted = {id(p): i for i, p in enumerate(params)}
    modules = []
    with warnings.catch_warnings():  # some lazy proxies warn when isinstance touches them
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.nn.Module):
                    modules.append(obj)
            except Exception:  # noqa: BLE001 - proxies whose isinstance raises are not modules
                continue
    children = {id(child) for module in modules for child in module.children()}
    roots = []
    for module in modules:
        if id(module) in children:
            continue
        named = {id(p): name for name, p in module.named_parameters() if id(p) in wanted}
        if named:
            roots.append(named)
    names: list[str | None] = [None] * len(params)
    for named in sorted(roots, key=len, reverse=True):
        for key, name in named.items():
            if names[wanted[key]] is None:
                names[wanted[key]] = strip_wrappers(name)
    return [name or f"param[{i}]" for i, name in enumerate(names)]


def strip_wrappers(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                changed = True
    return name


def die_with_parent() -> None:
    """Under torchrun the workers live in their own sessions; make them die with the agent."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_script(path: str, argv: list[str], display_path: str) -> None:
    with open(path, "rb") as handle:
        source = handle.read()
    code = compile(source, display_path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = display_path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [display_path, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(display_path))
    exec(code, module.__dict__)


def main() -> int:
    with open(os.environ[CONFIG_ENV], encoding="utf-8") as handle:
        config = json.load(handle)
    die_with_parent()
    pid_dir = os.path.join(config["out_dir"], "pids")
    os.makedirs(pid_dir, exist_ok=True)
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    script, argv = sys.argv[1], sys.argv[2:]
    probe = Probe(config)
    probe.install()
    try:
        run_script(script, argv, config.get("display_path") or script)
    except StopRun:
        return 0
    except SystemExit as exc:
        probe.finish("finished")
        raise exc
    except BaseException:
        probe.finish("error", traceback.format_exc(limit=-8))
        raise
    probe.finish("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
