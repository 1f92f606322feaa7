"""Calls whose effect every rank of a DDP run repeats unless a rank-0 guard keeps them to
one process: writers of a file (checkpoints, sample images) and where their path argument
is, objects whose `.save(path)` writes one, and progress lines written straight to the
terminal. DDP050 and DDP052 and migrate's rank-zero pass read these same tables."""

from __future__ import annotations

# Checkpoint writers: (keyword, position) of the path argument.
CHECKPOINT_WRITERS = {
    "torch.save": ("f", 1),
    "torch.jit.save": ("f", 1),
    "safetensors.torch.save_file": ("filename", 1),
    "safetensors.torch.save_model": ("filename", 1),
}
# Image files: the sample grid a GAN writes every few hundred steps, one path for all ranks.
IMAGE_WRITERS = {
    "torchvision.utils.save_image": ("fp", 1),
    "torchvision.io.write_png": ("filename", 1),
    "torchvision.io.write_jpeg": ("filename", 1),
}
FILE_WRITERS = {**CHECKPOINT_WRITERS, **IMAGE_WRITERS}

# Calls whose result is an object with a `.save(f)` that writes a file (a ScriptModule).
SAVING_OBJECT_FACTORIES = frozenset({"torch.jit.script", "torch.jit.trace"})
SAVING_OBJECT_PATH = ("f", 0)

# Progress lines written straight to the terminal (`sys.stdout.write("\r[Epoch %d] ...")`):
# console output like print. Not stderr: a warning or an error there may be any rank's own.
STDOUT_WRITES = frozenset({"sys.stdout.write"})
