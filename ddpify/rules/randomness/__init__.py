from ddpify.rules.base import Rule
from ddpify.rules.randomness.ddp060_seeding import SameSeedEveryRank

RULES: list[type[Rule]] = [SameSeedEveryRank]
