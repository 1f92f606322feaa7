from ddpify.rules.base import Rule
from ddpify.rules.devices.ddp010_device_not_local_rank import DeviceNotLocalRank
from ddpify.rules.devices.ddp012_load_without_map_location import LoadWithoutMapLocation

RULES: list[type[Rule]] = [DeviceNotLocalRank, LoadWithoutMapLocation]
