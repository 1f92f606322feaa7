from ddpify.rules.base import Rule
from ddpify.rules.data.ddp020_no_distributed_sampler import NoDistributedSampler
from ddpify.rules.data.ddp021_shuffle_with_sampler import ShuffleWithSampler
from ddpify.rules.data.ddp022_missing_set_epoch import MissingSetEpoch

RULES: list[type[Rule]] = [NoDistributedSampler, ShuffleWithSampler, MissingSetEpoch]
