from ddpify.rules.base import Rule
from ddpify.rules.dataparallel.ddp070_dataparallel_usage import DataParallelUsage

RULES: list[type[Rule]] = [DataParallelUsage]
