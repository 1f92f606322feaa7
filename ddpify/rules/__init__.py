"""The rule registry: every rule, listed explicitly by area (codes follow the catalogue)."""

from __future__ import annotations

from collections.abc import Iterable

from ddpify.rules import (
    data,
    dataparallel,
    devices,
    process_group,
    randomness,
    rank_zero,
    training_loop,
    wrapping,
)
from ddpify.rules.base import Rule

ALL_RULES: list[type[Rule]] = sorted(
    [
        *process_group.RULES,  # DDP00x
        *devices.RULES,  # DDP01x
        *data.RULES,  # DDP02x
        *wrapping.RULES,  # DDP03x
        *training_loop.RULES,  # DDP04x
        *rank_zero.RULES,  # DDP05x
        *randomness.RULES,  # DDP06x
        *dataparallel.RULES,  # DDP07x
    ],
    key=lambda rule: rule.CODE,
)

RULES_BY_CODE: dict[str, type[Rule]] = {rule.CODE: rule for rule in ALL_RULES}


class UnknownRuleError(ValueError):
    pass


def _specificity(rule: type[Rule], selectors: Iterable[str]) -> int:
    """Length of the longest selector matching `rule` (ALL counts as 0), -1 if none."""
    lengths = [
        0 if sel == "ALL" else len(sel)
        for sel in selectors
        if sel == "ALL" or rule.CODE.startswith(sel)
    ]
    return max(lengths, default=-1)


def validate_selectors(selectors: Iterable[str]) -> None:
    for sel in selectors:
        if sel != "ALL" and not any(rule.CODE.startswith(sel) for rule in ALL_RULES):
            raise UnknownRuleError(f"unknown rule selector {sel!r} (see `ddpify rule --all`)")


def select_rules(
    select: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    extend_select: Iterable[str] = (),
) -> list[type[Rule]]:
    """Rules enabled by ruff-style selectors; codes and prefixes (`DDP05`) both work."""
    select, ignore, extend_select = (
        list(select) if select is not None else None,
        list(ignore),
        list(extend_select),
    )
    validate_selectors([*(select or []), *ignore, *extend_select])

    def enabled(rule: type[Rule]) -> bool:
        if select is None:
            chosen = 0 if rule.DEFAULT_ENABLED else -1
        else:
            chosen = _specificity(rule, select)
        chosen = max(chosen, _specificity(rule, extend_select))
        # The more specific selector wins (`--select DDP050 --ignore DDP05` keeps DDP050);
        # on a tie, ignore wins.
        return chosen >= 0 and chosen > _specificity(rule, ignore)

    return [rule for rule in ALL_RULES if enabled(rule)]
