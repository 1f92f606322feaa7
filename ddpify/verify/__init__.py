"""`ddpify verify`: prove a migration right by running both scripts and comparing gradients.

The converted script runs first, under torchrun with N processes; then the original runs as one
process. A probe (probe.py) is started in front of each script, so the scripts are not edited; it
hooks the optimizer steps, the DataLoader and a few functionals, and stops every process after
K optimizer steps. Then compare.py checks like with like, as PyTorch's DDP parity tests do.

Same start: every process is seeded identically before the script runs, the scripts seed
themselves as they do, and the initial weights are compared (original vs rank 0, every rank vs
rank 0), so a conversion whose ranks start from different weights fails at step 1.

Same data: the reference is the original's own data order. RandomSampler (the original's
shuffle=True) and DistributedSampler(shuffle=True) both draw from one canonical permutation
per epoch, so at step i the N ranks together must hold exactly the samples of the original's
batch i; a conversion without a DistributedSampler shows every rank the same batch and fails.
Epochs count in the order set_epoch is first called with a new value, so a missing set_epoch
fails at the first step of the second epoch.

Batch policy and learning rate:
- "per-rank": each process keeps the original batch size b, so the original runs at N*b
  (its DataLoader's batch size is multiplied). The migration may scale the LR (linear: N,
  sqrt: sqrt(N)). Gradients do not depend on the LR, but the weights after step 1 do, and so
  every later gradient; so instead of undoing the scaling in the converted run, the original
  runs each step at its own learning rate (schedulers included) times the scale, restored after
  the step. The scale is `lr_scale` when given; otherwise the one of 1, N, sqrt(N) that maps
  the original's first-step LR onto the converted's. Any other LR difference is a mismatch.
- "global": each process gets b // N, the original runs unchanged, the LR must be equal.
- "auto" (the CLI's default when the converted script carries no ddpify marker): whichever of
  the two the converted script's first DataLoader batch size fits.

Randomness: both runs start from one seed, so their generators stay in step as long as they
draw the same numbers. A draw in the training loop with the per-process batch size in one
dimension (`torch.randn(batch, z_dim)`, `rand`, the `*_like` forms, dropout masks, attention
dropout inside nn.MultiheadAttention) is made whole on every rank, at the single process's
shape, and each rank keeps the rows of its own samples; the original must have made exactly
those draws from the same generator state, else the result is inconclusive. Alpha dropout is
switched off. Random augmentation in a map-style dataset is drawn per sample: each
`dataset[i]` the DataLoader fetches runs with torch's CPU generator, `random` and numpy's
global generator seeded from (i, which pass over the loader this is), and restored after
it, so sample i is augmented alike whichever process fetches it and data loading leaves the
loop's generators alone (a pass, not a count of fetches: the samples a DistributedSampler
repeats to pad an epoch or drops with drop_last do not shift later epochs). A generator the
script makes without a seed (`np.random.default_rng()`, fresh OS entropy) gets the same seed
in both runs. Other random numbers drawn by the data pipeline (collate_fn, a sampler, a
dataset's own `__getitems__`, an IterableDataset) or between steps, and sum-reduced losses,
make the result inconclusive (exit 2), never a pass.

Hand-made batches: where `ddpify migrate` split a batch the script makes itself (no
DataLoader) by rank, `x[RANK * len(x) // WORLD_SIZE : ...]` under its `# ddpify: batch
policy global: each rank its rows of the batch` note, the probe recognises the split in the
converted run: the draws shaped by the per-process batch are made whole and each rank keeps
its contiguous block, and every rank must have split the same batch (else a data mismatch).
The original runs its batches unchanged, so a difference is a mismatch, not inconclusive.

Padding: when the dataset does not divide by N, the DistributedSampler repeats samples to pad
the epoch; the first step that trains on them, and every step after it, are not compared
(the weights those steps start from are compared instead), and the notes say so.

BatchNorm: in training mode both runs compute batch statistics with the same Python code; the
converted run all-reduces them across the ranks (SyncBatchNorm's math, autograd included) for
SyncBatchNorm modules, and on CPU for plain BatchNorm when the script converts to SyncBatchNorm
on CUDA only (as `ddpify migrate` writes it). A conversion without SyncBatchNorm keeps each
rank's own statistics, which no single process computes: the comparison with one process is
inconclusive and names that cause (data and learning-rate differences still fail), and the
per-rank reference settles it.

Per-rank reference (per_rank.py, probe_reference.py): when the comparison with one process is
inconclusive only because DDP computes by design what one process cannot (per-process
BatchNorm statistics, a loss comparing a batch's rows with each other, an adaptive ODE solver,
a random draw sized by the per-process batch), the original runs a third time, under torchrun
on the same N processes, as its own DDP: the probe deals rank r the converted rank r's samples
at its batch size, draws as the converted rank draws, averages the gradients over the ranks
before clipping and each optimizer step, and checks that the ranks start from rank 0's
weights. The conversion compared with that is a match (`reference: per-rank`, said in the
message) or a mismatch; an inconclusive comparison or a reference that cannot run leaves the
one-process result.

Weights that drift apart: an adaptive optimizer (Adam) turns gradient rounding near its eps
into steps of up to the learning rate, so after matching gradients the runs may continue from
weights that differ past the tolerance, and their later gradients differ too. At the first
step whose gradients differ from weights that drifted, the comparison ends when replaying
each run's optimizer steps (in the order taken, optimizers sharing parameters over the same
tensors) on its own recorded gradients reproduces both runs' weights there and the optimizers'
settings agree: the verdict covers the steps before it, and the learning rate, the data and
the ranks' agreement are still checked at every step. Otherwise it is inconclusive.

Fixed bugs: the original runs with the number-changing fixes the migration made (unscale_
before clipping, set_epoch), applied by ddpify's own rule fixes to a temporary copy
(original_fixes.py), and the notes say which.

Devices: a GPU per process, the scripts run as they are (nccl). Fewer GPUs than processes (one
H100, two ranks): the ranks share them, LOCAL_RANK mapped onto the GPUs there are and the
process group on gloo over CUDA tensors (NCCL refuses two ranks on one device), so the GPU and
AMP paths are compared too. No GPU: CPU, said in the notes.

Exit codes: 0 match, 1 mismatch, 2 could not run or inconclusive.
"""

from __future__ import annotations

from ddpify.verify.report import VerifyResult
from ddpify.verify.runner import run_verify

__all__ = ["VerifyResult", "run_verify"]
