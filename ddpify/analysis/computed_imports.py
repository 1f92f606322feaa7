"""Modules a project imports by a name computed at run time.

The pix2pix / CycleGAN family of research code, and many repositories after it, pick
the model's module with `importlib.import_module("models." + name + "_model")`, where
`name` is an option (`--model cut`), and look the class up in the module's `__dict__`.
Nothing here imports or runs the code: the name's expression is read as literal parts
and holes (`"models." + name + "_model"` -> `models.*_model`), the project's local
modules whose dotted names fit are its candidates, and a hole whose value can be read
from the code (a string literal, the default of an argparse option reached through
`opt.<name>`, a parameter that every call site in the project passes the same such
value) picks one of them. When a value cannot be known before run time, every
candidate is possibly imported: the project follows them all, and says so.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The callables that import a module by name (as written: `importlib.import_module`,
# `import_module` after `from importlib import import_module`, `__import__`).
_IMPORTERS = {"importlib.import_module", "import_module", "__import__"}
# How many parameter-to-caller hops a hole's value is followed through
# (`find_model_using_name(model_name)` <- `get_option_setter(model_name)` <- options).
MAX_HOPS = 3
# A hole in a module name matches one or more dotted identifiers.
_HOLE = r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"


@dataclass(frozen=True)
class Hole:
    """A part of the name that is computed: the expression, the function it is in and
    the file that function is in."""

    expr: ast.expr
    function: ast.FunctionDef | None
    path: Path | None = None


@dataclass
class ComputedImport:
    """One `import_module(<expr>)` call, resolved to the project's local modules."""

    importer: Path
    line: int
    written: str  # the statement, as the report shows it
    pattern: str  # the name with its holes as `*`: `models.*_model`
    candidates: list[Path] = field(default_factory=list)  # local modules that fit
    chosen: list[Path] = field(default_factory=list)  # those the project follows
    why: str = ""  # how `chosen` was picked, for the report
    known: bool = False  # every hole's value was read from the code


# A project's texts, for looking up options and call sites: (path, text) pairs.
Texts = Callable[[], Iterable[tuple[Path, str]]]


def computed_imports(
    importer: Path,
    text: str,
    modules: dict[str, Path],
    texts: Texts,
    parsed: dict[Path, ast.Module | None] | None = None,
) -> list[ComputedImport]:
    """The `import_module(<computed name>)` calls of `importer` (whose source is `text`),
    each with the local modules (`modules`: dotted name -> file) its name may be.

    `texts` gives the project's sources, read only when a hole's value is looked up, and
    parsed into `parsed` (pass one dict for all the modules of a project)."""
    if "import_module" not in text and "__import__" not in text:
        return []
    try:
        tree = ast.parse(text, str(importer))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    lookup = _Lookup(importer, tree, texts, {} if parsed is None else parsed)
    found = []
    for call, function in _import_calls(tree):
        parts = _name_parts(call.args[0], function)
        if parts is None:
            continue
        found.append(_resolve(importer, call, lines, parts, modules, lookup))
    return found


def _resolve(
    importer: Path,
    call: ast.Call,
    lines: list[str],
    parts: list[str | Hole],
    modules: dict[str, Path],
    lookup: _Lookup,
) -> ComputedImport:
    pattern = "".join(part if isinstance(part, str) else "*" for part in parts)
    written = lines[call.lineno - 1].strip() if call.lineno <= len(lines) else pattern
    found = ComputedImport(importer, call.lineno, written, pattern)
    found.candidates = _candidates(parts, modules)
    if not found.candidates:
        return found
    values = [part if isinstance(part, str) else lookup.value(part) for part in parts]
    if all(value is not None for value in values):
        name = "".join(value for value, _ in map(_with_source, values))  # type: ignore[misc]
        sources = [why for _, why in map(_with_source, values) if why]
        chosen = modules.get(name)
        found.known = True
        found.chosen = [chosen] if chosen in found.candidates else []
        found.why = f"`{name}`, from {' and '.join(sources)}" if sources else f"`{name}`"
        return found
    found.chosen = list(found.candidates)
    found.why = "the name is not known before run time, so every candidate is followed"
    return found


def _with_source(value: str | tuple[str, str]) -> tuple[str, str]:
    return value if isinstance(value, tuple) else (value, "")


def _import_calls(tree: ast.Module) -> Iterator[tuple[ast.Call, ast.FunctionDef | None]]:
    """The calls that import by a computed name, with the function each one is in."""
    for function in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        body = tree.body if function is None else function.body
        for node in _walk_own(body):
            if (
                isinstance(node, ast.Call)
                and _dotted(node.func) in _IMPORTERS
                and node.args
                and not isinstance(node.args[0], ast.Constant)
            ):
                yield node, function


def _walk_own(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of `body`, not entering nested functions or classes (each of those is
    walked as a function of its own)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    stack: list[ast.AST] = [node for node in reversed(body) if not isinstance(node, nested)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, nested))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


# -- the name as literal parts and holes -----------------------------------------------------


def _name_parts(expr: ast.expr, function: ast.FunctionDef | None) -> list[str | Hole] | None:
    """`"models." + name + "_model"` -> ["models.", Hole(name), "_model"]; None when the
    expression has no literal part to match modules by (a bare parameter: any module)."""
    expr = _assigned(expr, function) or expr
    parts = _parts(expr, function, depth=0)
    if not any(isinstance(part, str) and part.strip(".") for part in parts):
        return None
    return parts


def _parts(expr: ast.expr, function: ast.FunctionDef | None, depth: int) -> list[str | Hole]:
    if depth > 8:
        return [Hole(expr, function)]
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _parts(expr.left, function, depth + 1) + _parts(expr.right, function, depth + 1)
    if isinstance(expr, ast.JoinedStr):
        return [
            value.value if isinstance(value, ast.Constant) else Hole(value.value, function)
            for value in expr.values
            if isinstance(value, (ast.Constant, ast.FormattedValue))
        ]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod):
        return _percent_parts(expr, function)
    if _is_format_call(expr):
        return _format_parts(expr, function)  # type: ignore[arg-type]
    assigned = _assigned(expr, function) if depth == 0 else None
    if assigned is not None:
        return _parts(assigned, function, depth + 1)
    return [Hole(expr, function)]


def _percent_parts(expr: ast.BinOp, function: ast.FunctionDef | None) -> list[str | Hole]:
    """`"models.%s_model" % name`: the placeholders filled in order."""
    if not (isinstance(expr.left, ast.Constant) and isinstance(expr.left.value, str)):
        return [Hole(expr, function)]
    values = expr.right.elts if isinstance(expr.right, ast.Tuple) else [expr.right]
    pieces = re.split(r"%[sdr]", expr.left.value)
    if len(pieces) != len(values) + 1 or "%" in "".join(pieces):
        return [Hole(expr, function)]
    return _interleave(pieces, values, function)


def _is_format_call(expr: ast.expr) -> bool:
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "format"
        and isinstance(expr.func.value, ast.Constant)
        and isinstance(expr.func.value.value, str)
    )


def _format_parts(expr: ast.Call, function: ast.FunctionDef | None) -> list[str | Hole]:
    """`"models.{}_model".format(name)` and `"{name}".format(name=...)`."""
    template = expr.func.value.value  # type: ignore[attr-defined]
    fields = re.findall(r"\{(\w*)\}", template)
    pieces = re.split(r"\{\w*\}", template)
    keywords = {keyword.arg: keyword.value for keyword in expr.keywords if keyword.arg}
    values = []
    for index, name in enumerate(fields):
        if name and name in keywords:
            values.append(keywords[name])
        elif not name and index < len(expr.args):
            values.append(expr.args[index])
        else:
            return [Hole(expr, function)]
    if "{" in "".join(pieces) or "}" in "".join(pieces):
        return [Hole(expr, function)]
    return _interleave(pieces, values, function)


def _interleave(
    pieces: list[str], values: list[ast.expr], function: ast.FunctionDef | None
) -> list[str | Hole]:
    parts: list[str | Hole] = []
    for piece, value in zip(pieces, [*values, None]):
        parts.append(piece)
        if value is not None:
            parts += _parts(value, function, depth=1)
    return [part for part in parts if part != ""]


def _assigned(expr: ast.expr, function: ast.FunctionDef | None) -> ast.expr | None:
    """The value a local name is given, when it is given exactly one (in `function`, or
    at module level outside any function)."""
    if not isinstance(expr, ast.Name) or function is None:
        return None
    values = [
        node.value
        for node in _walk_own(function.body)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)
    ]
    return values[0] if len(values) == 1 else None


# -- candidates ---------------------------------------------------------------------------


def _candidates(parts: list[str | Hole], modules: dict[str, Path]) -> list[Path]:
    """The local modules whose dotted names fit the literal parts, in name order."""
    regex = re.compile(
        "".join(re.escape(part) if isinstance(part, str) else _HOLE for part in parts)
    )
    return [modules[name] for name in sorted(modules) if regex.fullmatch(name)]


def local_module_names(roots: Iterable[Path], files: Iterable[Path]) -> dict[str, Path]:
    """Dotted name -> file for the project's Python `files`, as seen from the first of
    `roots` (the entry's directory, then its parents) that holds each one."""
    names: dict[str, Path] = {}
    roots = list(roots)
    for path in files:
        for root in roots:
            try:
                relative = path.relative_to(root)
            except ValueError:
                continue
            parts = list(relative.parts[:-1])
            if relative.name != "__init__.py":
                parts.append(relative.stem)
            if parts and all(part.isidentifier() for part in parts):
                names.setdefault(".".join(parts), path)
            break
    return names


# -- the value of a hole ----------------------------------------------------------------------


class _Lookup:
    """Reads a hole's value from the code: a literal, an option's default, a parameter
    every caller passes the same such value. The project's texts are read on first need."""

    def __init__(
        self, path: Path, tree: ast.Module, texts: Texts, parsed: dict[Path, ast.Module | None]
    ) -> None:
        self.path = path
        self.tree = tree
        self._texts = texts
        self._parsed = parsed  # shared by the importers of one project

    def trees(self, *words: str) -> list[tuple[Path, ast.Module]]:
        """This module and the project's modules whose text holds one of `words` (only
        those are parsed, once per project)."""
        found = [(self.path, self.tree)]
        for path, text in self._texts():
            if path == self.path or not any(word in text for word in words):
                continue
            if path not in self._parsed:
                try:
                    self._parsed[path] = ast.parse(text, str(path))
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    self._parsed[path] = None
            tree = self._parsed[path]
            if tree is not None:
                found.append((path, tree))
        return found

    def value(self, hole: Hole, hops: int = MAX_HOPS) -> tuple[str, str] | None:
        """(value, where it comes from), or None when it cannot be known."""
        expr = _assigned(hole.expr, hole.function) or hole.expr
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value, ""
        if isinstance(expr, ast.Attribute):
            return self._option_default(expr.attr)
        if isinstance(expr, ast.Name) and hole.function is not None and hops > 0:
            return self._parameter(hole.function, hole.path or self.path, expr.id, hops)
        return None

    def _option_default(self, name: str) -> tuple[str, str] | None:
        """The string default of the one argparse option whose dest is `name`, unless a
        `set_defaults(name=...)` somewhere may change it."""
        defaults = set()
        for _, tree in self.trees("add_argument", "set_defaults"):
            for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
                attr = call.func.attr if isinstance(call.func, ast.Attribute) else None
                if attr == "add_argument" and _dest(call) == name:
                    defaults.add(_keyword_string(call, "default"))
                elif attr == "set_defaults" and any(k.arg == name for k in call.keywords):
                    return None
        if len(defaults) != 1 or None in defaults:
            return None
        value = defaults.pop()
        assert value is not None
        return value, f"the default of `--{name}` ('{value}')"

    def _parameter(
        self, function: ast.FunctionDef, path: Path, name: str, hops: int
    ) -> tuple[str, str] | None:
        """The value every call of `function` (defined in `path`) passes for `name`;
        None when there is no call, or calls pass different or unknown values."""
        arguments = function.args
        positional = [a.arg for a in (*arguments.posonlyargs, *arguments.args)]
        if name not in positional and name not in [a.arg for a in arguments.kwonlyargs]:
            return None
        index = positional.index(name) if name in positional else None
        values = set()
        for caller_path, call, caller in self._calls_of(function.name, path):
            passed = _argument(call, index, name)
            if passed is None:
                return None
            value = self.value(Hole(passed, caller, caller_path), hops - 1)
            if value is None:
                return None
            values.add(value)
        return values.pop() if len(values) == 1 else None

    def _calls_of(
        self, name: str, defined_in: Path
    ) -> Iterator[tuple[Path, ast.Call, ast.FunctionDef | None]]:
        """Calls of the function `name` of the module at `defined_in`: bare in that
        module, or as `<module>.name(...)` / after `from <module> import name` elsewhere
        (a function of the same name in another module is not this one)."""
        module = defined_in.parent.name if defined_in.name == "__init__.py" else defined_in.stem
        for path, tree in self.trees(name):
            imported = path == defined_in or _imports_name(tree, module, name)
            for caller in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
                body = tree.body if caller is None else caller.body
                for node in _walk_own(body):
                    if not isinstance(node, ast.Call):
                        continue
                    func = node.func
                    if isinstance(func, ast.Name) and func.id == name and imported:
                        yield path, node, caller
                    elif isinstance(func, ast.Attribute) and func.attr == name:
                        owner = _dotted(func.value) or ""
                        if owner.split(".")[-1] == module:
                            yield path, node, caller


def _imports_name(tree: ast.Module, module: str, name: str) -> bool:
    """`from <...module> import name` somewhere in `tree`."""
    return any(
        isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[-1] == module
        and any(alias.name == name and alias.asname is None for alias in node.names)
        for node in ast.walk(tree)
    )


def _argument(call: ast.Call, index: int | None, name: str) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    if index is not None and index < len(call.args):
        argument = call.args[index]
        return None if isinstance(argument, ast.Starred) else argument
    return None


def _dest(call: ast.Call) -> str | None:
    """The attribute an `add_argument` call sets: `dest=`, else the first long flag."""
    explicit = _keyword_string(call, "dest")
    if explicit:
        return explicit
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    for flag in flags:
        if flag.startswith("--"):
            return flag[2:].replace("-", "_")
    if flags and not flags[0].startswith("-"):
        return flags[0]
    return None


def _keyword_string(call: ast.Call, name: str) -> str | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            value = keyword.value
            return (
                value.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str)
                else None
            )
    return None
