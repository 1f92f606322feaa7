"""`ddpify migrate` on real training scripts: migrated, ran under torchrun, verified.

    python benchmarks/bench_realworld.py [--only ID,...] [--corpus DIR] [--python PY]
                                         [--jobs N] [--json FILE] [--skip-original]

The corpus is the development set described in ../shared/realworld/README.md: public
training scripts at pinned commits, built OUTSIDE this repository (never copy their code
into the project). Corpus directory: --corpus, else $DDPIFY_CORPUS, else `corpus/` beside
the repository (../corpus from the repository's root, i.e. /work/corpus for a checkout
at /work/main). The row table is `scripts.tsv` in --table, else $DDPIFY_CORPUS_TABLE,
else ../shared/realworld/scripts.tsv beside the repository. When either is missing the
benchmark says so and exits 0.

For each row, in a fresh temporary copy of the row: run its setup, run the original
(one process), `ddpify migrate SCRIPT -o SCRIPT_ddp.py` (beside it, so its sibling imports
keep working), run the result as `python` and under
`python -m torch.distributed.run --standalone --nproc_per_node=2` (gloo on CPU,
OMP_NUM_THREADS=1, the row's env and args, timeout twice the row's), then
`ddpify verify SCRIPT SCRIPT_ddp.py --nproc 2 --steps 3 -- ARGS`.

ddpify itself always runs from this checkout (the system interpreter with PYTHONPATH set
to it); the training runs and verify use --python (default /work/corpus-venv/bin/python
when it exists, else this interpreter), which must have torch and the rows' packages.

One line per row, then:
    migrated a/n, ran under torchrun b/n, verified c/n, refused-with-reason d/n, wrong e/n
"wrong" = converted, but the converted script crashes (as python or under torchrun) or
verify finds a mismatch. Asserts nothing; exit 0.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "corpus"
DEFAULT_TABLE = ROOT.parent / "shared" / "realworld" / "scripts.tsv"
DEFAULT_VENV_PYTHON = Path("/work/corpus-venv/bin/python")


@dataclass
class Row:
    id: str
    path: str
    setup: str
    args: str
    env: str
    timeout_s: int
    shape: str


@dataclass
class Outcome:
    id: str
    shape: str
    original: str = "-"  # ok / failed / skipped
    migrate: str = "-"  # migrated / refused / gate / error
    python: str = "-"
    torchrun: str = "-"
    verify: str = "-"  # match / mismatch / inconclusive
    # what verify judged against: "one-process", or "per-rank" (the original run as DDP)
    reference: str = ""
    why: str = ""
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    @property
    def migrated(self) -> bool:
        return self.migrate == "migrated"

    @property
    def wrong(self) -> bool:
        crashed = {"failed", "timeout"} & {self.python, self.torchrun}
        return self.migrated and bool(crashed or self.verify == "mismatch")


def read_rows(table: Path) -> list[Row]:
    with table.open(newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [
            Row(
                r["id"],
                r["path"],
                r["setup"] or ":",
                r["args"] or "",
                r["env"] or "",
                int(r["timeout_s"] or 120),
                r["shape"],
            )
            for r in reader
        ]


def _is_project(script: Path) -> bool:
    """Whether the script imports local modules (ddpify migrates them with it)."""
    sys.path.insert(0, str(ROOT))
    from ddpify.analysis.project import Project

    try:
        return not Project.discover([script]).is_single_file
    except Exception:  # noqa: BLE001 - unreadable: the migrate step says why
        return False


def first_error(text: str) -> str:
    """The line a user would read first: the exception at the end of a traceback."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and not line.startswith("File "):
            return line[:200]
    return (lines[-1] if lines else "no output")[:200]


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.python = args.python
        self.corpus = Path(args.corpus)
        self.skip_original = args.skip_original
        self.factor = args.timeout_factor

    def env(self, row: Row) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        # `python` in a row's setup means the training interpreter, with the rows' packages.
        env["PATH"] = os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")])
        for word in shlex.split(row.env):
            key, _, value = word.partition("=")
            env[key] = value
        return env

    def shell(self, command: str, cwd: Path, env: dict, timeout: float):
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=cwd,
                env=env,
                timeout=timeout,
                capture_output=True,
                text=True,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return None, out if isinstance(out, str) else out.decode(errors="replace")
        return done.returncode, done.stdout + done.stderr

    def run_row(self, row: Row) -> Outcome:
        start = time.perf_counter()
        outcome = Outcome(row.id, row.shape)
        with tempfile.TemporaryDirectory(prefix=f"rw-{row.id}-") as tmp:
            copy = Path(tmp) / row.id
            shutil.copytree(self.corpus / row.id, copy)
            try:
                self._steps(row, copy, outcome)
            except Exception as exc:  # the benchmark must report, never stop
                outcome.why = outcome.why or f"benchmark error: {exc}"
        outcome.seconds = round(time.perf_counter() - start, 1)
        return outcome

    def _steps(self, row: Row, copy: Path, outcome: Outcome) -> None:
        script = copy / row.path
        cwd, name = script.parent, script.name
        converted = f"{script.stem}_ddp.py"
        env = self.env(row)
        # The row's PYTHONPATH (e.g. `..`) is relative to the script's folder; keep it.
        code, out = self.shell(row.setup, cwd, env, 300)
        if code != 0:
            outcome.why = f"setup failed: {first_error(out)}"
            return
        if self.skip_original:
            outcome.original = "skipped"
        else:
            command = f"{shlex.quote(self.python)} {name} {row.args}"
            code, out = self.shell(command, cwd, env, self.factor * row.timeout_s)
            outcome.original = "ok" if code == 0 else ("timeout" if code is None else "failed")
            if code != 0:
                outcome.why = f"original: {first_error(out)}"
        if _is_project(script):
            # The entry imports local modules that change too: migrate a copy of the row in
            # place; the converted entry runs from the original's folder (same data), its
            # own folder first on sys.path (its converted modules).
            other = copy.with_name(copy.name + "-ddp")
            shutil.copytree(copy, other, symlinks=True)
            converted = str(other / row.path)
            if not self.migrate(row, Path(converted).parent, name, None, outcome):
                return
        elif not self.migrate(row, cwd, name, converted, outcome):
            return
        limit = self.factor * row.timeout_s
        code, out = self.shell(
            f"{shlex.quote(self.python)} {converted} {row.args}", cwd, env, limit
        )
        outcome.python = "ok" if code == 0 else ("timeout" if code is None else "failed")
        if code != 0:
            outcome.why = f"python: {first_error(out)}"
        torchrun = (
            f"{shlex.quote(self.python)} -m torch.distributed.run --standalone "
            f"--nproc_per_node=2 {converted} {row.args}"
        )
        code, out = self.shell(torchrun, cwd, env, limit)
        outcome.torchrun = "ok" if code == 0 else ("timeout" if code is None else "failed")
        if code != 0:
            outcome.why = outcome.why or f"torchrun: {first_error(out)}"
        self.verify(row, cwd, name, converted, env, outcome)

    def migrate(self, row, cwd: Path, name: str, converted, outcome: Outcome) -> bool:
        """`ddpify migrate NAME -o CONVERTED`; in place when `converted` is None (a project)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        output = ["-o", converted] if converted is not None else []
        done = subprocess.run(
            [sys.executable, "-m", "ddpify", "migrate", name, *output],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        text = done.stdout + done.stderr
        outcome.details["migrate_output"] = text[-4000:]
        changed = re.search(r"; (\d+) files? to change", text)
        written = converted is None and changed is not None and int(changed.group(1)) > 0
        if done.returncode == 0 and (written or converted and (cwd / converted).exists()):
            outcome.migrate = "migrated"
            return True
        if done.returncode == 0:  # nothing to change
            outcome.migrate = "unchanged"
            outcome.why = first_line_after(text, "") or "nothing to change"
            return False
        if done.returncode == 2 and ("please report" in text.lower() or "gate" in text.lower()):
            outcome.migrate = "gate"
            outcome.why = f"gate: {first_error(text)}"
        elif done.returncode == 1:
            outcome.migrate = "refused"
            outcome.why = f"refused: {refusal_reason(text)}"
        else:
            outcome.migrate = "error"
            outcome.why = f"migrate error: {first_error(text)}"
        return False

    def verify(self, row, cwd: Path, name: str, converted: str, env: dict, outcome) -> None:
        env = dict(env)
        # Our ddpify first, then the row's own PYTHONPATH (relative to the script's folder).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        command = (
            f"{shlex.quote(self.python)} -m ddpify verify {name} {converted} --nproc 2 "
            f"--steps 3 --timeout {int(self.factor * row.timeout_s)} --output-format json "
            f"-- {row.args}"
        )
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=3 * self.factor * row.timeout_s + 60,
            )
        except subprocess.TimeoutExpired:
            outcome.verify = "inconclusive"
            outcome.why = outcome.why or "verify inconclusive: timed out"
            return
        outcome.verify = {0: "match", 1: "mismatch"}.get(done.returncode, "inconclusive")
        report = _json_report(done.stdout)
        if report is None:
            outcome.details["verify_output"] = (done.stdout + done.stderr)[-4000:]
            reason = first_error(done.stdout + done.stderr)
        else:
            report.pop("original_output", None)
            report.pop("converted_output", None)
            outcome.details["verify"] = report
            outcome.reference = report.get("reference") or ""
            reason = report.get("message") or ""
            if report.get("inconclusive"):
                reason += f" ({'; '.join(map(str, report['inconclusive']))[:200]})"
        if done.returncode != 0 and not outcome.why:
            outcome.why = f"verify {outcome.verify}: {reason[:300]}"


def _json_report(stdout: str) -> dict | None:
    start = stdout.find("{")
    if start < 0:
        return None
    try:
        report, _ = json.JSONDecoder().raw_decode(stdout[start:])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def first_line_after(text: str, marker: str) -> str:
    for line in text.splitlines():
        if marker in line and line.strip():
            return line.strip()[:200]
    return ""


def refusal_reason(text: str) -> str:
    for line in text.splitlines():
        low = line.lower()
        if "not migrated" in low or "reason" in low or "refus" in low:
            return line.strip()[:240]
    return first_error(text)


def summary(outcomes: list[Outcome]) -> str:
    n = len(outcomes)
    migrated = sum(o.migrated for o in outcomes)
    torchrun = sum(o.migrated and o.torchrun == "ok" for o in outcomes)
    verified = sum(o.verify == "match" for o in outcomes)
    per_rank = sum(o.verify == "match" and o.reference == "per-rank" for o in outcomes)
    refused = sum(o.migrate == "refused" for o in outcomes)
    wrong = sum(o.wrong for o in outcomes)
    return (
        f"migrated {migrated}/{n}, ran under torchrun {torchrun}/{n}, verified {verified}/{n} "
        f"({per_rank} against the per-rank reference), "
        f"refused-with-reason {refused}/{n}, wrong {wrong}/{n}"
    )


def verdict(o: Outcome) -> str:
    """verify's verdict, `match/per-rank` where it matched the original run as DDP."""
    return o.verify + ("/per-rank" if o.reference == "per-rank" else "")


def line(o: Outcome) -> str:
    cells = (
        f"{o.id:<24} orig={o.original:<7} migrate={o.migrate:<8} python={o.python:<7} "
        f"torchrun={o.torchrun:<7} verify={verdict(o):<15} {o.seconds:>6.0f}s"
    )
    return cells + (f"  {o.why}" if o.why else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--corpus", default=os.environ.get("DDPIFY_CORPUS", str(DEFAULT_CORPUS)))
    parser.add_argument(
        "--table", default=os.environ.get("DDPIFY_CORPUS_TABLE", str(DEFAULT_TABLE))
    )
    default_python = str(DEFAULT_VENV_PYTHON) if DEFAULT_VENV_PYTHON.exists() else sys.executable
    parser.add_argument("--python", default=default_python, help="interpreter for training runs")
    parser.add_argument("--jobs", type=int, default=1, help="rows run in parallel")
    parser.add_argument("--json", help="write every row's outcome here")
    parser.add_argument(
        "--timeout-factor",
        type=float,
        default=2.0,
        help="each run may take this many times the row's timeout_s (default 2; raise it on a "
        "loaded machine)",
    )
    parser.add_argument(
        "--skip-original",
        action="store_true",
        help="do not run the original script first (saves time)",
    )
    args = parser.parse_args()

    corpus, table = Path(args.corpus), Path(args.table)
    if not table.is_file() or not corpus.is_dir():
        print(
            f"corpus not built (looked for {corpus} and {table}); see "
            "../shared/realworld/README.md. Skipping."
        )
        return 0
    rows = read_rows(table)
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r.id in wanted]
    rows = [r for r in rows if (corpus / r.id).is_dir()]
    if not rows:
        print(f"no built rows under {corpus}. Skipping.")
        return 0
    runner = Runner(args)
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for outcome in pool.map(runner.run_row, rows):
            print(line(outcome), flush=True)
            outcomes.append(outcome)
    print(summary(outcomes))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
