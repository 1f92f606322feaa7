"""Read the migration's own notes on batch policy and LR scaling from the converted script.

Only comment lines that mention `ddpify` count (any case, anywhere in the file), e.g.

    # ddpify: linear LR scaling: lr * world_size (each process keeps batch size 64)
    # ddpify: batch policy global: batch_size // world_size per process, LR unchanged

On such a line:
- learning rate (`lr`, `learning rate`, `learning-rate`):
  `sqrt`/`square root` -> sqrt(N); `linear` -> N; `lr scale 0.5`, `lr x 4`, `lr * 4` -> that
  number; `no`/`unchanged`/`not scaled`/`keep` -> 1;
- batch policy: `batch policy global` / `batch policy per-rank` say it outright; otherwise
  `// world_size` or `batch divided`/`split` -> global, `per-rank`, `per rank` or `keeps the
  batch` -> per-rank (`per process` alone says nothing: both policies have a per-process batch);
  linear or sqrt LR scaling without a batch word implies per-rank (that is why LR is scaled).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MARKER = re.compile(r"#.*\bddpify\b.*", re.IGNORECASE)
LR_WORD = re.compile(r"\b(lr|learning[ -]rate)\b", re.IGNORECASE)
SQRT = re.compile(r"\bsqrt\b|square[ -]root", re.IGNORECASE)
LINEAR = re.compile(r"\blinear\b", re.IGNORECASE)
NUMBER = re.compile(
    r"\b(?:lr|learning[ -]rate)[ _-]*(?:scale[d]?|scaling)?"
    r"\s*(?:by|=|:|x|\*|×)\s*([0-9]*\.?[0-9]+)",
    re.IGNORECASE,
)
UNSCALED = re.compile(r"\b(no|unchanged|not scaled|keep|kept|same)\b", re.IGNORECASE)
EXPLICIT = re.compile(r"batch[ _-]policy[: =]*(per[ -]?rank|global)", re.IGNORECASE)
PER_RANK = re.compile(r"per[ -]rank|keeps? (the )?batch", re.IGNORECASE)
GLOBAL = re.compile(r"//\s*world|batch(?:[ _]size)? (?:is )?(?:divided|split)", re.IGNORECASE)


@dataclass
class MigrationMarkers:
    batch_policy: str | None = None
    lr_rule: str | None = None  # "linear", "sqrt", "none" or a number as text
    lines: list[str] = field(default_factory=list)

    def lr_scale(self, nproc: int) -> float | None:
        if self.lr_rule is None:
            return None
        if self.lr_rule == "linear":
            return float(nproc)
        if self.lr_rule == "sqrt":
            return math.sqrt(nproc)
        if self.lr_rule == "none":
            return 1.0
        return float(self.lr_rule)


def read_markers(source: str) -> MigrationMarkers:
    markers = MigrationMarkers()
    for line in source.splitlines():
        match = MARKER.search(line)
        if not match:
            continue
        comment = match.group(0)
        markers.lines.append(comment.strip())
        if markers.lr_rule is None and LR_WORD.search(comment):
            markers.lr_rule = lr_rule(comment)
        if markers.batch_policy is None:
            markers.batch_policy = batch_policy(comment)
    if markers.batch_policy is None and markers.lr_rule in ("linear", "sqrt"):
        markers.batch_policy = "per-rank"
    return markers


def lr_rule(comment: str) -> str | None:
    if SQRT.search(comment):
        return "sqrt"
    if LINEAR.search(comment):
        return "linear"
    number = NUMBER.search(comment)
    if number:
        return number.group(1)
    if UNSCALED.search(comment):
        return "none"
    return None


def batch_policy(comment: str) -> str | None:
    explicit = EXPLICIT.search(comment)
    if explicit:
        return "global" if explicit.group(1).lower() == "global" else "per-rank"
    if GLOBAL.search(comment):
        return "global"
    if PER_RANK.search(comment):
        return "per-rank"
    return None
