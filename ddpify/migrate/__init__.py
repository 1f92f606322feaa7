"""`ddpify migrate`: rewrite single-GPU, DataParallel and hand-launched DDP scripts for torchrun."""

from ddpify.migrate.analyze import NotMigrated, Options, Shape
from ddpify.migrate.pipeline import PASSES, migrate_source
from ddpify.migrate.report import Change, HumanItem, MigrationResult

__all__ = [
    "PASSES",
    "Change",
    "HumanItem",
    "MigrationResult",
    "NotMigrated",
    "Options",
    "Shape",
    "migrate_source",
]
