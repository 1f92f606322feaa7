"""Whether a name reads as evaluation data (`val_loader`, `testLoader`, `dev_set`): the
data rules and the migration's stream pass ask the same question."""

from __future__ import annotations

import re

_EVAL_WORD = re.compile(r"(^|_)(val|test|eval|dev|holdout|infer|predict)")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def looks_like_eval(*names: str | None) -> bool:
    """Whether one of `names` reads as evaluation data: `val_loader`, `testLoader`,
    `eval_ds`, `dev_set`, `build_val_loader`."""
    for name in names:
        if not name:
            continue
        for part in name.split("."):
            if _EVAL_WORD.search(_CAMEL.sub("_", part).lower()):
                return True
    return False
