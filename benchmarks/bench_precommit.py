"""How long the `ddpify-check` pre-commit hook takes on 20 files.

    python benchmarks/bench_precommit.py [--files 20] [--repeat 5]

Snapshots this checkout into a git repository, points a project's
`.pre-commit-config.yaml` at it, and times `pre-commit run ddpify-check --files ...` on
synthetic training scripts written for this benchmark: once cold (pre-commit builds the
hook environment) and --repeat times warm. For comparison it also times `ddpify check`
on the same files directly. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_lsp import synthetic_script  # noqa: E402
from tests.test_precommit import git, pre_commit, snapshot_checkout  # noqa: E402

DP_LINE = "model = torch.nn.DataParallel(torch.nn.Linear(4, 2))\n"


def timed(work) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--lines", type=int, default=150, help="lines per file")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "src").mkdir()
        source = snapshot_checkout(base / "src")
        home = base / "home"
        project = base / "project"
        project.mkdir()
        git(project, "init", "-q")
        names = []
        for i in range(args.files):
            text = synthetic_script(args.lines) + (DP_LINE if i % 4 == 0 else "")
            name = f"train_{i:02d}.py"
            (project / name).write_text(text)
            names.append(name)
        git(project, "add", "-A")

        cold, result = timed(lambda: pre_commit(project, source, home, "ddpify-check", *names))
        if result.returncode not in (0, 1):
            sys.exit(f"pre-commit failed:\n{result.stdout}\n{result.stderr}")
        warm = [
            timed(lambda: pre_commit(project, source, home, "ddpify-check", *names))[0]
            for _ in range(args.repeat)
        ]
        direct = [
            timed(
                lambda: subprocess.run(
                    [sys.executable, "-m", "ddpify", "check", "--quiet", *names],
                    cwd=project,
                    capture_output=True,
                )
            )[0]
            for _ in range(args.repeat)
        ]
    lines = args.files * args.lines
    print(f"{args.files} files, {lines} lines; hook exit code {result.returncode}")
    print(f"{'what':<52}{'s':>8}")
    print(f"{'pre-commit, cold (builds the hook environment)':<52}{cold:8.2f}")
    print(f"{'pre-commit run ddpify-check, warm, median':<52}{statistics.median(warm):8.2f}")
    print(f"{'pre-commit run ddpify-check, warm, best':<52}{min(warm):8.2f}")
    print(f"{'ddpify check on the same files, median':<52}{statistics.median(direct):8.2f}")


if __name__ == "__main__":
    main()
