"""Generated Python (hypothesmith, derandomized) never crashes the linter.

Every rule runs on every generated module, prefixed with torch imports so nothing is
skipped; the engine records a rule that raises as a crash, which fails the test.
"""

from __future__ import annotations

import hypothesmith
from hypothesis import HealthCheck, given, settings

from ddpify.engine import check_source
from ddpify.rules import ALL_RULES

PRELUDE = (
    "import torch\nimport torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
)


@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(hypothesmith.from_node())
def test_generated_code_never_crashes_a_rule(source):
    result = check_source(PRELUDE + source, "fuzz.py", ALL_RULES)
    assert result.crashes == []
    for diagnostic in result.diagnostics:
        assert diagnostic.location <= diagnostic.end_location
