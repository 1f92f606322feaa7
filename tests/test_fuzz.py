"""Generated Python (hypothesmith, derandomized) and mutated training scripts never crash
ddpify, lose a comment or produce code that does not compile.

Every rule runs on every generated module, prefixed with torch imports so nothing is
skipped; the engine records a rule that raises as a crash, which fails the test.
"""

from __future__ import annotations

import hypothesmith
import pytest
from hypothesis import HealthCheck, given, settings

from ddpify import guarded
from ddpify.engine import check_source
from ddpify.rules import ALL_RULES
from tests.mutations import MUTATIONS, examine, mutants

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


# --- mutated training scripts (tests/mutations.py; benchmarks/fuzz.py runs thousands) ---

MUTANTS = list(mutants(seed=20261123, count=10))


@pytest.mark.parametrize(
    "label,text", [(label, text) for label, _, text in MUTANTS], ids=[m[0] for m in MUTANTS]
)
def test_mutated_scripts_are_linted_fixed_and_migrated_cleanly(label, text):
    try:
        problems = guarded.isolated(examine, text, timeout=240)
    except guarded.GaveUp as exc:  # the interpreter died or hung
        problems = [str(exc)]
    assert problems == [], label


def test_the_mutator_covers_the_hostile_shapes():
    # A fixed seed must still exercise the mutations that found bugs before.
    names = {
        name for label, _, _ in mutants(seed=0, count=300) for name in label.split()[-1].split("+")
    }
    assert {m.__name__ for m in MUTATIONS} <= names


def test_examine_reports_a_lost_comment(monkeypatch):
    # The fuzzer's own oracle must be able to fail.
    import ddpify.migrate as migrate_package
    from ddpify.migrate.report import MigrationResult

    def lossy(text, filename="train.py", options=None):
        return MigrationResult(filename, text, text.replace("# keep", ""), "single", True)

    monkeypatch.setattr(migrate_package, "migrate_source", lossy)
    problems = examine("import torch\nx = 1  # keep\n")
    assert any("lost comments" in problem for problem in problems)
