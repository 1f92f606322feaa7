"""ddpify: lint and migrate PyTorch training scripts for DistributedDataParallel."""

__version__ = "0.1.0"
