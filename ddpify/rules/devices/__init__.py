from ddpify.rules.base import Rule

RULES: list[type[Rule]] = []
