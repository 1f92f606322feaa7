"""VerifyResult: the verdict, the per-step table, and how to print them (full text or JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TextIO

from ddpify.verify.compare import Finding, StepRow

EXIT_MATCH, EXIT_MISMATCH, EXIT_COULD_NOT_RUN = 0, 1, 2
OUTPUT_TAIL_LINES = 40


@dataclass
class VerifyResult:
    exit_code: int
    verdict: str  # "match", "mismatch", "inconclusive" or "error"
    message: str
    steps: list[StepRow] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    original_output: str = ""
    converted_output: str = ""
    failed_run: str | None = None  # "original" or "converted" when one could not run
    seconds: dict = field(default_factory=dict)
    # what the conversion was judged against: the original as one process, or (per_rank.py)
    # the original run as DDP, for what DDP computes by design and one process cannot
    reference: str = "one-process"
    per_rank_causes: list[str] = field(default_factory=list)

    @property
    def first_mismatch(self) -> Finding | None:
        with_parameter = [f for f in self.findings if f.parameter]
        return min(with_parameter, key=lambda f: f.step or 0, default=None)

    def render(self, stream: TextIO, fmt: str = "full") -> None:
        if fmt == "json":
            json.dump(self.as_dict(), stream, indent=2)
            stream.write("\n")
            return
        stream.write(render_text(self))

    def as_dict(self) -> dict:
        first = self.first_mismatch
        return {
            "exit_code": self.exit_code,
            "verdict": self.verdict,
            "message": self.message,
            "reference": self.reference,
            "per_rank_causes": self.per_rank_causes,
            "first_mismatch": first.as_dict() if first else None,
            "findings": [f.as_dict() for f in self.findings],
            "inconclusive": self.inconclusive,
            "notes": self.notes,
            "steps": [r.as_dict() for r in self.steps],
            "settings": self.settings,
            "seconds": self.seconds,
            "failed_run": self.failed_run,
            "original_output": self.original_output,
            "converted_output": self.converted_output,
        }


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def render_text(result: VerifyResult) -> str:
    lines = []
    settings = result.settings
    if settings:
        lines.append(
            f"ddpify verify: {settings.get('original')} (1 process) vs "
            f"{settings.get('converted')} ({settings.get('nproc')} processes), "
            f"{settings.get('steps')} {steps_asked(result)}"
        )
    if result.reference == "per-rank":
        lines.append(
            f"compared with the original run as DDP on {settings.get('nproc')} processes "
            "(per-rank reference: each its share of the batch, gradients averaged), because "
            "DDP differs from one process by design here: " + "; ".join(result.per_rank_causes)
        )
    if result.steps:
        lines.append("")
        compared = [
            row.compared + (f" (opt {row.optimizer})" if row.optimizer else "")
            for row in result.steps
        ]
        # Columns as wide as their longest entry: a long parameter name must not push
        # the result column out of line.
        compared_width = max([len("compared"), *map(len, compared)]) + 2
        worst_width = max([len("worst parameter"), *(len(r.worst or "-") for r in result.steps)])
        lines.append(
            f"{'step':>4}  {'compared':<{compared_width}}{'max abs':>10}{'max rel':>10}  "
            f"{'worst parameter':<{worst_width}}  result"
        )
        for row, what in zip(result.steps, compared):
            lines.append(
                f"{row.step:>4}  {what:<{compared_width}}{number(row.max_abs):>10}"
                f"{number(row.max_rel):>10}  {(row.worst or '-'):<{worst_width}}  "
                f"{'ok' if row.ok else 'FAIL'}"
            )
        lines.append("")
    lines.extend(finding_lines(result.findings))
    for reason in result.inconclusive:
        lines.append(f"  ? {reason}")
    for note in result.notes:
        lines.append(f"  - {note}")
    if result.failed_run:
        output = (
            result.original_output if result.failed_run == "original" else result.converted_output
        )
        tail = output.rstrip().splitlines()[-OUTPUT_TAIL_LINES:]
        lines.append("")
        lines.append(f"--- last {len(tail)} lines of the {result.failed_run} run's output ---")
        lines.extend(tail)
        lines.append("---")
    lines.append(f"{result.verdict.upper()}: {result.message}")
    return "\n".join(lines) + "\n"


def steps_asked(result: VerifyResult) -> str:
    """What `--steps` counts: with several optimizers, the first one's steps (the run stops
    there), every optimizer's steps until then compared."""
    if not any(row.optimizer for row in result.steps):
        return "optimizer steps"
    return "steps of optimizer 0 (every optimizer's steps until then compared)"


def finding_lines(findings: list[Finding]) -> list[str]:
    """The first finding of each kind in full; its repeats at later steps as step numbers."""
    first: dict[str, Finding] = {}
    later: dict[str, list[int]] = {}
    for finding in sorted(findings, key=lambda f: f.step or 0):
        if finding.what in first:
            later[finding.what].append(finding.step or 0)
        else:
            first[finding.what], later[finding.what] = finding, []
    lines = []
    for what, finding in first.items():
        where = f"step {finding.step}: " if finding.step else ""
        # Each later step once: several findings of a kind at one step are one repeat.
        again = sorted(set(later[what]) - {finding.step or 0})
        also = f" (again at step{'s' if len(again) > 1 else ''} {', '.join(map(str, again))})"
        lines.append(f"  x {where}{what}: {finding.message}{also if again else ''}")
    return lines
