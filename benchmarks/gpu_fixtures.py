"""Run every converted fixture where users run it: on a GPU, as `python` and under torchrun.

    python benchmarks/gpu_fixtures.py [--out gpu_fixtures.md] [--jobs 6] [--budget 450]
                                      [--timeout 150] [--verify-nproc 1,2] [--cases a,b]

For each case of fixtures/migrate/ that the migration converts (after.py differs from
before.py), in a fresh working directory each:

- `python after.py` (one process);
- `torchrun --standalone --nproc_per_node=1 after.py`;
- `ddpify verify before.py after.py --nproc N` for each N of --verify-nproc, unless the
  original launches its own processes (mp.spawn, torch.distributed.launch), which cannot
  run as the one-process reference.

It prints a markdown table (case, python, torchrun, verify, time, first error line) to
stdout and to --out. Commands run --jobs at a time; each has its own timeout and the whole
run a time budget, so one case that crashes or hangs never stops the others, and commands
not started within the budget are listed as skipped. Without a GPU everything still runs,
on the CPU, and the header says so. Needs torch; ddpify itself is imported from this
checkout (PYTHONPATH), so libcst and rich must be installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = ROOT / "fixtures" / "migrate"
LAUNCHES_ITSELF = ("mp.spawn DDP", "torch.distributed.launch DDP")
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
FAILURES = ("FAIL", "TIMEOUT", "mismatch", "error")
# `RuntimeError: ...`, `[rank0]: torch.OutOfMemoryError: ...`, `ChildFailedError:`
ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)\b:?.*)$")


@dataclass
class Outcome:
    """One command's result, as a table cell."""

    status: str  # ok, FAIL, TIMEOUT, skipped, n/a; for verify the verdict
    seconds: float = 0.0
    error: str = ""
    detail: str = ""  # e.g. the device verify compared on

    def cell(self) -> str:
        shown = f"{self.status}{f' {self.detail}' if self.detail else ''}"
        return f"{shown} ({self.seconds:.0f}s)" if self.seconds else shown


@dataclass
class Case:
    name: str
    shape: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        device = _device()
    except ImportError:
        print("benchmarks/gpu_fixtures.py needs torch", file=sys.stderr)
        return 2
    cases = _cases(args.cases)
    if not cases:
        print("no converted cases found under fixtures/migrate/", file=sys.stderr)
        return 2
    nprocs = [int(n) for n in args.verify_nproc.split(",") if n.strip()]
    work = Path(tempfile.mkdtemp(prefix="ddpify-gpu-"))
    runner = Runner(work, args.timeout, time.monotonic() + args.budget)
    tasks = _tasks(cases, nprocs)
    started = time.perf_counter()
    # Longest first (verify), so the budget is not spent before the slow ones start.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda task: runner.run(*task), tasks))
    report = _report(cases, nprocs, device, args, time.perf_counter() - started)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n", encoding="utf-8")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = [o for c in cases for o in c.outcomes.values() if o.status in FAILURES]
    return 1 if failed else 0


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--jobs", type=int, default=6, help="commands run at once (6)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per command (150)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    parser.add_argument("--verify-nproc", default="1,2", help="verify's --nproc values (1,2)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the working directories")
    return parser.parse_args(argv)


# -- what to run ------------------------------------------------------------------------


def _device() -> dict[str, str]:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        info["bf16"] = str(torch.cuda.is_bf16_supported())
        info["cuda"] = str(torch.version.cuda)
    else:
        info["gpu"] = "no GPU: torch.cuda.is_available() is False, every run is on the CPU"
    return info


def _cases(only: str | None) -> list[Case]:
    wanted = {name.strip() for name in only.split(",")} if only else None
    cases = []
    for folder in sorted(CASES_DIR.iterdir()):
        before, after = folder / "before.py", folder / "after.py"
        if not (before.is_file() and after.is_file()):
            continue
        if wanted is not None and folder.name not in wanted:
            continue
        if before.read_bytes() == after.read_bytes():
            continue  # not converted (Accelerate, Lightning): nothing of ours to run
        cases.append(Case(folder.name, _shape(before)))
    return cases


def _shape(before: Path) -> str:
    """The shape the migration sees, so verify is skipped where the original launches its
    own processes (asked of ddpify itself; unknown if it cannot be imported)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import libcst

        from ddpify.analysis.tree import Tree
        from ddpify.migrate.analyze import detect_shape

        tree = Tree(libcst.parse_module(before.read_text(encoding="utf-8")))
        return detect_shape(tree)[0].value
    except Exception:  # noqa: BLE001 - the table shows "?" and verify runs anyway
        return "?"


def _tasks(cases: list[Case], nprocs: list[int]) -> list[tuple[Case, str, list[str]]]:
    tasks = []
    for case in cases:
        before, after = CASES_DIR / case.name / "before.py", CASES_DIR / case.name / "after.py"
        for n in nprocs:
            label = f"verify {n}"
            if case.shape in LAUNCHES_ITSELF:
                case.outcomes[label] = Outcome("n/a", detail="(original launches itself)")
                continue
            verify = ["-m", "ddpify", "verify", str(before), str(after), "--nproc", str(n)]
            tasks.append((case, label, [*verify, "--output-format", "json"]))
    for case in cases:
        after = str(CASES_DIR / case.name / "after.py")
        tasks.append((case, "python", [after]))
        tasks.append(
            (
                case,
                "torchrun",
                ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", after],
            )
        )
    return tasks


# -- running ----------------------------------------------------------------------------


class Runner:
    def __init__(self, work: Path, timeout: float, deadline: float) -> None:
        self.work, self.timeout, self.deadline = work, timeout, deadline
        self.lock = threading.Lock()

    def run(self, case: Case, label: str, arguments: list[str]) -> None:
        outcome = self._run(case, label, arguments)
        with self.lock:
            case.outcomes[label] = outcome
            print(f"  {case.name:<22} {label:<9} {outcome.cell()}", file=sys.stderr, flush=True)

    def _run(self, case: Case, label: str, arguments: list[str]) -> Outcome:
        left = self.deadline - time.monotonic()
        if left < 10:
            return Outcome("skipped", detail="(time budget spent)")
        timeout = min(self.timeout, left)
        cwd = self.work / case.name / label.replace(" ", "-")
        cwd.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        code, output = _execute([sys.executable, *arguments], cwd, timeout)
        seconds = time.perf_counter() - start
        if code is None:
            return Outcome("TIMEOUT", seconds, _first_error(output) or f"over {timeout:.0f}s")
        if label.startswith("verify"):
            return _verify_outcome(code, output, seconds)
        if code != 0:
            return Outcome("FAIL", seconds, _first_error(output) or f"exit {code}")
        return Outcome("ok", seconds)


def _execute(command: list[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, stdout+stderr); the whole process group is killed on
    a timeout, so torchrun's workers do not outlive it."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def _verify_outcome(code: int, output: str, seconds: float) -> Outcome:
    start = output.find("{")
    try:
        result = json.loads(output[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        result = None
    if result is None:
        return Outcome("FAIL", seconds, _first_error(output) or f"exit {code}, no JSON report")
    device = result.get("settings", {}).get("device")
    error = "" if result["verdict"] == "match" else result.get("message", "")
    return Outcome(result["verdict"], seconds, error, f"[{device}]" if device else "")


def _first_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        match = ERROR_LINE.match(line)
        if match and "Warning" not in line.split(":")[0]:
            return match.group(2)
    return lines[-1] if lines else ""


# -- the report -------------------------------------------------------------------------


def _report(cases, nprocs, device, args, seconds) -> str:
    verify_labels = [f"verify {n}" for n in nprocs]
    lines = [
        "# Converted fixtures on this machine",
        "",
        f"- device: {device['gpu']}"
        + (f" (CUDA {device['cuda']}, bf16 {device['bf16']})" if "cuda" in device else ""),
        f"- torch {device['torch']}, Python {device['python']}, {platform.node()}",
        f"- {len(cases)} cases, {args.jobs} commands at a time, timeout {args.timeout:.0f}s "
        f"per command, budget {args.budget:.0f}s; finished in {seconds:.0f}s",
        f"- verify: `ddpify verify before.py after.py --nproc N` for N in {nprocs}; its "
        "verdict and the device it compared on",
        "",
        "| case | python | torchrun | verify | time (sum) | first error line |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        outcomes = case.outcomes
        verify = "; ".join(
            f"{label.split()[1]}: {outcomes.get(label, Outcome('?')).cell()}"
            for label in verify_labels
        )
        total = sum(o.seconds for o in outcomes.values())
        order = ["python", "torchrun", *verify_labels]
        errors = [f"{label}: {outcomes[label].error}" for label in order if _error(outcomes, label)]
        cells = [
            case.name,
            outcomes.get("python", Outcome("?")).cell(),
            outcomes.get("torchrun", Outcome("?")).cell(),
            verify,
            f"{total:.0f}s",
            _clip(errors[0]) if errors else "",
        ]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def _error(outcomes: dict[str, Outcome], label: str) -> bool:
    return label in outcomes and bool(outcomes[label].error)


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
