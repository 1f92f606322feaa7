"""Mutations of real-looking training scripts, for fuzzing check, --fix and migrate.

Each mutation is a small, plausible edit of the kind real code and half-finished edits
contain: lines deleted, duplicated or swapped, code wrapped in a function, a class or an
`async def`, re-indented, decorated, walrus and `match` statements, f-strings, unicode
names, very long lines, deep nesting, CRLF line endings and a BOM. The result may not
compile; callers decide what to do with that (the linter must report DDP000, migrate
must refuse cleanly).

`benchmarks/fuzz.py` runs thousands; `tests/test_fuzz.py` runs a few with a fixed seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED_GLOBS = (
    "fixtures/migrate/*/before.py",
    "fixtures/migrate/*/after.py",
    "fixtures/clean/*.py",
    "fixtures/examples/*.py",
    "fixtures/verify/**/*.py",
    "fixtures/rules/*/*.py",
)


def seed_scripts() -> list[tuple[str, str]]:
    """(name, text) of every fixture script: the corpus the mutations start from."""
    seen: dict[str, str] = {}
    for pattern in SEED_GLOBS:
        for path in sorted(ROOT.glob(pattern)):
            seen.setdefault(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    return sorted(seen.items())


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True) or ["\n"]


def _pick(rng: random.Random, lines: list[str]) -> int:
    return rng.randrange(len(lines))


def delete_line(text: str, rng: random.Random) -> str:
    lines = _lines(text)
    del lines[_pick(rng, lines)]
    return "".join(lines)


def duplicate_line(text: str, rng: random.Random) -> str:
    lines = _lines(text)
    at = _pick(rng, lines)
    lines.insert(at, lines[at])
    return "".join(lines)


def swap_lines(text: str, rng: random.Random) -> str:
    lines = _lines(text)
    a, b = _pick(rng, lines), _pick(rng, lines)
    lines[a], lines[b] = lines[b], lines[a]
    return "".join(lines)


def _indented(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line if line.strip() else line for line in _lines(text))


def wrap_in_function(text: str, rng: random.Random) -> str:
    name = rng.choice(["run", "main", "_train", "experiment"])
    return f"def {name}():\n" + _indented(text) + f"\n\n{name}()\n"


def wrap_in_class(text: str, rng: random.Random) -> str:
    return "class Runner:\n    def fit(self):\n" + _indented(text, "        ")


def make_async(text: str, rng: random.Random) -> str:
    return "import asyncio\n\n\nasync def main():\n" + _indented(text) + "\n\nasyncio.run(main())\n"


def reindent(text: str, rng: random.Random) -> str:
    width = rng.choice(["  ", "\t", "        "])
    out = []
    for line in _lines(text):
        stripped = line.lstrip(" ")
        depth = (len(line) - len(stripped)) // 4
        out.append(width * depth + stripped)
    return "".join(out)


def decorate(text: str, rng: random.Random) -> str:
    decorator = rng.choice(["@torch.no_grad()", "@staticmethod", "@functools.cache", "@record"])
    lines = _lines(text)
    targets = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
    if not targets:
        return text
    at = rng.choice(targets)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at, indent + decorator + "\n")
    return "".join(lines)


def add_walrus(text: str, rng: random.Random) -> str:
    return text + "\nif (n := len(range(3))) > 1:\n    print(n)\n"


def add_match(text: str, rng: random.Random) -> str:
    return text + (
        "\nmatch __name__:\n"
        "    case '__main__':\n"
        "        torch.save({'step': 1}, 'ckpt.pt')\n"
        "    case _:\n"
        "        pass\n"
    )


def add_fstrings(text: str, rng: random.Random) -> str:
    return text + '\nprint(f"loss {1.0:.3f} at {__name__!r} {f"{2}"}")\n'


def unicode_names(text: str, rng: random.Random) -> str:
    for old, new in (("model", "modèle"), ("loss", "λoss"), ("epoch", "époque")):
        if rng.random() < 0.5:
            text = text.replace(old, new)
    return text


def long_line(text: str, rng: random.Random) -> str:
    terms = " + ".join(f"x{i}" for i in range(rng.choice([50, 300, 700])))
    return text + f"\ntotal = {terms}\n"


def deep_nesting(text: str, rng: random.Random) -> str:
    depth = rng.choice([20, 60, 150, 250, 1500])
    return text + "\nx = " + "(" * depth + "1" + ")" * depth + "\n"


def crlf(text: str, rng: random.Random) -> str:
    return text.replace("\r\n", "\n").replace("\n", "\r\n")


def bom(text: str, rng: random.Random) -> str:
    return "\ufeff" + text


def tabs_and_spaces(text: str, rng: random.Random) -> str:
    lines = _lines(text)
    at = _pick(rng, lines)
    lines[at] = lines[at].replace("    ", "\t", 1)
    return "".join(lines)


MUTATIONS: list[Callable[[str, random.Random], str]] = [
    delete_line,
    duplicate_line,
    swap_lines,
    wrap_in_function,
    wrap_in_class,
    make_async,
    reindent,
    decorate,
    add_walrus,
    add_match,
    add_fstrings,
    unicode_names,
    long_line,
    deep_nesting,
    crlf,
    bom,
    tabs_and_spaces,
]


def mutants(seed: int, count: int) -> Iterator[tuple[str, str, str]]:
    """`count` (label, source name, text) mutants, 1-3 mutations each, reproducible."""
    rng = random.Random(seed)
    seeds = seed_scripts()
    for index in range(count):
        name, text = seeds[rng.randrange(len(seeds))]
        applied = rng.sample(MUTATIONS, rng.choice([1, 1, 2, 3]))
        for mutation in applied:
            text = mutation(text, rng)
        label = f"#{index} {name} " + "+".join(m.__name__ for m in applied)
        yield label, name, text


def examine(text: str, filename: str = "fuzz.py") -> list[str]:
    """What a user would call a bug when running check, --fix and migrate on `text`.

    Refusals with a reason are fine (DDP000, the `parse` gate, "not migrated"); anything
    else is listed: a rule or pass that raised, a gate failure that asks for a bug report,
    an output that does not compile or lost a comment.
    """
    from ddpify import guarded
    from ddpify.engine import check_source
    from ddpify.files import SourceError, decode_source
    from ddpify.fixes import fix_until_stable
    from ddpify.gates import GateError, comments
    from ddpify.migrate import migrate_source
    from ddpify.rules import ALL_RULES

    # Run as the CLI runs: risky files isolated again, with their own time limit.
    guarded._local.inside = False
    try:
        text = decode_source(text.encode("utf-8", "surrogatepass"), filename).text
    except SourceError:
        return []
    problems: list[str] = []

    def lint(current: str):
        result = check_source(current, filename, ALL_RULES, force=True)
        problems.extend(f"check: {crash}" for crash in result.crashes)
        return result.diagnostics

    def output_problems(stage: str, output: str) -> None:
        if output == text:
            return  # nothing written
        try:
            compile(output, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            problems.append(f"{stage}: output does not compile: {exc}")
        lost = comments(text) - comments(output)
        if lost:
            problems.append(f"{stage}: lost comments {list(lost)[:2]}")

    stages = {
        "fix": lambda: fix_until_stable(text, lint, unsafe=True, filename=filename).text,
        "migrate": lambda: migrate_source(text, filename).output,
    }
    lint(text)
    for stage, run in stages.items():
        try:
            output_problems(stage, run())
        except GateError as exc:
            if exc.pass_name != "parse":
                problems.append(f"{stage}: gate failure (please report this): {exc}")
        except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
            problems.append(f"{stage}: internal error {type(exc).__name__}: {exc}")
    return problems
