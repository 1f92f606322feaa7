"""Jupyter notebooks: lint the code cells as one script, report positions as cell and line
(`nb.ipynb:cell 3:2:5`, as ruff does), and write fixes back into the cells with the outputs,
metadata, key order and indentation of the JSON left as they were.

The code cells are joined into one virtual script. Each cell is followed by a marker
comment at column 0 (cells are complete statements, so a comment between them is always
valid), which lets the fixed script be split back into its cells. IPython syntax that is
not Python (`%magic`, `!shell`, `%%cell magic`, `help?`) is replaced line by line with a
`pass` carrying the line's index, and restored on the way back.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ddpify.diagnostics import Diagnostic, Edit, Location
from ddpify.engine import FileResult, check_source, parse_error
from ddpify.files import SourceError
from ddpify.rules.base import Rule

NOTEBOOK_SUFFIX = ".ipynb"
CELL_MARK = "# ddpify: end of cell {index}"
_CELL_MARK_RE = re.compile(r"^# ddpify: end of cell (\d+)$")
_MAGIC_RE = re.compile(r"^(\s*)pass  # ddpify: ipython line (\d+)$")


def is_notebook(path: str) -> bool:
    return str(path).endswith(NOTEBOOK_SUFFIX)


_HELP_RE = re.compile(r"^\s*\??[\w.]+\?{0,2}\s*$")
# `files = !ls`, `version = %sx python --version`: a shell or magic result assigned.
_ASSIGNED_MAGIC_RE = re.compile(r"^\s*[\w.]+(\s*,\s*[\w.]+)*\s*,?\s*=\s*[!%]")


def _is_ipython(line: str) -> bool:
    """`%magic`, `!shell`, `x = !shell`, `name?` / `?name` help: IPython, not Python."""
    stripped = line.strip()
    if stripped.startswith(("%", "!")) or _ASSIGNED_MAGIC_RE.match(stripped):
        return True
    return "?" in stripped and bool(_HELP_RE.match(stripped))


@dataclass
class Notebook:
    path: str
    document: dict[str, Any]
    raw: bytes
    # The virtual script, and for each of its lines the (1-based cell, 1-based row) it
    # came from; marker lines map to None.
    text: str = ""
    origins: list[tuple[int, int] | None] = field(default_factory=list)
    ipython_lines: list[str] = field(default_factory=list)

    @property
    def cells(self) -> list[dict[str, Any]]:
        return self.document["cells"]


def read_notebook(data: bytes, path: str) -> Notebook:
    """Parse a notebook and build its virtual script; SourceError when it is not one."""
    try:
        document = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise SourceError(f"notebook is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise SourceError(f"not a valid notebook (JSON): {exc}") from None
    cells = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise SourceError("not a valid notebook: no list of cells")
    notebook = Notebook(path, document, data)
    _build_script(notebook)
    return notebook


def _cell_text(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    if isinstance(source, list):
        return "".join(str(part) for part in source)
    return str(source)


def _build_script(notebook: Notebook) -> None:
    lines: list[str] = []
    for index, cell in enumerate(notebook.cells, start=1):
        if cell.get("cell_type") != "code":
            continue
        cell_lines = _cell_text(cell).splitlines()
        cell_magic = bool(cell_lines) and cell_lines[0].lstrip().startswith("%%")
        continued = False  # a magic or shell line ending in `\` goes on in the next line
        for row, line in enumerate(cell_lines, start=1):
            if cell_magic or continued or _is_ipython(line):
                if not continued:  # continuation lines keep the first line's indent
                    indent = "" if cell_magic else line[: len(line) - len(line.lstrip())]
                continued = line.rstrip().endswith("\\")
                line = f"{indent}pass  # ddpify: ipython line {len(notebook.ipython_lines)}"
                notebook.ipython_lines.append(cell_lines[row - 1])
            lines.append(line)
            notebook.origins.append((index, row))
        lines.append(CELL_MARK.format(index=index))
        notebook.origins.append(None)
    notebook.text = "".join(line + "\n" for line in lines)


def _position(notebook: Notebook, location: Location) -> tuple[int | None, Location]:
    origin = None
    if 0 < location.row <= len(notebook.origins):
        origin = notebook.origins[location.row - 1]
    if origin is None:
        return None, location
    return origin[0], Location(origin[1], location.column)


def to_cells(notebook: Notebook, diagnostic: Diagnostic) -> Diagnostic:
    """A finding of the virtual script, with its position as cell and line."""
    cell, start = _position(notebook, diagnostic.location)
    _, end = _position(notebook, diagnostic.end_location)
    fix = diagnostic.fix
    if fix is not None:
        edits = tuple(
            Edit(
                e.content,
                _position(notebook, e.location)[1],
                _position(notebook, e.end_location)[1],
            )
            for e in fix.edits
        )
        fix = replace(fix, edits=edits)
    return replace(diagnostic, location=start, end_location=end, fix=fix, cell=cell)


def check_notebook(data: bytes, filename: str, rule_types: Sequence[type[Rule]]) -> FileResult:
    try:
        notebook = read_notebook(data, filename)
    except SourceError as exc:
        return FileResult(filename, [parse_error(filename, f"cannot read notebook: {exc}")])
    result = check_source(notebook.text, filename, rule_types)
    result.diagnostics = [to_cells(notebook, d) for d in result.diagnostics]
    return result


def cell_sources(notebook: Notebook, text: str) -> dict[int, str]:
    """The source of each code cell (by 1-based cell number) in a (fixed) virtual script,
    IPython lines restored; SourceError when the cells cannot be told apart."""
    sources: dict[int, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        mark = _CELL_MARK_RE.match(line)
        if mark:
            sources[int(mark.group(1))] = current
            current = []
            continue
        magic = _MAGIC_RE.match(line)
        if magic and int(magic.group(2)) < len(notebook.ipython_lines):
            line = notebook.ipython_lines[int(magic.group(2))]
        current.append(line)
    code_cells = [i for i, c in enumerate(notebook.cells, start=1) if c.get("cell_type") == "code"]
    if current or sorted(sources) != code_cells:
        raise SourceError("the fixed cells could not be told apart; the notebook was not written")
    result = {}
    for index, lines in sources.items():
        old = _cell_text(notebook.cells[index - 1])
        result[index] = "\n".join(lines) + ("\n" if old.endswith("\n") and lines else "")
    return result


def with_script(notebook: Notebook, text: str) -> bytes:
    """The notebook with its code cells replaced by those of the (fixed) virtual script;
    everything else (outputs, metadata, key order, indentation) as it was."""
    for index, new in cell_sources(notebook, text).items():
        cell = notebook.cells[index - 1]
        if new != _cell_text(cell):
            cell["source"] = _as_source(new, cell.get("source"))
    return _dump(notebook)


def cell_diff(notebook: Notebook, text: str) -> str:
    """A unified diff per changed code cell, headed `path:cell N`, as ruff shows them."""
    parts = []
    for index, new in cell_sources(notebook, text).items():
        old = _cell_text(notebook.cells[index - 1])
        if new != old:
            lines = difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{notebook.path}:cell {index}",
                tofile=f"b/{notebook.path}:cell {index}",
            )
            parts.append("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    return "".join(parts)


def _as_source(text: str, old: Any) -> Any:
    if isinstance(old, str):
        return text
    return text.splitlines(keepends=True)


def _dump(notebook: Notebook) -> bytes:
    """JSON laid out like the original: its indentation, escaping and final newline."""
    raw = notebook.raw.decode("utf-8-sig")
    indent_match = re.search(r"^\{\s*\n([ \t]+)\"", raw)
    indent: int | str | None = None
    if indent_match:
        whitespace = indent_match.group(1)
        indent = len(whitespace) if set(whitespace) == {" "} else whitespace
    ascii_only = not any(ord(ch) > 127 for ch in raw)
    text = json.dumps(notebook.document, indent=indent, ensure_ascii=ascii_only)
    if indent is None and ", " not in raw and ": " not in raw:
        text = json.dumps(notebook.document, separators=(",", ":"), ensure_ascii=ascii_only)
    if raw.endswith("\n"):
        text += "\n"
    bom = b"\xef\xbb\xbf" if notebook.raw.startswith(b"\xef\xbb\xbf") else b""
    return bom + text.encode("utf-8")
