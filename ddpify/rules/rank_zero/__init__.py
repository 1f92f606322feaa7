from ddpify.rules.base import Rule
from ddpify.rules.rank_zero.ddp050_unguarded_save import UnguardedSave
from ddpify.rules.rank_zero.ddp051_saves_wrapper import SavesWrapper
from ddpify.rules.rank_zero.ddp052_unguarded_logging import UnguardedLogging
from ddpify.rules.rank_zero.ddp053_collective_under_rank_guard import CollectiveUnderRankGuard
from ddpify.rules.rank_zero.ddp054_unreduced_metrics import UnreducedMetrics

RULES: list[type[Rule]] = [
    UnguardedSave,
    SavesWrapper,
    UnguardedLogging,
    CollectiveUnderRankGuard,
    UnreducedMetrics,
]
