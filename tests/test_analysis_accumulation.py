"""ddpify.analysis.accumulation: which micro-step of an accumulation window a test picks."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.accumulation import Phase, phase_of, synced_phase
from ddpify.analysis.training import collect_loops


@pytest.mark.parametrize(
    "test, expected",
    [
        ("(i + 1) % accum == 0", Phase("i", 1, "accum", True)),
        ("i % args.grad_accum_steps != 0", Phase("i", 0, "grad_accum_steps", False)),
        ("(1 + step) % self.accum_iter == 0", Phase("step", 1, "accum_iter", True)),
        ("(it - 1) % accum != 0", Phase("it", -1, "accum", False)),
        ("not (i + 1) % accum == 0", Phase("i", 1, "accum", False)),
        # Not one plain modulo test on an accumulation count: unknown.
        ("(i + 1) % accum == 0 or last", None),
        ("i % log_every == 0", None),
        ("(i + 1) % accum == 1", None),
    ],
)
def test_phase_of(test: str, expected: Phase | None) -> None:
    assert phase_of(cst.parse_expression(test)) == expected


def synced(source: str) -> list[Phase | None]:
    facts = collect_loops(cst.parse_module(source))
    return [synced_phase(m.ancestors) for m in facts.no_sync]


def test_synced_phase_is_where_no_sync_is_left_off() -> None:
    source = (
        "ctx = model.no_sync if i % accum != 0 else nullcontext\n"
        "ctx = nullcontext() if (i + 1) % accum == 0 else model.no_sync()\n"
        "if (i + 1) % accum != 0:\n"
        "    ctx = model.no_sync()\n"
        "with model.no_sync():\n"
        "    pass\n"
    )
    assert synced(source) == [
        Phase("i", 0, "accum", True),
        Phase("i", 1, "accum", True),
        Phase("i", 1, "accum", True),
        None,  # no test chooses it
    ]
