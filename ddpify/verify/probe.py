"""The probe: runs one training script with verify's hooks installed, without editing it.

Run as a file, `python probe.py SCRIPT ARGS...` or under torchrun, so it needs only the standard
library and torch. The settings come from the JSON file named by $DDPIFY_VERIFY_CONFIG; each
process writes what it saw to `<out_dir>/<role>-rank<R>.pt` and its pid to `<out_dir>/pids/`.

What it does to the run (the same in both runs unless said otherwise):
- seeds torch, random and numpy before the script starts (the script's own seeding still wins);
- DataLoaders load in the main process (num_workers=0) so that data and random draws stay visible;
  the original's batch size is multiplied by N under the per-rank policy;
- with `float64` in the settings (verify's precision check), the default dtype is float64,
  every floating-point batch a DataLoader makes is cast to it, and so is every float32
  tensor the script makes itself (probe_float64.py);
- RandomSampler and DistributedSampler(shuffle=True) draw from one canonical permutation per
  epoch, so the N ranks' step-i batches together are the original's step-i batch; a
  RandomSampler with replacement keeps its own draw (a conversion that draws the whole
  batch on every rank and splits it by hand: compare checks each rank drew the original's);
- random draws in the training loop (`torch.randn(batch, z)`, `rand`, the `*_like` forms, the
  masks of dropout, dropout1d/2d/3d and attention dropout) are made equal across 1 and N
  processes: each draw is made whole, at the single process's shape, and every rank keeps its
  slice along the batch dimension (see RandomDraws); alpha dropout is switched off;
  numpy's global `permutation` and `shuffle` are made whole in every run (recorded, never
  sliced); run again with the original's draws (`original_draws`), the converted run makes
  whole every draw the original made at this rank's own shape (a literal 1 that only looked
  like a per-process batch of 1);
- each sample of a map-style dataset is fetched with the global generators (torch CPU,
  random, numpy) seeded from its index and the pass over its loader, and restored after it,
  so random augmentation is the same whichever process fetches the sample (patch_map_fetcher);
  `np.random.default_rng()` without a seed gets the same seed in both runs;
- a stream (IterableDataset) the conversion shards round-robin is read whole by every rank, so
  each pass over it draws from generators of its own, seeded from the loader and the pass, the
  same in both runs (next_from_stream); the single process reads it as it is;
- in the converted run, a hand-made batch split by rank as migrate writes it is recognised
  (watch_block_splits): draws shaped by the per-process batch keep this rank's block;
- samples the DistributedSampler repeats to pad an epoch are counted per step;
- BatchNorm in training mode computes its batch statistics in Python in both runs; in the
  converted run they are all-reduced across the ranks (SyncBatchNorm's math, autograd included)
  for SyncBatchNorm modules, and for plain BatchNorm on CPU when the script converts to
  SyncBatchNorm on CUDA only; other BatchNorm keeps each rank's own statistics;
- with fewer GPUs than processes ($DDPIFY_VERIFY_SHARE_GPUS), every rank's LOCAL_RANK is
  mapped onto the GPUs there are and nccl is replaced by gloo (NCCL refuses two ranks on one
  device; gloo runs collectives on CUDA tensors);
- the original's learning rate is multiplied by the migration's LR scale for each step;
- records initial weights, gradients before every optimizer step, and weights after K steps,
  then stops the script with SystemExit(0) on every rank (all ranks reach step K together);
- role "reference" (the original under torchrun, as its own DDP; see probe_reference.py):
  each rank gets the converted rank's share of the data and batch size, draws as it does,
  averages the gradients over the ranks, and keeps its own BatchNorm statistics;
- notes what makes a comparison inconclusive or explains a difference: sum-reduced losses,
  random numbers drawn by the data pipeline or the loop outside the draws above, autocast,
  BatchNorm with per-rank statistics, clip_grad_norm_ on gradients a GradScaler still scales.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import inspect
import json
import math
import operator
import os
import random
import signal
import sys
import time
import traceback
import types
import warnings

CONFIG_ENV = "DDPIFY_VERIFY_CONFIG"
# The switch migrate's stream pass sets on a training stream it shards round-robin
# (ddpify.analysis.streams.SWITCH; the probe runs without ddpify on its path).
STREAM_SWITCH = "shard_by_rank"
SEED = 1234
# The class ddpify migrate writes for a WeightedRandomSampler (ddpify/migrate/snippets.py;
# the probe runs without ddpify, so the name is repeated here).
WEIGHTED_SAMPLER_CLASS = "DistributedWeightedSampler"
# Losses whose 'mean' divides by the targets not ignored (ignore_index).
MASKED_MEAN_LOSSES = ("cross_entropy", "nll_loss")
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
# Dropout whose mask keeps or drops whole channels: the dims of the input it takes as batched
# (None: dropout2d takes every input as batched; see feature_mask_shape).
FEATURE_DROPOUTS = {"dropout1d": 3, "dropout2d": None, "dropout3d": 5}
SWITCHED_OFF_DROPOUTS = ("alpha_dropout", "feature_alpha_dropout")
MAX_DRAWS_RECORDED = 5000
# Adaptive-step ODE solvers whose step size is chosen over the whole batch, by module.
ADAPTIVE_SOLVERS = {"torchdiffeq._impl.rk_common": ("RKAdaptiveStepsizeODESolver",)}
SHARE_GPUS_ENV = "DDPIFY_VERIFY_SHARE_GPUS"
SYNC_BN_NAMES = ("SyncBatchNorm", "convert_sync_batchnorm")
# numpy.random's global draws and the position of their `size` argument.
NUMPY_SIZED_DRAWS = {
    "normal": 2,
    "uniform": 2,
    "randint": 2,
    "standard_normal": 0,
    "random": 0,
    "random_sample": 0,
}
# numpy.random's global draws whose result does not follow the batch (a permutation of n
# items, an array shuffled in place): made whole in every run, never sliced by rank.
NUMPY_WHOLE_DRAWS = ("permutation", "shuffle")
NUMPY = "numpy"  # the device of numpy's global generator, for RandomDraws
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# In the note migrate writes above its split of a hand-made batch (migrate/data.py,
# HAND_MADE_NOTE): `# ddpify: batch policy global: each rank its rows of the batch, ...`.
HAND_SPLIT_MARKER = "each rank its rows of the batch"


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
        # the generator state after a sampler seeded itself from it (draw_with_replacement)
        self.sampler_seeded = None
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
            "draws": [],
        }
        self.written = False
        self.draws = RandomDraws(self)
        self.script_converts_sync_bn = False
        self.scaled_grads_pending = False
        self.seeding_depth = 0  # inside a per-sample seeded dataset fetch
        self.script_splits_batches = False  # the migration split hand-made batches by rank
        self.pending_split: dict | None = None
        # samples a DistributedSampler repeated to pad the epoch: drawn for the batch being
        # made, and per loader since the last step (only the loader feeding a step counts)
        self.padded_now = 0
        self.padded_pending: dict[int | None, int] = {}
        self.reference = None  # the per-rank reference's share and averaging (role reference)

    # -- flags ---------------------------------------------------------------------------------

    def flag(self, name: str, value=True) -> None:
        self.record["flags"].setdefault(name, value)

    def count(self, name: str) -> None:
        flags = self.record["flags"]
        flags[name] = flags.get(name, 0) + 1

    # -- installation --------------------------------------------------------------------------

    def install(self) -> None:
        if self.role == "reference":
            self.reference = reference_rank(self)
        self.seed_everything()
        if self.config.get("float64"):
            self.run_in_float64()
        self.share_gpus()
        self.patch_data()
        self.draws.patch(self.torch)
        self.draws.patch_numpy()
        self.seed_fresh_numpy_generators()
        self.patch_functional()
        self.patch_autocast()
        self.patch_grad_scaler()
        self.patch_optimizers()
        self.watch_adaptive_solvers()
        if self.role == "converted" and self.world > 1 and self.script_splits_batches:
            self.watch_block_splits()

    # -- float64 ------------------------------------------------------------------------------

    def run_in_float64(self) -> None:
        """verify's precision check: the model the script builds, every floating-point
        batch its loaders make and the float32 tensors the script makes itself are float64
        (probe_float64.py), so what float32 rounding made of the two runs (sums in another
        order) shrinks a billionfold and what the code computes stays."""
        self.torch.set_default_dtype(self.torch.float64)
        beside_this_file("probe_float64").widen_script_floats(self)
        self.flag("float64")

    def in_float64(self, batch):
        """`batch` with its floating-point tensors as float64 (lists, tuples, dicts kept)."""
        torch = self.torch
        if isinstance(batch, torch.Tensor):
            return batch.double() if batch.is_floating_point() else batch
        if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
            return type(batch)(self.in_float64(item) for item in batch)
        if isinstance(batch, dict):
            return type(batch)((key, self.in_float64(value)) for key, value in batch.items())
        return batch

    # -- adaptive ODE solvers ------------------------------------------------------------------

    def watch_adaptive_solvers(self) -> None:
        """Flag an adaptive-step ODE solve: its step sizes come from an error norm over the
        whole batch, so N processes each integrate their shard with steps of their own and
        agree with the single process to the solver's tolerance, not to float rounding."""
        probe = self

        def patch(module) -> None:
            for name in ADAPTIVE_SOLVERS.get(module.__name__, ()):
                solver = getattr(module, name, None)
                if solver is None or getattr(solver, "_ddpify_watched", False):
                    continue
                init = solver.__init__

                def watched_init(self, *args, _init=init, _name=name, **kwargs):
                    _init(self, *args, **kwargs)
                    rtol = kwargs.get("rtol", getattr(self, "rtol", None))
                    probe.flag(
                        "adaptive_solver",
                        f"{_name} (rtol {lr_value(rtol):g})" if rtol is not None else _name,
                    )

                solver.__init__ = watched_init
                solver._ddpify_watched = True

        after_import(ADAPTIVE_SOLVERS, patch)

    def share_gpus(self) -> None:
        """Fewer GPUs than ranks: map LOCAL_RANK onto them and run the collectives on gloo."""
        gpus = int(os.environ.get(SHARE_GPUS_ENV, "0") or 0)
        if self.role != "converted" or gpus < 1:
            return
        local = int(os.environ.get("LOCAL_RANK", "0"))
        os.environ["LOCAL_RANK"] = str(local % gpus)
        dist = self.torch.distributed
        init = dist.init_process_group
        probe = self

        signature = inspect.signature(init)

        def init_process_group(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            asked = arguments.get("backend")
            arguments["backend"] = "gloo"
            arguments.pop("device_id", None)  # binds the group to one device, for NCCL
            probe.flag("shared_gpus", f"{asked or 'default'} -> gloo")
            return init(**arguments)

        dist.init_process_group = init_process_group

    def check_rng(self) -> None:
        """Flag a draw outside the aligned ones since the last look at the generators."""
        if self.rng_changed(self.rng_checkpoint, self.rng_state()):
            self.flag("loop_rng")

    def rng_drawn(self) -> None:
        """An aligned draw moved the generators: that much movement is expected."""
        if self.rng_checkpoint is not None:
            self.rng_checkpoint = self.rng_state()

    def patch_grad_scaler(self) -> None:
        """Notice clip_grad_norm_ on gradients a GradScaler still scales (no unscale_)."""
        import torch.nn.utils as utils
        from torch.amp import GradScaler
        from torch.nn.utils import clip_grad

        probe = self
        scale, unscale = GradScaler.scale, GradScaler.unscale_

        def watched_scale(self, outputs):
            if self.is_enabled():
                probe.scaled_grads_pending = True
            return scale(self, outputs)

        def watched_unscale(self, optimizer):
            probe.scaled_grads_pending = False
            if probe.reference is not None:  # DDP averaged them during backward
                probe.reference.average(optimizer)
            return unscale(self, optimizer)

        GradScaler.scale, GradScaler.unscale_ = watched_scale, watched_unscale

        def watch_clip(clip):
            def clipped(*args, **kwargs):
                if probe.reference is not None:  # DDP averaged them during backward
                    probe.reference.average_pending()
                if probe.scaled_grads_pending:
                    probe.flag("clip_scaled", clip.__name__)
                return clip(*args, **kwargs)

            return clipped

        for name in ("clip_grad_norm_", "clip_grad_value_"):
            watched = watch_clip(getattr(clip_grad, name))
            setattr(clip_grad, name, watched)
            setattr(utils, name, watched)

    def seed_everything(self) -> None:
        random.seed(SEED)
        self.torch.manual_seed(SEED)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(SEED)

    def seed_fresh_numpy_generators(self) -> None:
        """`np.random.default_rng()` without a seed takes fresh entropy from the OS, so every
        process (each rank, the original) would make other data. Like the global generators,
        such a generator gets a seed from the probe instead: the n-th one the script makes has
        the same seed in every run (inside a seeded dataset fetch, one of that sample)."""
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return
        native = numpy.random.default_rng
        probe = self
        made = [0]

        def default_rng(seed=None):
            if seed is not None:
                return native(seed)
            made[0] += 1
            if probe.seeding_depth:  # the sample's own generator state is seeded already
                return native(int(numpy.random.randint(0, 2**31)))
            probe.flag("fresh_entropy", "numpy.random.default_rng()")
            return native([SEED, made[0]])

        numpy.random.default_rng = default_rng

    def rng_state(self):
        numpy = sys.modules.get("numpy")
        state = [self.torch.get_rng_state(), random.getstate()]
        if numpy is not None:
            _, key, position, *_ = numpy.random.get_state()
            state.append((key[:4].tolist(), position))
        return state

    def rng_changed(self, before, after) -> bool:
        if before is None:
            return False
        if not self.torch.equal(before[0], after[0]):
            return True
        return before[1:] != after[1:]

    def patch_data(self) -> None:
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
            if probe.reference is not None:
                probe.deal_reference_share(self._ddpify_index, arguments)
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
            # Which pass over this loader the iterator makes: part of each sample's seed.
            loader._ddpify_passes = getattr(loader, "_ddpify_passes", 0) + 1
            self._ddpify_pass = loader._ddpify_passes
            self._ddpify_stream = probe.stream_generators(self._ddpify_loader, self._ddpify_pass)

        def next_batch(self):
            before = probe.rng_state()
            if probe.rng_changed(probe.rng_checkpoint, before):
                probe.flag("loop_rng")
            fetcher = getattr(self, "_dataset_fetcher", None)
            if fetcher is not None:
                fetcher._ddpify_pass = getattr(self, "_ddpify_pass", None)
            stream = getattr(self, "_ddpify_stream", None)
            probe.sampler_seeded = None
            batch = iter_next(self) if stream is None else probe.next_from_stream(self, iter_next)
            if probe.sampler_seeded is not None:  # the sampler's seed: not augmentation
                before, probe.sampler_seeded = probe.sampler_seeded, None
            after = probe.rng_state()
            if probe.rng_changed(before, after):
                probe.flag("augmentation")
            probe.rng_checkpoint = after if probe.rng_checkpoint is not None else None
            loader = getattr(self, "_ddpify_loader", None)
            if probe.padded_now:
                padded = probe.padded_pending
                padded[loader] = padded.get(loader, 0) + probe.padded_now
                probe.padded_now = 0
            unaligned = probe.loaders[loader].get("unaligned") if loader is not None else None
            if unaligned:
                probe.flag("unaligned_sampler", unaligned)
            if probe.config.get("float64"):
                batch = probe.in_float64(batch)
            probe.note_batch(loader, batch)
            return batch

        dataloader_module._BaseDataLoaderIter.__init__ = make_iter
        dataloader_module._BaseDataLoaderIter.__next__ = next_batch
        self.patch_map_fetcher()

        random_iter = RandomSampler.__iter__

        def canonical_random_iter(self):
            if self.replacement:
                yield from probe.draw_with_replacement(self, random_iter)
                return
            if self._num_samples is not None:
                probe.flag("unaligned_sampler", "RandomSampler with num_samples")
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
            return probe.mark_padding(
                indices[self.rank : self.total_size : self.num_replicas],
                self.rank,
                self.num_replicas,
                size,
            )

        DistributedSampler.__iter__ = canonical_distributed_iter
        self.patch_weighted_sampler()

    def patch_weighted_sampler(self) -> None:
        """A WeightedRandomSampler (the original's) draws one canonical weighted draw per
        pass over its loader (the probe's seed plus the pass), cut to a multiple of N, as
        the migration's DistributedWeightedSampler (recognised by its class name, see
        ddpify/migrate/weighted.py) draws when given the same seed and pass: its ranks'
        step-i batches together are then the original's step-i batch."""
        from torch.utils.data import DataLoader, WeightedRandomSampler

        probe = self
        replicas = int(self.config.get("nproc") or self.world)
        if self.role == "reference":  # the per-rank reference deals its own shares
            native_weighted = WeightedRandomSampler.__iter__

            def flagged_iter(self):
                probe.flag("unaligned_sampler", "WeightedRandomSampler")
                return native_weighted(self)

            WeightedRandomSampler.__iter__ = flagged_iter
            return

        def canonical_weighted_iter(self):
            self._ddpify_epoch = getattr(self, "_ddpify_epoch", -1) + 1
            return iter(probe.weighted_draw(self, replicas))

        WeightedRandomSampler.__iter__ = canonical_weighted_iter
        loader_init = DataLoader.__init__

        def init(self, *args, **kwargs):
            loader_init(self, *args, **kwargs)
            sampler_class = type(getattr(self, "sampler", None))
            if sampler_class.__name__ == WEIGHTED_SAMPLER_CLASS:
                probe.align_distributed_weighted(sampler_class)

        DataLoader.__init__ = init

    def align_distributed_weighted(self, sampler_class) -> None:
        """The converted script's own `__iter__` runs (its draw, its cut, its share), with
        the probe's seed and the pass numbered by the order its epochs are first used, as
        the original's canonical draw numbers its passes."""
        native = sampler_class.__iter__
        if getattr(native, "_ddpify_aligned", False):
            return

        def aligned_iter(self):
            seen = self.__dict__.setdefault("_ddpify_epochs", [])
            if self.epoch not in seen:
                seen.append(self.epoch)
            epoch, seed = self.epoch, self.seed
            self.epoch, self.seed = seen.index(epoch), SEED
            try:
                return native(self)
            finally:
                self.epoch, self.seed = epoch + 1, seed

        aligned_iter._ddpify_aligned = True  # type: ignore[attr-defined]
        sampler_class.__iter__ = aligned_iter

    def weighted_draw(self, sampler, replicas: int) -> list[int]:
        """The canonical draw of a weighted sampler's pass (`_ddpify_epoch`), cut to a
        multiple of `replicas` as the migration's distributed sampler cuts it."""
        torch = self.torch
        generator = torch.Generator()
        generator.manual_seed(SEED + sampler._ddpify_epoch)
        weights = torch.as_tensor(sampler.weights, dtype=torch.double)
        drawn = torch.multinomial(
            weights, sampler.num_samples, sampler.replacement, generator=generator
        ).tolist()
        return drawn[: len(drawn) // replicas * replicas]

    def mark_padding(self, chosen: list[int], rank: int, replicas: int, size: int):
        """Yield this rank's indices, counting those that pad the epoch: position
        `rank + k * replicas` of the padded list is past the dataset's end. A padded sample is
        one the single process does not train on in that epoch; compare stops there."""
        for k, index in enumerate(chosen):
            if rank + k * replicas >= size:
                self.padded_now += 1
                self.flag("padded", [size, replicas])
            yield index

    # -- hand-made batches split by rank ---------------------------------------------------

    def watch_block_splits(self) -> None:
        """Notice the migration's split of a hand-made batch, `x[RANK * len(x) // WORLD_SIZE :
        (RANK + 1) * len(x) // WORLD_SIZE]`: this rank's contiguous block of the batch.

        Only scripts whose migration says it split batches by hand (HAND_SPLIT_MARKER) are
        watched. The block tells the random draws the per-process batch and where this
        rank's rows lie in the single process's batch; the whole batch is recorded so that
        compare can check every rank split the same one."""
        torch = self.torch
        native = torch.Tensor.__getitem__
        probe = self

        def getitem(self, key):
            part = native(self, key)
            if type(key) is slice and key.step is None and self.dim() > 0:
                rows = self.shape[0]
                start, stop = block_bounds(rows, probe.rank, probe.world)
                if key.start == start and key.stop == stop:
                    probe.note_split(self, rows, start, stop)
            return part

        torch.Tensor.__getitem__ = getitem

    def note_split(self, batch, rows: int, start: int, stop: int) -> None:
        """The first split since the last optimizer step is the batch the step trains on."""
        if self.pending_split is not None:
            return
        self.draws.rows, self.draws.block = stop - start, (start, rows)
        values = batch.detach().double().cpu()
        self.pending_split = {
            "rows": rows,
            "block": [start, stop],
            "data": [float(rows), float(values.sum()), float((values * values).sum())],
        }

    # -- random augmentation, seeded per sample ----------------------------------------------

    def patch_map_fetcher(self) -> None:
        """Fetch each sample of a map-style dataset under generators seeded from its index.

        The N processes fetch different samples than the single process, in another order, so
        a dataset that augments at random in `__getitem__` would give sample i other numbers
        in each run. Seeded from (sample index, pass over the loader), sample i gets the same
        augmentation whichever process fetches it, and the generators are restored after the
        fetch, so data loading leaves the training loop's draws alone. Only the draws inside
        `dataset[i]` are aligned this way: collate_fn, the sampler and a dataset's own
        `__getitems__` (a batch at once) stay outside and still make the result inconclusive.
        """
        from torch.utils.data._utils import fetch as fetch_module

        probe = self
        native = fetch_module._MapDatasetFetcher.fetch

        def fetch(self, possibly_batched_index):
            pass_number = getattr(self, "_ddpify_pass", None)
            if pass_number is None or not fetches_per_sample(self.dataset):
                return native(self, possibly_batched_index)
            if self.auto_collation:
                data = [
                    probe.seeded_sample(self.dataset, index, pass_number)
                    for index in possibly_batched_index
                ]
            else:
                data = probe.seeded_sample(self.dataset, possibly_batched_index, pass_number)
            return self.collate_fn(data)

        fetch_module._MapDatasetFetcher.fetch = fetch

    def seeded_sample(self, dataset, index, pass_number: int):
        """`dataset[index]` with torch's CPU generator, `random` and numpy's global generator
        seeded from (SEED, index, pass), all three restored afterwards. CUDA generators are
        left alone (torch.manual_seed would reseed them and unsettle the loop's CUDA draws)."""
        saved = self.save_generators()
        self.seed_generators(sample_seed(index, pass_number))
        seeded = self.rng_state()
        self.seeding_depth += 1
        try:
            return dataset[index]
        finally:
            self.seeding_depth -= 1
            if self.rng_changed(seeded, self.rng_state()):
                self.count("seeded_augmentation")
            self.restore_generators(saved)

    def save_generators(self) -> tuple:
        """The full states of the CPU generators a data pipeline may draw from."""
        numpy = sys.modules.get("numpy")
        return (
            self.torch.get_rng_state(),
            random.getstate(),
            numpy.random.get_state() if numpy is not None else None,
        )

    def restore_generators(self, saved: tuple) -> None:
        self.torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        numpy = sys.modules.get("numpy")
        if saved[2] is not None and numpy is not None:
            numpy.random.set_state(saved[2])

    def seed_generators(self, seed: int) -> None:
        self.torch.default_generator.manual_seed(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed)

    # -- random draws of a stream sharded round-robin ----------------------------------------

    def aligned_stream(self, index: int, dataset) -> bool:
        """Whether the `index`-th loader reads an IterableDataset that the conversion shards
        round-robin (`dataset.shard_by_rank = True`, migrate's stream pass): every rank then
        iterates the whole stream and keeps items RANK, RANK + N, ..., which is the order a
        DistributedSampler deals samples out in, so the N ranks' step-i batches together
        are the single process's step-i batch."""
        if self.role == "converted":
            return bool(getattr(dataset, STREAM_SWITCH, False))
        return bool(self.converted_loader(index).get("aligned_stream"))

    def stream_generators(self, index, pass_number: int) -> tuple | None:
        """For a pass over an aligned stream: generators of its own, seeded from the loader
        and the pass, the same in both runs. None for any other loader."""
        if index is None or not self.loaders[index].get("aligned_stream"):
            return None
        saved = self.save_generators()
        self.seed_generators(sample_seed(f"stream{index}", pass_number))
        own = self.save_generators()
        self.restore_generators(saved)
        return own

    def next_from_stream(self, iterator, iter_next):
        """The next batch of an aligned stream, drawn with the stream's own generators.

        Every rank pulls every item of the stream (it skips the others' items), so the
        stream's draws depend only on how far it has read: item k gets the same random
        numbers in both runs. The loop's generators are set aside meanwhile, so they stay in
        step between the runs too."""
        saved = self.save_generators()
        self.restore_generators(iterator._ddpify_stream)
        self.seeding_depth += 1
        try:
            return iter_next(iterator)
        finally:
            self.seeding_depth -= 1
            iterator._ddpify_stream = self.save_generators()
            if self.rng_changed(saved, self.rng_state()):
                self.count("seeded_stream")
            self.restore_generators(saved)

    def permutation(self, size: int, epoch: int) -> list[int]:
        generator = self.torch.Generator()
        generator.manual_seed(SEED + epoch)
        return self.torch.randperm(size, generator=generator).tolist()

    def draw_with_replacement(self, sampler, native_iter):
        """A RandomSampler's own draw with replacement, left as the script makes it: a
        conversion that keeps such a sampler draws the whole batch on every rank and splits
        it by hand, which is right only when every rank draws what the original draws, so
        compare checks the batches instead of the probe making them equal. Without a
        generator of its own the sampler seeds one from the global generator as the pass
        starts (in the loop, where a draw would look like random augmentation): that seed
        is drawn here, as torch draws it, and the loader's batch is judged from after it."""
        torch = self.torch
        if sampler.generator is not None:
            yield from native_iter(sampler)
            return
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        self.sampler_seeded = self.rng_state()
        sampler.generator = generator
        try:
            yield from native_iter(sampler)
        finally:
            sampler.generator = None

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
        sampler = arguments["sampler"]
        info["sampler_settings"] = {
            "shuffle": getattr(sampler, "shuffle", None),
            "drop_last": getattr(sampler, "drop_last", None),
        }
        info["aligned_stream"] = info["iterable"] and self.aligned_stream(index, dataset)
        self.loaders.append(info)
        self.record["loaders"].append(info)
        if info["iterable"] and not info["aligned_stream"]:
            # flagged when the loader feeds a step (an evaluation stream read after the
            # last compared step changes nothing)
            info["unaligned"] = "an IterableDataset decides its own order"
        if self.role == "converted" or native is None:
            return native
        policy, factor = self.original_batch_policy(index, native)
        info.update(policy=policy, used_batch_size=native * factor)
        if self.role == "reference":  # the converted rank's batch; the global one recorded
            theirs = self.converted_loader(index).get("batch_size")
            return theirs if theirs is not None else native * factor // self.world
        return native * factor

    def converted_loader(self, index: int) -> dict:
        """What the converted run's rank 0 recorded of its `index`-th DataLoader."""
        loaders = self.config.get("converted_loaders") or []
        return loaders[index] if index < len(loaders) else {}

    def deal_reference_share(self, index: int, arguments: dict) -> None:
        """Where the converted run's loader has a DistributedSampler, give this reference
        process the same share: the original's own order (shuffle or not) becomes one; where
        it reads a stream round-robin, this process reads the same items of the stream."""
        theirs = self.converted_loader(index)
        if theirs.get("aligned_stream"):  # the stream the conversion shards round-robin
            arguments["dataset"] = self.reference.stream_share(arguments["dataset"])
            return
        if theirs.get("sampler") != "DistributedSampler":
            return
        if arguments["sampler"] is not None or arguments["batch_sampler"] is not None:
            self.flag("unaligned_sampler", "the original's own sampler: not dealt out per rank")
            return
        if self.loaders[index]["iterable"]:
            return
        arguments["sampler"] = self.reference.sampler(arguments["dataset"], theirs)
        arguments["shuffle"] = None

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
        self.draws.rows, self.draws.block = int(tensor.shape[0]), None
        values = tensor.detach().double().cpu()
        stats = self.pending_data.setdefault(loader_index, [0.0, 0.0, 0.0])
        stats[0] += values.shape[0]
        stats[1] += float(values.sum())
        stats[2] += float((values * values).sum())

    def patch_functional(self) -> None:
        import torch.nn.functional as F

        probe = self
        draws = self.draws

        def switched_off(original):
            def dropout(input, p=0.5, training=True, inplace=False):
                if training and p > 0:
                    probe.count("dropout_off")
                    return input
                return original(input, p, training, inplace)

            return dropout

        for name in SWITCHED_OFF_DROPOUTS:
            if hasattr(F, name):
                setattr(F, name, switched_off(getattr(F, name)))

        def aligned_dropout(original, batched_dims):
            def dropout(input, p=0.5, training=True, inplace=False):
                if not training or p <= 0 or p >= 1:
                    return original(input, p, training, inplace)
                mask_shape = feature_mask_shape(input, batched_dims)
                if mask_shape is None:  # an input layout the mask is not known for
                    probe.count("dropout_off")
                    return input
                probe.count("dropout")
                keep = draws.uniform(mask_shape, input.device, "dropout") >= p
                mask = keep.to(input.dtype) / (1 - p)
                return input.mul_(mask) if inplace else input * mask

            return dropout

        F.dropout = aligned_dropout(F.dropout, 0)
        for name, batched_dims in FEATURE_DROPOUTS.items():
            if hasattr(F, name):
                setattr(F, name, aligned_dropout(getattr(F, name), batched_dims))
        if hasattr(F, "scaled_dot_product_attention"):
            F.scaled_dot_product_attention = self.attention_with_aligned_dropout(
                F.scaled_dot_product_attention
            )
        self.patch_batch_norm(F)

        def watch_reduction(name, loss):
            def watched(*args, **kwargs):
                if sums_over_batch(kwargs):
                    probe.flag("sum_loss", name)
                elif name in MASKED_MEAN_LOSSES:
                    probe.note_masked_mean(name, args, kwargs)
                return loss(*args, **kwargs)

            return watched

        for name in SUM_REDUCED_LOSSES:
            if hasattr(F, name):
                setattr(F, name, watch_reduction(name, getattr(F, name)))

    def note_masked_mean(self, name: str, args, kwargs) -> None:
        """`cross_entropy(..., ignore_index=i)` with reduction 'mean' divides by the targets
        not ignored. When the batch holds ignored targets, each process divides by its own
        count and DDP averages those means, which is not the whole batch's mean."""
        if kwargs.get("reduction", "mean") != "mean" or kwargs.get("weight") is not None:
            return
        target = args[1] if len(args) > 1 else kwargs.get("target")
        ignore = kwargs.get("ignore_index", -100)
        torch = self.torch
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return
        if bool((target == ignore).any()):
            self.flag("masked_mean", f"{name}(..., ignore_index={ignore})")

    def attention_with_aligned_dropout(self, fused):
        """scaled_dot_product_attention written out when it drops out, so its mask is aligned.

        nn.MultiheadAttention calls it (need_weights=False) or F.dropout (need_weights=True),
        both through torch.nn.functional's globals, so both paths come here.
        """
        torch = self.torch
        F = torch.nn.functional

        def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            if dropout_p <= 0:
                return fused(query, key, value, attn_mask, dropout_p, is_causal, **kw)
            scale = kw.get("scale")
            if kw.get("enable_gqa"):
                repeat = query.size(-3) // key.size(-3)
                key = key.repeat_interleave(repeat, -3)
                value = value.repeat_interleave(repeat, -3)
            scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
            weights = query @ key.transpose(-2, -1) * scale
            length, source = query.size(-2), key.size(-2)
            if is_causal:
                causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
                weights = weights.masked_fill(~causal, float("-inf"))
            if attn_mask is not None:
                if attn_mask.dtype == torch.bool:
                    weights = weights.masked_fill(~attn_mask, float("-inf"))
                else:
                    weights = weights + attn_mask
            weights = F.dropout(torch.softmax(weights, dim=-1), p=dropout_p)
            return weights @ value

        return attention

    # -- BatchNorm -----------------------------------------------------------------------------

    def patch_batch_norm(self, F) -> None:
        from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm

        probe = self
        native = F.batch_norm
        self.sync_depth = 0

        def batch_norm(input, running_mean, running_var, weight=None, bias=None, *args, **kw):
            training, momentum, eps = batch_norm_options(args, kw)
            if not training and running_mean is not None:
                return native(input, running_mean, running_var, weight, bias, *args, **kw)
            probe.flag("batch_norm")
            sync = probe.sync_batch_norm(input)
            return python_batch_norm(
                probe.torch, input, running_mean, running_var, weight, bias, momentum, eps, sync
            )

        F.batch_norm = batch_norm

        def sync_forward(module, input):
            # SyncBatchNorm's own path needs CUDA; its math is done by batch_norm above.
            probe.sync_depth += 1
            try:
                return _BatchNorm.forward(module, input)
            finally:
                probe.sync_depth -= 1

        SyncBatchNorm.forward = sync_forward

    def sync_batch_norm(self, input):
        """Whether this batch-statistics BatchNorm call all-reduces its statistics (True, or
        in the per-rank reference the function that sums over its processes)."""
        dist = self.torch.distributed
        if self.role == "reference" and self.world > 1:
            if self.config.get("converted_sync_bn"):  # the conversion's SyncBatchNorm, too
                self.flag("sync_bn", "as the conversion")
                return self.reference.summed
            self.flag("local_bn")  # each reference process normalises its own share
            return False
        if self.role != "converted" or not (dist.is_available() and dist.is_initialized()):
            return False
        if dist.get_world_size() < 2:
            return False
        if self.sync_depth:
            self.flag("sync_bn", "SyncBatchNorm")
            return True
        if input.device.type == "cpu" and self.script_converts_sync_bn:
            self.flag("sync_bn", "emulated")
            return True
        self.flag("local_bn")
        return False

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
        self.check_rng()
        step = opt._ddpify_steps + 1
        if step == 1:
            self.record["initial"][index] = [snapshot(p) for p in self.params(opt)]
            self.record["names"][index] = parameter_names(self.params(opt), self.torch)
            # which tensors optimizers share (compare replays them together; names can clash)
            self.record.setdefault("param_ids", {})[index] = [id(p) for p in self.params(opt)]
            self.record["optimizers"][index]["groups"] = group_settings(opt)
        if self.reference is not None:
            self.reference.average(opt)
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
                # the weights this step's gradients were computed at (step 1's are "initial")
                "weights": [snapshot(p) for p in self.params(opt)] if step > 1 else None,
                "loader": self.last_loader,
                "data": list(data) if data else None,
                "split": self.pending_split,
                "padded": self.padded_pending.get(self.last_loader, 0),
            }
        )
        self.pending_data.clear()
        self.pending_split = None
        self.padded_pending.clear()

    def lr_scale(self, opt, native_lrs: list[float]) -> float:
        """The original's LR multiplier, decided at its first step and kept for every step."""
        if self.role == "converted":
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
        self.scaled_grads_pending = False
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
            # every optimizer's steps: the run stops at optimizer 0's K-th step, and a
            # script steps its others as often as it likes meanwhile (a critic n times)
            "optimizer_steps": [
                sum(1 for s in self.record["steps"] if s["optimizer"] == index)
                for index in range(len(self.optimizers))
            ],
            "batch_sizes": [loader["batch_size"] for loader in self.loaders],
            "loaders": [
                {
                    "batch_size": loader["batch_size"],
                    "sampler": loader["sampler"],
                    "aligned_stream": loader["aligned_stream"],
                    **loader["sampler_settings"],
                }
                for loader in self.loaders
            ],
            "first_lrs": [first_lrs.get(i, []) for i in range(len(self.optimizers))],
            # how BatchNorm ran, which the per-rank reference repeats
            "sync_bn": self.record["flags"].get("sync_bn"),
            "local_bn": self.record["flags"].get("local_bn"),
        }


class RandomDraws:
    """Random draws made equal across 1 and N processes: each rank draws the whole, keeps a slice.

    Every process starts from the same seed, so the generators stay in step as long as each
    process draws the same numbers. A draw with the current per-process batch size `rows` in
    one dimension is made at `world` times that size there, which is the single process's
    draw, and rank r keeps the rows of its samples (see rank_part). Before the first batch
    nothing is sliced. Each draw's whole shape is recorded; compare.py checks the original drew
    exactly those shapes in that order, so a wrong guess of the batch dimension reads as
    inconclusive, never a pass.
    """

    def __init__(self, probe) -> None:
        self.probe = probe
        self.native = {name: getattr(probe.torch, name) for name in ("rand", "randn")}
        self.rows: int | None = None  # the leading size of the last training batch
        # (start, whole batch rows) when the batch is this rank's contiguous block of a
        # hand-made batch; None when a DistributedSampler dealt the samples out in turn
        self.block: tuple[int, int] | None = None
        self.record: list = probe.record["draws"]
        self.sliced = 0
        # The original's draws in order ([kind, shape, ...]), when verify runs the converted
        # script again to follow them: a draw the original made at this rank's own shape is
        # made whole here too (a literal 1 is no per-process batch of 1).
        self.original_draws: list | None = getattr(probe, "config", {}).get("original_draws")
        self.made = 0  # draws made outside a seeded fetch, recorded or not
        self.followed = 0

    def batch_dim(self, shape, kind: str) -> int | None:
        rows, world = self.rows, self.probe.world
        if not rows or world < 2 or self.probe.role == "original":
            return None
        exact = [d for d, size in enumerate(shape) if size == rows]
        if len(exact) == 1 or (exact and kind != "dropout"):
            return exact[0]
        # Attention weights are (batch * heads, L, S): the batch leads, as a multiple.
        if kind == "dropout" and shape and shape[0] % rows == 0:
            return 0
        return None

    def fingerprint(self, device) -> str:
        """The generator's state before a draw: equal in both runs when they are in step."""
        if device is NUMPY:
            _, key, position, *_ = sys.modules["numpy"].random.get_state()
            return hashlib.blake2b(key.tobytes() + bytes(str(position), "ascii")).hexdigest()[:16]
        torch = self.probe.torch
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            state = torch.cuda.get_rng_state(device)
        else:
            state = torch.get_rng_state()
        # bytes(tolist()): a script without numpy installed has no Tensor.numpy().
        return hashlib.blake2b(bytes(state.tolist()), digest_size=8).hexdigest()

    def draw(self, make, shape, kind: str, device=None, whole: bool = False):
        """`make(full_shape)` draws; returns this rank's part of the single process's draw
        (all of it when `whole`: a draw whose size does not follow the batch)."""
        probe = self.probe
        shape = tuple(int(size) for size in shape)
        if probe.seeding_depth:
            return make(shape)  # a sample's own augmentation, seeded from its index
        dim = None if whole else self.batch_dim(shape, kind)
        if dim is not None and self.original_drew(self.made, shape):
            dim = None
            self.followed += 1
            probe.record["flags"]["followed_draws"] = self.followed
        self.made += 1
        full = list(shape)
        if dim is not None:
            full[dim] = self.whole_size(shape[dim])
        probe.check_rng()
        state = self.fingerprint(device)
        tensor = make(tuple(full))
        probe.rng_drawn()
        if len(self.record) < MAX_DRAWS_RECORDED:
            first = probe.optimizers[0] if probe.optimizers else None
            steps = getattr(first, "_ddpify_steps", 0)
            self.record.append([kind, full, dim, state, steps, list(shape)])
        if dim is None:
            return tensor
        self.sliced += 1
        probe.record["flags"]["sliced_draws"] = self.sliced
        return self.rank_part(tensor, dim, shape[dim])

    def original_drew(self, index: int, shape: tuple) -> bool:
        """Whether the original's draw `index` had exactly this rank's shape: its size does
        not follow the batch, so every rank makes it whole, as the single process did."""
        drawn = self.original_draws
        return drawn is not None and index < len(drawn) and list(drawn[index][1]) == list(shape)

    def whole_size(self, size: int) -> int:
        """The single process's size of a batch dimension of `size` (rows, or rows * m)."""
        if self.block is None:
            return size * self.probe.world
        return size // self.rows * self.block[1]

    def rank_part(self, tensor, dim: int, size: int):
        """Rank r's rows of the whole draw. The DistributedSampler deals samples out in turn
        (rank r gets samples r, r + N, ...), so row j of the single process's batch is row
        j // N of rank j % N; a hand-made batch split by rank gives rank r one contiguous
        block (`block`). A dim of `rows * m` (batch times heads) keeps its m together.
        Works on tensors and on numpy arrays."""
        probe, rows = self.probe, self.rows
        shape = list(tensor.shape)
        if self.block is not None:  # a contiguous block: rows start.. of the whole batch
            first = self.block[0] * (size // rows)
            part = tensor[(slice(None),) * dim + (slice(first, first + size),)]
            return part.contiguous() if isinstance(part, probe.torch.Tensor) else part.copy()
        split = shape[:dim] + [rows, probe.world, size // rows] + shape[dim + 1 :]
        grouped = tensor.reshape(split)
        if isinstance(tensor, probe.torch.Tensor):
            part = grouped.select(dim + 1, probe.rank)
            return part.reshape(shape[:dim] + [size] + shape[dim + 1 :]).contiguous()
        part = grouped.take(probe.rank, axis=dim + 1)
        return part.reshape(shape[:dim] + [size] + shape[dim + 1 :]).copy()

    def patch_numpy(self) -> None:
        """numpy.random's global draws (`np.random.normal(0, 1, (batch, z))`), sliced alike."""
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return
        for name, position in NUMPY_SIZED_DRAWS.items():
            native = getattr(numpy.random, name, None)
            if native is not None:
                setattr(numpy.random, name, self.numpy_draw(numpy, native, name, position))
        for name in NUMPY_WHOLE_DRAWS:
            native = getattr(numpy.random, name, None)
            if native is not None:
                setattr(numpy.random, name, self.numpy_whole_draw(numpy, native, name))

    def numpy_whole_draw(self, numpy, native, name: str):
        """`np.random.permutation(n)`, `np.random.shuffle(x)`: every run makes the same draw
        from the same generator state, recorded (its length as its shape) so compare checks
        the runs were in step when they made it."""

        def draw(x, *args, **kwargs):
            length = int(x) if numpy.ndim(x) == 0 and not hasattr(x, "__len__") else len(x)
            return self.draw(lambda _: native(x, *args, **kwargs), (length,), name, NUMPY, True)

        return draw

    def numpy_draw(self, numpy, native, name: str, position: int):
        def draw(*args, **kwargs):
            size = kwargs.pop("size", args[position] if len(args) > position else None)
            args = args[:position]
            params = list(args) + [v for k, v in kwargs.items() if k != "dtype"]
            if size is None or any(numpy.ndim(p) for p in params):
                return native(*args, size=size, **kwargs)  # a scalar, or per-element params
            shape = (size,) if isinstance(size, int) else tuple(size)
            made = self.draw(lambda full: native(*args, size=full, **kwargs), shape, name, NUMPY)
            return made

        return draw

    def uniform(self, shape, device, kind: str):
        rand = self.native["rand"]
        return self.draw(lambda full: rand(full, device=device), shape, kind, device)

    def patch(self, torch) -> None:
        """torch.randn/rand/randint and randn_like/rand_like; other draws stay the script's own."""
        for name in ("randn", "rand"):
            setattr(torch, name, self.creation(getattr(torch, name), name))
        for name in ("randn_like", "rand_like"):
            maker = self.native[name.removesuffix("_like")]
            setattr(torch, name, self.like(getattr(torch, name), maker, name))
        torch.randint = self.randint(torch.randint)

    def randint(self, native):
        """torch.randint([low,] high, size): the size is the last positional or `size=`."""

        def draw(*args, **kwargs):
            if "size" in kwargs:
                size = kwargs.pop("size")
            elif args and not isinstance(args[-1], int):
                size, args = args[-1], args[:-1]
            else:
                return native(*args, **kwargs)

            def call(full):
                # `randint(low=0, high=n, size=s)`: with low/high given by keyword, the
                # size must be one too (no positional argument may follow them).
                if "low" in kwargs or "high" in kwargs:
                    return native(*args, size=full, **kwargs)
                return native(*args, full, **kwargs)

            if kwargs.get("generator") is not None or kwargs.get("out") is not None:
                return call(size)
            grad = kwargs.pop("requires_grad", False)
            device = kwargs.get("device")
            tensor = self.draw(call, size, "randint", device)
            return tensor.requires_grad_(True) if grad else tensor

        return draw

    def creation(self, native, name: str):
        def draw(*size, **kwargs):
            if kwargs.get("generator") is not None or kwargs.get("out") is not None:
                return native(*size, **kwargs)
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            if "size" in kwargs:
                shape = kwargs.pop("size")
            grad = kwargs.pop("requires_grad", False)
            device = kwargs.get("device")
            tensor = self.draw(lambda full: native(full, **kwargs), shape, name, device)
            return tensor.requires_grad_(True) if grad else tensor

        return draw

    def like(self, native, maker, name: str):
        def draw(input, **kwargs):
            if kwargs.get("generator") is not None or kwargs.get("layout") is not None:
                return native(input, **kwargs)
            grad = kwargs.pop("requires_grad", False)
            kwargs.pop("memory_format", None)
            kwargs.setdefault("dtype", input.dtype)
            kwargs.setdefault("device", input.device)
            device = kwargs["device"]
            tensor = self.draw(lambda full: maker(full, **kwargs), input.shape, name, device)
            return tensor.requires_grad_(True) if grad else tensor

        return draw


def beside_this_file(module: str):
    """A module of the probe's own beside this file (the probe runs without ddpify)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.pop(0)


def reference_rank(probe):
    """The per-rank reference's side of this process (probe_reference.py, beside this file)."""
    rank = beside_this_file("probe_reference").ReferenceRank(probe)
    rank.install()
    return rank


def sums_over_batch(kwargs: dict) -> bool:
    """A loss called with `reduction="sum"`, or its legacy spelling `size_average=False`
    (with `reduce` left on: `reduce=False` gives one loss per sample)."""
    if kwargs.get("reduction") == "sum":
        return True
    return kwargs.get("size_average") is False and kwargs.get("reduce") is not False


def block_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s rows of a batch of `rows`, as `ddpify migrate` splits hand-made batches."""
    return rank * rows // world, (rank + 1) * rows // world


def fetches_per_sample(dataset) -> bool:
    """Whether the DataLoader fetches this dataset one `dataset[i]` at a time: no
    `__getitems__`, or torch's own Subset over such a dataset (its `__getitems__` is a loop
    over `dataset[indices[i]]`)."""
    from torch.utils.data import Subset

    if not getattr(dataset, "__getitems__", None):
        return True
    if isinstance(dataset, Subset) and type(dataset).__getitems__ is Subset.__getitems__:
        return fetches_per_sample(dataset.dataset)
    return False


def sample_seed(index, pass_number: int) -> int:
    """A 32-bit seed (numpy takes no more) from the probe's seed, the sample's index and the
    pass over its loader; the same in every process that fetches the sample."""
    try:
        key = str(operator.index(index))  # numpy and torch integers read as the int
    except TypeError:
        key = repr(index)
    text = f"{SEED}/{key}/{pass_number}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


def feature_mask_shape(input, batched_dims):
    """The shape of a dropout mask, as torch draws it: the input's for plain dropout
    (`batched_dims` 0); (N, C, 1, ...) for channel dropout of a batched input. dropout1d and
    dropout3d take any other input as one sample, channels first (mask (C, 1, ...));
    dropout2d (`batched_dims` None) takes any input as batched, so on (N, C) it is
    element-wise."""
    dims = input.dim()
    if batched_dims == 0:
        return tuple(input.shape)
    if dims < 2:
        return None
    if batched_dims is None or dims == batched_dims:
        return tuple(input.shape[:2]) + (1,) * (dims - 2)
    return tuple(input.shape[:1]) + (1,) * (dims - 1)


def batch_norm_options(args, kwargs) -> tuple[bool, float, float]:
    """(training, momentum, eps) from F.batch_norm's arguments after weight and bias."""
    names = ("training", "momentum", "eps")
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    return bool(values.get("training", False)), values.get("momentum", 0.1), values.get("eps", 1e-5)


def python_batch_norm(torch, input, running_mean, running_var, weight, bias, momentum, eps, sync):
    """Batch normalisation with batch statistics, optionally summed over all ranks (autograd
    through the all-reduce: SyncBatchNorm's math). Two passes, mean then variance. `sync` is
    False, True (over the default group) or a function summing a tensor over the ranks with
    autograd (the per-rank reference's own group)."""
    from torch.distributed.nn.functional import all_reduce

    def total(tensor):
        if callable(sync):
            return sync(tensor)
        return all_reduce(tensor) if sync else tensor

    x = input if input.dtype == torch.float64 else input.float()  # float64 stays exact
    dims = [0, *range(2, x.dim())]
    shape = [1, x.size(1)] + [1] * (x.dim() - 2)
    count = torch.tensor([x.numel() / x.size(1)], dtype=torch.float64, device=x.device)
    if callable(sync):
        count = sync(count)
    elif sync:
        torch.distributed.all_reduce(count)
    n = float(count.item())
    mean = total(x.sum(dims)) / n
    centred = x - mean.reshape(shape)
    var = total((centred * centred).sum(dims)) / n
    out = centred * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        out = out * weight.to(x.dtype).reshape(shape)
    if bias is not None:
        out = out + bias.to(x.dtype).reshape(shape)
    if running_mean is not None and momentum is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(
                mean.detach().to(running_mean.dtype), alpha=momentum
            )
            unbiased = var.detach() * (n / max(n - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out.to(input.dtype)


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


def after_import(names, patch) -> None:
    """Call patch(module) on each module of `names` now if imported, else once it is."""
    import importlib.abc
    import importlib.util

    for name in names:
        if name in sys.modules:
            patch(sys.modules[name])

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in names:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def group_settings(opt) -> list[dict]:
    """Each param group's size and plain hyperparameters, so compare can replay the optimizer."""
    groups = []
    for group in opt.param_groups:
        settings = {"params": len(group["params"])}
        for key, value in group.items():
            if key == "params" or key.startswith("_ddpify"):
                continue
            if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
                value = value.item()
            if value is None or isinstance(value, (bool, int, float, str)):
                settings[key] = value
            elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                settings[key] = value
        groups.append(settings)
    return groups


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


class ProjectFiles:
    """The script and the local modules it imports, discovered once, when first asked for:
    every probe question about the project (SyncBatchNorm, hand splits, batch comparisons)
    reads the same discovery instead of walking the imports again."""

    def __init__(self, script: str) -> None:
        self.script = script
        self._discovered = False
        self._modules: list[tuple] | None = None

    def modules(self) -> list[tuple] | None:
        """(path, text) of each module, the script first; None when one cannot be read."""
        if not self._discovered:
            self._discovered = True
            try:
                from ddpify.analysis.project import Project

                found = Project.discover([self.script]).modules.values()
                self._modules = [(module.path, module.text) for module in found]
            except Exception:  # an unreadable module: callers fall back to the script alone
                self._modules = None
        return self._modules


def project_mentions_sync_batch_norm(script: str, files: ProjectFiles | None = None) -> bool:
    """The script, or a local module it imports (a project migrated as a whole converts
    where its model is wrapped, e.g. exp/exp_forecast.py), names SyncBatchNorm."""
    return project_mentions(script, mentions_sync_batch_norm, files)


def project_mentions(script: str, mentions, files: ProjectFiles | None = None) -> bool:
    """Whether `mentions(path)` holds for the script or a local module it imports."""
    if mentions(script):
        return True
    modules = (files or ProjectFiles(script)).modules()
    if modules is None:  # judge by the script alone
        return False
    return any(mentions(str(path)) for path, _ in modules[1:])


def project_batch_couplings(script: str, files: ProjectFiles | None = None) -> dict[str, str]:
    """The first of each kind of batch coupling (ddpify.analysis.batch_coupling) in the
    script or a local module it imports, as `code (file:line)`, by the probe's flag:
    `batch_comparison` (a batch's rows compared with each other, a contrastive loss) and
    `setting_grouping` (rows grouped by a batch-size setting, then compared). Each module
    is parsed once."""
    import libcst as cst
    import libcst.metadata

    from ddpify.analysis.batch_coupling import batch_comparisons, setting_groupings
    from ddpify.analysis.tree import Tree

    questions = {"batch_comparison": batch_comparisons, "setting_grouping": setting_groupings}
    found: dict[str, str] = {}
    for path, text in (files or ProjectFiles(script)).modules() or []:
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError:
            continue
        tree = Tree(module)
        for flag, question in questions.items():
            nodes = [] if flag in found else question(tree)
            if nodes:
                # Its own line, not that of the first text like it (a docstring may quote it).
                wrapper = cst.metadata.MetadataWrapper(module, unsafe_skip_copy=True)
                line = wrapper.resolve(cst.metadata.PositionProvider)[nodes[0]].start.line
                found[flag] = f"{tree.code(nodes[0])} ({path.name}:{line})"
    return found


def setting_sizes_scaled(source: bytes, scale: str) -> bytes:
    """The script with each read of its training loader's batch-size setting that sizes a
    tensor in a training loop (ddpify.analysis.batch_coupling.setting_sized_tensors) scaled
    as the probe scales that loader's batch (`scale`: `// 2`, `* 2`), so the step sizes its
    tensors for the rows it gets, as the script would with that batch size set:
    - the per-rank reference under the global batch policy deals each process
      `setting // N` rows (the conversion sizes them so too);
    - the one-process original under the per-rank policy takes `setting * N` rows.
    Unchanged when there is none."""
    import libcst as cst

    from ddpify.analysis.batch_coupling import setting_sized_tensors
    from ddpify.analysis.tree import Tree

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return source
    reads = {id(node) for node in setting_sized_tensors(Tree(module))}
    if not reads:
        return source

    class PerProcess(cst.CSTTransformer):
        def on_leave(self, original, updated):
            if id(original) not in reads:
                return updated
            code = module.code_for_node(original)
            return cst.parse_expression(f"({code} {scale})")

    return module.visit(PerProcess()).code.encode(module.encoding)


def mentions_hand_split(path: str) -> bool:
    """Whether a `# ddpify:` comment of the file says the migration split hand-made batches
    by rank (HAND_SPLIT_MARKER, the note `ddpify migrate` writes above the split)."""
    import tokenize

    try:
        with open(path, "rb") as handle:
            for token in tokenize.tokenize(handle.readline):
                text = token.string.lower()
                if token.type == tokenize.COMMENT and "ddpify" in text:
                    if HAND_SPLIT_MARKER in text:
                        return True
    except (OSError, SyntaxError, tokenize.TokenError):
        return False
    return False


def mentions_sync_batch_norm(path: str) -> bool:
    """Whether the script's code (not its comments or strings) names SyncBatchNorm or
    convert_sync_batchnorm: migrate writes the conversion under a CUDA guard."""
    import tokenize

    try:
        with open(path, "rb") as handle:
            for token in tokenize.tokenize(handle.readline):
                if token.type == tokenize.NAME and token.string in SYNC_BN_NAMES:
                    return True
    except (OSError, SyntaxError, tokenize.TokenError):
        return False
    return False


def die_with_parent() -> None:
    """Under torchrun the workers live in their own sessions; make them die with the agent."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def setting_scale(role: str, policy: str | None, world: int, nproc) -> str | None:
    """How the probe scales the batch a training loader yields, where it does, as text to
    append to a batch-size setting (setting_sizes_scaled): the per-rank reference under the
    global policy divides it by the processes, the one-process original under the per-rank
    policy multiplies it by them."""
    if role == "reference" and policy == "global" and world > 1:
        return f"// {world}"
    if role == "original" and policy == "per-rank" and int(nproc) > 1:
        return f"* {int(nproc)}"
    return None


def run_script(path: str, argv: list[str], display_path: str, transform=None) -> None:
    with open(path, "rb") as handle:
        source = handle.read()
    if transform is not None:
        source = transform(source)
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
    files = ProjectFiles(script)
    probe.script_converts_sync_bn = project_mentions_sync_batch_norm(script, files)
    probe.script_splits_batches = project_mentions(script, mentions_hand_split, files)
    if probe.role == "converted" and probe.world > 1:
        for flag, where in project_batch_couplings(script, files).items():
            probe.flag(flag, where)
    transform = None
    policy, nproc = config.get("batch_policy"), config.get("nproc") or 1
    scale = setting_scale(probe.role, policy, probe.world, nproc)
    if scale is not None:

        def transform(source: bytes) -> bytes:
            changed = setting_sizes_scaled(source, scale)
            if changed != source:
                probe.flag("scaled_setting", scale)
            return changed

    probe.install()
    try:
        run_script(script, argv, config.get("display_path") or script, transform)
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
