"""ddpify.analysis.accumulation: which micro-step of an accumulation window a test picks."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.accumulation import (
    Phase,
    flag_synced_phase,
    nested_backward,
    phase_of,
    synced_phase,
)
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


def _nested(source: str) -> str | None:
    """The backward `nested_backward` finds in the first statement of the module's loop."""
    loop = cst.parse_module(source).body[0]
    assert isinstance(loop, (cst.For, cst.While))
    for statement in loop.body.body:
        call = nested_backward(statement, loop)
        if call is not None:
            return cst.Module([]).code_for_node(call)
    return None


@pytest.mark.parametrize(
    "source, expected",
    [
        # A rollout over time steps; the backward on chosen steps only.
        (
            "for steps in range(n):\n"
            "    for t in range(1, k + 1):\n"
            "        if t in self.backprop_on_timestep:\n"
            "            scaler.scale(loss).backward()\n",
            "scaler.scale(loss).backward()",
        ),
        # The chunks of a batch, under autocast and a try.
        (
            "for i, batch in enumerate(loader):\n"
            "    while chunks:\n"
            "        try:\n"
            "            with autocast():\n"
            "                model(chunks.pop()).sum().backward()\n"
            "        finally:\n"
            "            pass\n",
            "model(chunks.pop()).sum().backward()",
        ),
        # Directly in the body: not nested (the plain case reads it).
        ("for i, batch in enumerate(loader):\n    loss.backward()\n", None),
        # Under a test on something the outer loop changes: it may not run every time.
        (
            "for i, batch in enumerate(loader):\n"
            "    ok = batch is not None\n"
            "    for x in batch:\n"
            "        if ok:\n"
            "            loss.backward()\n",
            None,
        ),
        # Under a test on the outer loop's own counter, or on the accumulation window.
        (
            "for i, batch in enumerate(loader):\n"
            "    for x in batch:\n"
            "        if i > 10:\n"
            "            loss.backward()\n",
            None,
        ),
        (
            "for i, batch in enumerate(loader):\n"
            "    for x in batch:\n"
            "        if (n + 1) % accum_steps == 0:\n"
            "            loss.backward()\n",
            None,
        ),
        # In a function defined in the loop: runs at another time.
        (
            "for i, batch in enumerate(loader):\n"
            "    for x in batch:\n"
            "        def closure():\n"
            "            loss.backward()\n",
            None,
        ),
    ],
)
def test_nested_backward(source: str, expected: str | None) -> None:
    assert _nested(source) == expected


def test_the_sync_flag_all_reduces_where_its_test_holds() -> None:
    source = (
        "model.require_backward_grad_sync = (i + 1) % accum == 0\n"
        "self.model.require_backward_grad_sync = not i % args.accum_iter == 0\n"
        "model.require_backward_grad_sync = (i + 1) % accum == 0 or last\n"
        "flag = model.require_backward_grad_sync\n"
    )
    facts = collect_loops(cst.parse_module(source))
    assert [flag_synced_phase(m.ancestors) for m in facts.no_sync] == [
        Phase("i", 1, "accum", True),
        Phase("i", 0, "accum_iter", False),
        None,  # not one plain modulo test
        None,  # read, not set
    ]
