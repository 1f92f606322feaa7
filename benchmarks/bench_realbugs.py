"""Recall and fix recognition of `ddpify check` on real DDP bug-fix commits.

    python benchmarks/bench_realbugs.py [--single-file] [--mirrors DIR] [--out DIR]
                                        [--trees DIR] [--json FILE] [--rows TSV] [--round N]

Each row of benchmarks/realbugs.tsv names one file in a public repository, the commit
before a fix (its parent) and the fix commit, and the catalogue code of the pitfall the
fix removes. For every row whose repository is fetched (a bare git dir at
`<mirrors>/<owner>+<name>/repo`, the layout the `fetch` tool writes) the two versions of
the file are checked with `ddpify check --select ALL --isolated --no-cache`, all rows in
one process.

By default each row is checked inside its repository: the Python files of the tree at
both commits are extracted (`git archive`, cached under --trees, outside the project,
reused by later runs) so `check` reads the local modules the file imports as it would
in a user's checkout (a guard, a saving helper or a loader factory defined elsewhere).
`--single-file` extracts the one file alone into a folder outside the project (a temp
dir unless --out): the evidence of other modules is invisible there.

Scores (a measurement: it always exits 0):

- **recall**: the expected code is reported on the "before" file (any severity).
- **fix recognition**, over the rows that were found: at least one finding with the
  expected code on "before" has no counterpart on "after". Lines are mapped through the
  diff (difflib over the two files): a finding on an unchanged line persists when "after"
  has one with the same code on the mapped line; a finding on a changed line persists
  when "after" has one with the same code anywhere in the lines that replaced it. So a
  fix counts when the finding it addressed is gone, even if the file keeps another
  instance of the pitfall elsewhere (pytorch/examples added `set_device` after the init,
  a second DDP010 it fixed in a later commit) — and a fix that only moves the finding
  to the rewritten line does not count. The line-independent view is reported beside it:
  "fewer" (fewer findings with the code on "after") and "clean after" (none at all).

The table is collected in rounds: a `# round: N` line starts the rows of round N (the
rows above the first such line are round 1, collected while the rules were written).
Recall and fix recognition are printed per round beside the totals, and `--round N`
scores one round alone (`--round 1` reproduces the first table's totals).

Rows whose mirror is missing are listed and skipped; with no mirror at all it says so
and exits 0. Nothing fetched is ever written inside the project.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "realbugs.tsv"
MIRRORS = Path("/work/.mirror")
TREES = Path(tempfile.gettempdir()) / "ddpify-realbugs-trees"


@dataclass
class Row:
    index: int
    repo: str
    file: str
    before: str
    after: str
    code: str
    description: str
    link: str
    round: int = 1
    found_before: int = 0
    found_after: int = 0
    gone: int = 0  # findings on "before" with no counterpart on "after"
    error: str = ""
    others_before: list[str] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)  # side -> the file checked

    @property
    def detected(self) -> bool:
        return self.found_before > 0

    @property
    def recognised(self) -> bool:
        return self.detected and self.gone > 0

    @property
    def fewer(self) -> bool:
        return self.detected and self.found_after < self.found_before

    @property
    def clean_after(self) -> bool:
        return self.detected and self.found_after == 0


ROUND_MARK = "# round:"


def read_rows(path: Path) -> list[Row]:
    """The rows of the table; a `# round: N` line starts the rows collected in round N
    (rows before any such line are round 1)."""
    header, records, current = None, [], 1
    for line in path.read_text().splitlines():
        if line.startswith(ROUND_MARK):
            current = int(line[len(ROUND_MARK) :].split()[0])
        if not line or line.startswith("#"):
            continue
        if header is None:
            header = line
            continue
        records.append((current, line))
    rows = []
    for i, (round_, line) in enumerate(records, 1):
        rec = next(csv.DictReader([header, line], delimiter="\t"))
        rows.append(Row(index=i, round=round_, **{k: (v or "").strip() for k, v in rec.items()}))
    return rows


def git_dir(mirrors: Path, repo: str) -> Path:
    return mirrors / repo.replace("/", "+") / "repo"


def git_show(gdir: Path, commit: str, path: str) -> bytes | None:
    done = subprocess.run(
        ["git", f"--git-dir={gdir}", "show", f"{commit}:{path}"], capture_output=True, check=False
    )
    return done.stdout if done.returncode == 0 else None


def extract(rows: list[Row], mirrors: Path, out: Path) -> list[Row]:
    """Write before/after of each row under out/<index>/; return the rows extracted."""
    ready = []
    for row in rows:
        gdir = git_dir(mirrors, row.repo)
        name = Path(row.file).name
        for side, commit in (("before", row.before), ("after", row.after)):
            data = git_show(gdir, commit, row.file)
            if data is None:
                row.error = f"cannot read {commit[:10]}:{row.file}"
                break
            target = out / f"{row.index:03d}" / side / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            row.paths[side] = target
        if not row.error:
            ready.append(row)
    return ready


def extract_tree(gdir: Path, commit: str, trees: Path, repo: str) -> Path | None:
    """The Python files of `repo` at `commit`, under trees/<owner>+<name>/<commit>/ (made
    once; a `.done` marker says the extraction finished). An empty `.git` folder marks
    the root as a checkout's, as the user's project would have one."""
    target = trees / repo.replace("/", "+") / commit
    if (target / ".done").is_file():
        return target
    if target.exists():
        subprocess.run(["rm", "-rf", str(target)], check=True)
    archive = subprocess.run(
        ["git", f"--git-dir={gdir}", "archive", "--format=tar", commit, "--", "*.py"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        return None
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    (target / ".git").mkdir(exist_ok=True)
    (target / ".done").write_text(commit)
    return target


def locate_in_trees(rows: list[Row], mirrors: Path, trees: Path) -> set[Path]:
    """Extract the trees of every row; return the files to check (two rows may name the
    same file at the same commit: it is checked once and scored for both)."""
    located: set[Path] = set()
    for row in rows:
        gdir = git_dir(mirrors, row.repo)
        sides = {}
        for side, commit in (("before", row.before), ("after", row.after)):
            tree = extract_tree(gdir, commit, trees, row.repo)
            path = tree / row.file if tree is not None else None
            if path is None or not path.is_file():
                row.error = f"cannot read {commit[:10]}:{row.file}"
                break
            sides[side] = path
        if not row.error:
            row.paths.update(sides)
            located.update(path.resolve() for path in sides.values())
    return located


def run_check(out: Path | list[Path]) -> list[dict]:
    targets = [str(p) for p in out] if isinstance(out, list) else [str(out)]
    command = [sys.executable, "-m", "ddpify", "check", *targets, "--select", "ALL"]
    command += ["--output-format", "json", "--no-cache", "--isolated", "--exit-zero", "-q"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"ddpify check failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout or "[]")


def line_map(before: list[str], after: list[str]) -> dict[int, range]:
    """1-based line of "before" -> the lines of "after" it became (one for an unchanged line,
    the whole replacement for a changed one, empty for a deleted one)."""
    mapping: dict[int, range] = {}
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for i in range(i1, i2):
            mapping[i + 1] = (
                range(j1 + i - i1 + 1, j1 + i - i1 + 2)
                if tag == "equal"
                else (range(j1 + 1, j2 + 1))
            )
    return mapping


def count_gone(before_rows: list[int], after_rows: list[int], mapping: dict[int, range]) -> int:
    return sum(1 for row in before_rows if not any(r in mapping.get(row, ()) for r in after_rows))


def score(rows: list[Row], findings: list[dict]) -> None:
    owners: dict[Path, list[tuple[int, str]]] = defaultdict(list)
    for row in rows:
        for side, path in row.paths.items():
            owners[path.resolve()].append((row.index, side))
    by_file: dict[tuple[int, str], list[tuple[str, int]]] = defaultdict(list)
    for item in findings:
        for key in owners.get(Path(item["filename"]).resolve(), ()):
            by_file[key].append((item["code"], item["location"]["row"]))
    for row in rows:
        before, after = by_file[(row.index, "before")], by_file[(row.index, "after")]
        mine_before = [line for code, line in before if code == row.code]
        mine_after = [line for code, line in after if code == row.code]
        row.found_before, row.found_after = len(mine_before), len(mine_after)
        row.others_before = sorted({code for code, _ in before} - {row.code})
        texts = [
            row.paths[side].read_text(errors="replace").splitlines() for side in ("before", "after")
        ]
        row.gone = count_gone(mine_before, mine_after, line_map(*texts))


def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "   n/a"


def round_scores(rows: list[Row]) -> dict[int, dict[str, int]]:
    """Recall and fix recognition of each collection round (the later rounds were
    collected after the rules, so they measure what the early rows cannot)."""
    scores = {}
    for number in sorted({r.round for r in rows}):
        mine = [r for r in rows if r.round == number]
        scores[number] = {
            "rows": len(mine),
            "detected": sum(r.detected for r in mine),
            "recognised": sum(r.recognised for r in mine),
        }
    return scores


def report(rows: list[Row], skipped: list[Row]) -> dict:
    detected = [r for r in rows if r.detected]
    recognised = [r for r in detected if r.recognised]
    clean = [r for r in detected if r.clean_after]
    fewer = [r for r in detected if r.fewer]
    codes = sorted({r.code for r in rows})
    print(f"rows scored: {len(rows)}  repos: {len({r.repo for r in rows})}  codes: {len(codes)}")
    print(f"recall:           {len(detected)}/{len(rows)} {pct(len(detected), len(rows))}")
    rate = pct(len(recognised), len(detected))
    print(f"fix recognition:  {len(recognised)}/{len(detected)} {rate}")
    print(f"fewer after:      {len(fewer)}/{len(detected)} {pct(len(fewer), len(detected))}")
    print(f"clean after:      {len(clean)}/{len(detected)} {pct(len(clean), len(detected))}\n")
    per_round = round_scores(rows)
    if len(per_round) > 1:
        for number, score_ in per_round.items():
            found, total, rec = score_["detected"], score_["rows"], score_["recognised"]
            print(
                f"round {number}: recall {found}/{total} {pct(found, total)}"
                f"  fix recognition {rec}/{found} {pct(rec, found)}"
            )
        print()
    print("code    rows  found  recognised")
    table = {}
    for code in codes:
        mine = [r for r in rows if r.code == code]
        found = sum(r.detected for r in mine)
        rec = sum(r.recognised for r in mine)
        table[code] = {"rows": len(mine), "found": found, "recognised": rec}
        print(f"{code}  {len(mine):5d}  {found:5d}  {rec:10d}")
    misses = [r for r in rows if not r.detected]
    unrecognised = [r for r in detected if not r.recognised]
    if misses:
        print("\nmissed on before (code not reported):")
        for r in misses:
            print(f"  #{r.index} {r.code} {r.repo}:{r.file} — {r.description}")
    if unrecognised:
        print("\nfix not recognised (every finding persists on after):")
        for r in unrecognised:
            print(f"  #{r.index} {r.code} {r.repo}:{r.file} {r.found_before}->{r.found_after}")
    if skipped:
        print("\nskipped:")
        for r in skipped:
            print(f"  #{r.index} {r.repo}:{r.file} — {r.error or 'mirror missing'}")
    return {
        "rows": len(rows),
        "detected": len(detected),
        "recognised": len(recognised),
        "fewer_after": len(fewer),
        "clean_after": len(clean),
        "per_code": table,
        "per_round": per_round,
        "per_row": [
            {
                "index": r.index,
                "repo": r.repo,
                "file": r.file,
                "code": r.code,
                "round": r.round,
                "before": r.found_before,
                "after": r.found_after,
                "detected": r.detected,
                "recognised": r.recognised,
            }
            for r in rows
        ],
        "skipped": [f"{r.repo}:{r.file}" for r in skipped],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument(
        "--mirrors", type=Path, default=MIRRORS, help="<owner>+<name>/repo live here"
    )
    parser.add_argument(
        "--single-file",
        action="store_true",
        help="check each file alone, without the modules of its repository",
    )
    parser.add_argument(
        "--out", type=Path, help="--single-file: extract here (default: a temp dir)"
    )
    parser.add_argument(
        "--trees", type=Path, default=TREES, help=f"cache of extracted trees ({TREES})"
    )
    parser.add_argument("--json", type=Path, help="also write the scores as JSON here")
    parser.add_argument(
        "--round", type=int, help="score only the rows of this collection round (`# round: N`)"
    )
    args = parser.parse_args()

    rows = read_rows(args.rows)
    if args.round is not None:
        rows = [r for r in rows if r.round == args.round]
    present = [r for r in rows if git_dir(args.mirrors, r.repo).is_dir()]
    missing = [r for r in rows if r not in present]
    if not present:
        print(f"no mirror under {args.mirrors} for any of {len(rows)} rows; nothing to measure")
        return
    if missing:
        names = sorted({r.repo for r in missing})
        print(f"skipping {len(missing)} rows, mirror missing: {', '.join(names)}")
    for place in (args.out, args.trees):
        if place is not None and place.resolve().is_relative_to(ROOT):
            sys.exit("--out and --trees must be outside the project: fetched code stays out")
    if args.single_file:
        with tempfile.TemporaryDirectory(prefix="ddpify-realbugs-") as tmp:
            out = args.out or Path(tmp)
            ready = extract(present, args.mirrors, out)
            score(ready, run_check(out))
    else:
        located = locate_in_trees(present, args.mirrors, args.trees)
        ready = [r for r in present if not r.error]
        score(ready, run_check(sorted(located)))
    print("mode: " + ("single file" if args.single_file else "file inside its repository"))
    result = report(ready, [r for r in present if r.error])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
