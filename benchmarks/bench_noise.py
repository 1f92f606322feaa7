"""Loud findings of `ddpify check` on real, working DDP repositories.

    python benchmarks/bench_noise.py [--repos TSV] [--mirrors DIR] [--trees DIR]
                                     [--list] [--json FILE]

Each row of benchmarks/noise_repos.tsv pins a public repository that trains with DDP and
works (dino, mae, nanoGPT, YOLOX, timm, ...). Its Python files at that commit are
extracted (cached beside bench_realbugs.py's trees, outside the project) and checked
as a user would: default rules, each file inside its repository. Errors and warnings on
such code are either real latent bugs or noise; a linter that cries wolf is uninstalled,
so this counts them per repository and per rule, and `--list` prints each one to
review. A measurement: it always exits 0. Repositories whose mirror (a bare git dir at
`<mirrors>/<owner>+<name>/repo`, the `fetch` tool's layout) is missing are skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_realbugs import MIRRORS, ROOT, TREES, extract_tree, git_dir  # noqa: E402

REPOS = ROOT / "benchmarks" / "noise_repos.tsv"
LOUD = ("error", "warning")


def read_repos(path: Path) -> list[tuple[str, str]]:
    with path.open(newline="") as handle:
        return [(row["repo"], row["commit"]) for row in csv.DictReader(handle, delimiter="\t")]


def check(trees: list[Path]) -> list[dict]:
    command = [sys.executable, "-m", "ddpify", "check", *map(str, trees)]
    command += ["--output-format", "json", "--no-cache", "--isolated", "--exit-zero", "-q"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"ddpify check failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout or "[]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repos", type=Path, default=REPOS)
    parser.add_argument("--mirrors", type=Path, default=MIRRORS)
    parser.add_argument("--trees", type=Path, default=TREES)
    parser.add_argument("--list", action="store_true", help="print every loud finding")
    parser.add_argument("--json", type=Path, help="also write the counts as JSON here")
    args = parser.parse_args()
    if args.trees.resolve().is_relative_to(ROOT):
        sys.exit("--trees must be outside the project: fetched code stays out")

    trees: dict[Path, str] = {}
    skipped = []
    for repo, commit in read_repos(args.repos):
        gdir = git_dir(args.mirrors, repo)
        tree = extract_tree(gdir, commit, args.trees, repo) if gdir.is_dir() else None
        if tree is None:
            skipped.append(repo)
        else:
            trees[tree.resolve()] = repo
    if skipped:
        print(f"skipping {len(skipped)} repositories, mirror missing: {', '.join(skipped)}")
    if not trees:
        print("nothing to measure")
        return
    print(f"checking {len(trees)} repositories ...", flush=True)
    findings = check(sorted(trees))

    def repo_of(filename: str) -> str:
        path = Path(filename).resolve()
        return next((repo for tree, repo in trees.items() if path.is_relative_to(tree)), "?")

    loud = [f for f in findings if f["severity"] in LOUD]
    per_repo = Counter(repo_of(f["filename"]) for f in loud)
    per_code = Counter((f["code"], f["severity"]) for f in loud)
    if args.list:
        for f in loud:
            where = f"{repo_of(f['filename'])}:{Path(f['filename']).name}:{f['location']['row']}"
            print(f"{f['severity'][0]} {f['code']} {where} {f['message'][:110]}")
    print("\nloud findings per rule:")
    for (code, severity), count in sorted(per_code.items()):
        print(f"  {code} {severity:8} {count}")
    quiet = len(trees) - len(per_repo)
    counts = Counter(f["severity"] for f in findings)
    print(
        f"\n{len(trees)} repositories: {counts['error']} errors, {counts['warning']} warnings, "
        f"{counts['info']} infos; {quiet} repositories without a loud finding"
    )
    if args.json:
        summary = {
            "repositories": len(trees),
            "severity": dict(counts),
            "loud_per_rule": {f"{c} {s}": n for (c, s), n in sorted(per_code.items())},
            "loud_per_repository": dict(per_repo),
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
