"""The per-rank reference: the ORIGINAL script run as its own DDP, by the probe, under torchrun.

Some conversions are right and still compute what no single process computes: BatchNorm
with each process's own statistics, a contrastive loss over the rows each process holds, an
adaptive ODE solver choosing its steps from the error of each process's shard, random draws
whose size is the per-process batch. For those, verify runs the unchanged original on the
same N processes, and the probe (not the migration) gives it DDP's semantics:
- data: rank r is dealt exactly the samples the converted rank r gets, rank r's share of
  the canonical permutation (a DistributedSampler in place of the original's shuffle or
  sequential order, a new epoch at each pass), at the converted run's per-process batch size;
- gradients: averaged over the N processes (each divided by N, then summed, as DDP's
  all-reduce does) after the backward passes and before anything reads them, i.e. before
  gradient clipping and before every optimizer step;
- initial weights: every process seeds and builds the model alike; rank 0's are broadcast at
  the first averaging and each rank checks its own were equal (flag `reference_weights`
  when not: then the reference is not DDP's start and the comparison says so);
- random draws are made as the converted rank makes them (probe.RandomDraws, whole then this
  rank's part); BatchNorm keeps each process's statistics, or sums them over the processes
  (SyncBatchNorm's math) where the converted run did.

The script sees a plain single process: torchrun's variables are taken out of its
environment, and the processes meet on a gloo group of the probe's own (not the default
group, which the script may make or test for itself).

Like probe.py, this file needs only the standard library and torch.
"""

import datetime
import os

# What torchrun sets in its workers' environment; the original runs as one plain process.
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
)
STORE_PREFIX = "ddpify-reference/"
GROUP_TIMEOUT_SECONDS = 600  # the launcher's own timeout stops a hung run before this


class ReferenceRank:
    """One process of the per-rank reference: its gloo group, its data share, its averaging."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.torch = probe.torch
        self.rank, self.world = probe.rank, probe.world
        self.group = self.join_group()
        self.pending: set[int] = set()  # optimizers with gradients not averaged since backward
        self.checked: set[int] = set()  # optimizers whose initial weights were checked
        for name in TORCHRUN_ENV:
            os.environ.pop(name, None)

    def join_group(self):
        """A gloo group of the N processes on torchrun's store, beside the script's own."""
        dist = self.torch.distributed
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        )
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_SECONDS)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        return dist.ProcessGroupGloo(prefixed, self.rank, self.world, timeout)

    def install(self) -> None:
        self.watch_backward()

    # -- data ------------------------------------------------------------------------------

    def sampler(self, dataset, theirs: dict):
        """The sampler giving this process the converted rank's share: a DistributedSampler
        with the converted one's settings, whose epoch moves on at each pass over it (the
        conversion calls set_epoch; the probe numbers epochs in order of first use)."""
        from torch.utils.data import DistributedSampler

        class ReferenceShare(DistributedSampler):
            passes = 0

            def __iter__(self):
                self.set_epoch(self.passes)
                self.passes += 1
                return super().__iter__()

        return ReferenceShare(
            dataset,
            num_replicas=self.world,
            rank=self.rank,
            shuffle=bool(theirs.get("shuffle")),
            drop_last=bool(theirs.get("drop_last")),
        )

    def stream_share(self, dataset):
        """The converted rank's items of a stream its conversion shards round-robin
        (migrate's stream pass): every WORLD-th item from this rank, a last round of fewer
        than WORLD items dropped, and a length of this rank's share."""
        from torch.utils.data import IterableDataset

        rank, world = self.rank, self.world

        class ReferenceStreamShare(IterableDataset):
            def __iter__(self):
                round_items = []
                for item in dataset:
                    round_items.append(item)
                    if len(round_items) == world:
                        yield round_items[rank]
                        round_items = []

            def __len__(self):
                return len(dataset) // world  # a TypeError, as before, if it has none

        return ReferenceStreamShare()

    # -- BatchNorm -------------------------------------------------------------------------

    def summed(self, tensor):
        """`tensor` summed over the processes, with autograd (the backward sums the gradients
        too): what SyncBatchNorm does to its statistics, where the conversion has it."""
        group = self.group

        class SumOverRanks(self.torch.autograd.Function):
            @staticmethod
            def forward(ctx, value):
                total = value.clone()
                group.allreduce([total]).wait()
                return total

            @staticmethod
            def backward(ctx, grad):
                total = grad.clone()
                group.allreduce([total]).wait()
                return total

        return SumOverRanks.apply(tensor)

    # -- gradients -------------------------------------------------------------------------

    def watch_backward(self) -> None:
        """Every backward pass leaves every optimizer's gradients to average."""
        autograd = self.torch.autograd
        native = autograd.backward
        reference = self

        def backward(*args, **kwargs):
            result = native(*args, **kwargs)
            reference.pending.update(range(len(reference.probe.optimizers)))
            return result

        autograd.backward = backward

    def average_pending(self) -> None:
        """Average every optimizer's gradients a backward pass left (before clipping)."""
        for opt in list(self.probe.optimizers):
            self.average(opt)

    def average(self, opt) -> None:
        """DDP's all-reduce of `opt`'s gradients: each divided by N, then summed over ranks.
        Gradients already averaged are equal on every rank, so averaging them again after a
        further backward pass (gradient accumulation) keeps them."""
        index = opt._ddpify_index
        if index not in self.pending:
            return
        self.pending.discard(index)
        params = [p for group in opt.param_groups for p in group["params"]]
        if index not in self.checked:
            self.checked.add(index)
            self.start_from_rank_zero(params)
        grads = [p.grad for p in params if p.grad is not None]
        for same_kind in self.by_dtype_and_device(grads):
            flat = self.torch.cat([g.reshape(-1) for g in same_kind]).div_(self.world)
            self.group.allreduce([flat]).wait()
            offset = 0
            for grad in same_kind:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def by_dtype_and_device(self, tensors: list) -> list[list]:
        kinds: dict = {}
        for tensor in tensors:
            kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        return list(kinds.values())

    def start_from_rank_zero(self, params) -> None:
        """DDP starts every process from rank 0's weights. The processes built them alike from
        one seed; say so if they did not, and give them rank 0's (as DDP's broadcast would,
        but after a forward pass that used their own: so the flag makes it inconclusive)."""
        with self.torch.no_grad():
            for param in params:
                mine = param.detach().clone()
                self.group.broadcast(param.data, 0).wait()
                if not self.torch.equal(mine, param.data):
                    self.probe.flag("reference_weights", self.rank)
        self.probe.flag("reference_weights_checked")
