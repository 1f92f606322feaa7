"""Fewer garbage collections while a large syntax tree is being built and walked.

A 10,000-line module is millions of libcst objects that live until the run ends; with
CPython's default thresholds (a young collection every 700 allocations, promoting into
older generations that are scanned whole) the collector keeps re-scanning them: about a
fifth of `migrate`'s time on 10k lines. libcst trees hold no reference cycles, so
collecting young objects a hundred times less often frees nothing later than it should.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 100_000


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the young-generation threshold for the block; restore it after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


@contextmanager
def no_collections() -> Iterator[None]:
    """The cyclic collector off for the block (reference counting still frees what
    dies); restored after, when the next collection finds the cycles made meanwhile.

    For one migration: each young collection traverses every young container, and a
    run makes containers of a whole tree's size (node lists, parent maps) again and
    again, so with the collector on its cost grew faster than the file (1.4 s of 20 on
    30k lines, 7.7 of 73 on 100k). Garbage cycles made in the run (a project's trees
    and the ProjectView they share) wait until it ends, no longer than they would in
    the old generation they reach within a pass anyway."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            # Everything made in the run sits in the young generation now, and the first
            # collection would traverse it all: move it to the old one (freeze, then
            # unfreeze, two list moves), which a full collection visits in its time.
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
