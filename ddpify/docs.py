"""The rule pages: `rules/<CODE>.md` in the repository, `ddpify/_rule_docs` in the wheel."""

from __future__ import annotations

from pathlib import Path

HEADINGS = (
    "What it does",
    "Why is this bad?",
    "Example",
    "Use instead",
    "Fix safety",
    "References",
)


def docs_dir() -> Path:
    packaged = Path(__file__).parent / "_rule_docs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "rules"


def rule_page(code: str) -> str | None:
    path = docs_dir() / f"{code}.md"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def sections(page: str) -> dict[str, str]:
    """`## Heading` -> body text, in page order."""
    out: dict[str, str] = {}
    current: str | None = None
    for line in page.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def code_block(section: str) -> str:
    """The first ```python block of a section."""
    lines, inside = [], False
    for line in section.splitlines():
        if line.strip().startswith("```"):
            if inside:
                break
            inside = True
            continue
        if inside:
            lines.append(line)
    return "\n".join(lines) + "\n"
