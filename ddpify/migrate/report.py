"""What a migration did: changes, places needing a human, how to run the result.

`MigrationResult` is what `ddpify verify` is told about the migration: the batch policy
and the learning-rate scaling it applied, so that deliberate changes are not mistaken
for bugs.
"""

from __future__ import annotations

import bisect
import difflib
import math
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Change:
    pass_name: str
    description: str
    code: str | None = None  # the lint code this change fixes, if any
    anchor: str | None = None  # a line of the output that shows the change
    line: int | None = None  # 1-based, in the migrated file


@dataclass
class HumanItem:
    why: str
    anchor: str | None = None
    line: int | None = None  # 1-based, in the migrated file (or the original if untouched)


@dataclass
class MigrationResult:
    filename: str
    original: str
    output: str
    shape: str
    migrated: bool
    reason: str | None = None  # why the script was left untouched
    changes: list[Change] = field(default_factory=list)
    needs_human: list[HumanItem] = field(default_factory=list)
    batch_policy: str = "per-rank"
    lr_scaling: str = "none"  # the rule applied: linear, sqrt or none
    lr_rule: str | None = None  # the rule's name as written in the output's comment
    amp: str = "off"
    hand_made: str | None = None  # how hand-made batches were sharded, if any
    replicated: str | None = None  # the replicated steps' policy (migrate/replicate.py), if any

    @property
    def changed(self) -> bool:
        return self.output != self.original

    @property
    def fixed_codes(self) -> set[str]:
        return {change.code for change in self.changes if change.code}

    def lr_scale_for(self, world_size: int) -> float:
        """The factor the learning rate is multiplied by when `world_size` processes run."""
        if self.lr_scaling == "linear":
            return float(world_size)
        if self.lr_scaling == "sqrt":
            return math.sqrt(world_size)
        return 1.0

    def commands(self, script: str) -> list[tuple[str, str]]:
        return [
            ("one process, as before", f"python {script}"),
            ("every GPU of this machine", f"torchrun --standalone --nproc_per_node=gpu {script}"),
            ("two processes on CPU (gloo)", f"torchrun --standalone --nproc_per_node=2 {script}"),
            (
                "several machines: run on each, HOST being the first machine's address",
                "torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job1 --rdzv_backend=c10d "
                f"--rdzv_endpoint=HOST:29500 {script}",
            ),
        ]

    def locate(self) -> None:
        """Give every change and human item a line of the output, found from its anchor."""
        lines = [line.strip() for line in self.output.splitlines()]
        # Line -> its indices, and how far each anchor's claimed matches reach: a file
        # with thousands of changes is located in one pass over its lines, not one each.
        exact: dict[str, list[int]] = {}
        for i, line in enumerate(lines):
            exact.setdefault(line, []).append(i)
        cursor: dict[str, int] = {}
        claimed: set[int] = set()
        within = _Substrings(lines)
        moved = _LineMover(self.original, self.output)
        for item in [*self.changes, *self.needs_human]:
            if item.anchor is None or item.line is not None:
                continue
            anchor = item.anchor.strip()
            matches = exact.get(anchor)
            if matches:
                start = cursor.get(anchor, 0)
                while start < len(matches) and matches[start] in claimed:
                    start += 1
                cursor[anchor] = start
                found = matches[start] if start < len(matches) else matches[0]
            else:
                found = within.first(anchor, claimed)
            if found is not None:
                claimed.add(found)
                item.line = found + 1
            else:  # the migration rewrote the anchor's line: find it in the original
                item.line = moved.line(anchor)
        self.changes.sort(key=lambda c: c.line or 0)
        self.needs_human.sort(key=lambda h: h.line or 0)

    def render(self, stream: TextIO, script: str | None = None) -> None:
        script = script or self.filename
        write = stream.write
        if not self.migrated:
            write(f"{self.filename}: not migrated ({self.shape}): {self.reason}\n")
            return
        if not self.changed:
            write(f"{self.filename}: {self.shape} script; nothing to change\n")
        else:
            write(f"{self.filename}: migrated ({self.shape})\n")
            self._render_numbers(write)
        self.render_changes(stream)
        write("\nRun it:\n")
        for label, command in self.commands(script):
            write(f"  # {label}\n  {command}\n")

    def render_changes(self, stream: TextIO) -> None:
        write = stream.write
        if self.changes:
            write("\nChanges:\n")
            for change in self.changes:
                code = f" [{change.code}]" if change.code else ""
                write(f"  {_line(change.line)} {change.pass_name:<10} {change.description}{code}\n")
        if self.needs_human:
            write("\nNeeds a human:\n")
            for item in self.needs_human:
                write(f"  {_line(item.line)} {item.why}\n")

    def _render_numbers(self, write) -> None:
        """First, the choices that change the numbers a run produces."""
        policy = "global (hand-made batches split)" if self.hand_made else self.batch_policy
        if self.replicated:
            policy = "replicated (every rank computes the whole step)"
        write(f"\nBatch policy: {policy}")
        if self.lr_scaling != "none":
            write(f"; learning rate scaled by the {self.lr_rule}")
        else:
            write("; learning rate unchanged")
        write(f". Mixed precision: {self.amp}.\n")
        if self.hand_made:
            write(f"Sharding: {self.hand_made}.\n")
        if self.replicated:
            write(f"Replication: {self.replicated}.\n")


class _Substrings:
    """The first line containing an anchor that no other item claimed (else the first
    line containing it): one search of the joined text per anchor, resumed where the
    last search for the same anchor stopped (claimed lines stay claimed)."""

    def __init__(self, lines: list[str]) -> None:
        self.text = "\n".join(lines)
        self.starts = [0]
        for line in lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)
        self.resume: dict[str, int] = {}

    def first(self, anchor: str, claimed: set[int]) -> int | None:
        if not anchor or "\n" in anchor:
            return None
        at = self.resume.get(anchor, 0)
        while True:
            found = self.text.find(anchor, at)
            if found < 0:
                first = self.text.find(anchor)
                return None if first < 0 else bisect.bisect_right(self.starts, first) - 1
            line = bisect.bisect_right(self.starts, found) - 1
            if line not in claimed:
                self.resume[anchor] = self.starts[line]
                return line
            at = self.starts[line + 1] if line + 1 < len(self.starts) else len(self.text) + 1


class _LineMover:
    """The output line that stands where an anchor's line of the original stood: the line
    itself when it survived, else the first line of the hunk that replaced it. The diff
    is computed once, when the first anchor needs it."""

    def __init__(self, original: str, output: str) -> None:
        self.original = original
        self.output = output
        self._before: list[str] | None = None
        self._opcodes: list | None = None

    def line(self, anchor: str) -> int | None:
        if self._before is None:
            self._before = [line.strip() for line in self.original.splitlines()]
        index = next((i for i, line in enumerate(self._before) if anchor and anchor in line), None)
        if index is None:
            return None
        if self._opcodes is None:
            after = [line.strip() for line in self.output.splitlines()]
            matcher = difflib.SequenceMatcher(None, self._before, after, autojunk=False)
            self._opcodes = matcher.get_opcodes()
        for _tag, i1, i2, j1, j2 in self._opcodes:
            if i1 <= index < i2:
                return min(j1 + (index - i1), max(j2 - 1, j1)) + 1
        return None


def _line(line: int | None) -> str:
    return f"line {line:>4}:" if line else "          "


def _output_line(original: str, output: str, anchor: str) -> int | None:
    """`_LineMover` for one anchor."""
    return _LineMover(original, output).line(anchor)
