from ddpify.rules.base import Rule
from ddpify.rules.wrapping.ddp011_ddp_wrap_args import DdpWrapArgs
from ddpify.rules.wrapping.ddp030_batchnorm_not_synced import BatchNormNotSynced

RULES: list[type[Rule]] = [DdpWrapArgs, BatchNormNotSynced]
