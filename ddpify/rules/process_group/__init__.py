from ddpify.rules.base import Rule
from ddpify.rules.process_group.ddp001_no_init_process_group import NoInitProcessGroup
from ddpify.rules.process_group.ddp002_no_destroy_process_group import NoDestroyProcessGroup
from ddpify.rules.process_group.ddp003_legacy_local_rank_arg import LegacyLocalRankArg
from ddpify.rules.process_group.ddp004_hardcoded_launch_config import HardcodedLaunchConfig
from ddpify.rules.process_group.ddp005_backend_device_mismatch import BackendDeviceMismatch

RULES: list[type[Rule]] = [
    NoInitProcessGroup,
    NoDestroyProcessGroup,
    LegacyLocalRankArg,
    HardcodedLaunchConfig,
    BackendDeviceMismatch,
]
