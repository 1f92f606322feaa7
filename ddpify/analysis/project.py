"""A project: entry scripts and the local modules they import, each parsed once.

Research code is rarely one file: `train.py` calls a `Trainer` in `trainer.py`, which
saves through `utils.save_on_master()` and iterates a loader built in `data.py`. The
project follows imports the way Python resolves them for `python train.py` (the
script's directory first, packages through `__init__.py`, relative imports from the
importing module's package), never outside the directory tree it started from and
never into site-packages. Nothing is imported or run: modules are read and parsed.

Discovery is bounded (`MAX_MODULES`) and lazy in the checker (`ProjectIndex`): a file
that imports nothing local costs one scan of its import statements.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable

import libcst as cst

from ddpify.analysis.computed_imports import ComputedImport, computed_imports, local_module_names
from ddpify.analysis.names import ImportMap
from ddpify.analysis.tree import Tree
from ddpify.files import SourceError, SourceFile, decode_source, read_bounded, read_source
from ddpify.guarded import risky
from ddpify.libcst_speed import parse_module

MAX_MODULES = 64
# How far above an entry script a package root may be (`python tools/train.py` importing
# `from mypkg import ...`, with `mypkg/` beside `tools/`).
MAX_ROOT_ASCENT = 2
# How many packages re-exporting a name (`from .util import f` in __init__.py) a lookup
# passes through to the module that defines it.
MAX_REEXPORTS = 2
# Files that mark a repository or package root: the project never reaches above one.
_ROOT_MARKERS = (".git", "pyproject.toml", "setup.py")


@dataclass
class ProjectModule:
    path: Path
    source: SourceFile
    imports: list[Path] = field(default_factory=list)  # local modules it imports directly

    @property
    def text(self) -> str:
        return self.source.text


@dataclass
class Project:
    """The modules reachable from `entries`, in discovery order (entries first)."""

    entries: list[Path]
    modules: dict[Path, ProjectModule] = field(default_factory=dict)
    # Local imports that could not be followed: (importer, what, why).
    problems: list[tuple[Path, str, str]] = field(default_factory=list)
    truncated: bool = False  # more than MAX_MODULES local modules
    # `importlib.import_module(<computed name>)` calls and the local modules they may load
    computed: list[ComputedImport] = field(default_factory=list)

    @classmethod
    def discover(
        cls,
        entries: Sequence[str | Path],
        *,
        limit: int = MAX_MODULES,
        read: Callable[[Path], SourceFile] = read_source,
    ) -> Project:
        """Read the entries and, breadth first, the local modules they import. An entry
        that cannot be read raises SourceError; an imported module that cannot be read or
        parsed is recorded in `problems` and not followed."""
        paths = [Path(entry).resolve() for entry in entries]
        project = cls(paths)
        boundary = common_root(paths)
        queue: list[Path] = []
        for path in paths:
            project.modules[path] = ProjectModule(path, read(path))
            queue.append(path)
        computed = _ComputedImports(paths, boundary)
        while queue:
            path = queue.pop(0)
            module = project.modules[path]
            for found, what in chain(
                local_imports(path, module.text, paths, boundary),
                computed.follow(path, module.text, project.computed),
            ):
                if found in module.imports:
                    continue
                module.imports.append(found)
                if found in project.modules:
                    continue
                if len(project.modules) >= limit:
                    project.truncated = True
                    continue
                try:
                    project.modules[found] = ProjectModule(found, read(found))
                except SourceError as exc:
                    project.problems.append((path, what, str(exc)))
                    continue
                queue.append(found)
        return project

    @property
    def is_single_file(self) -> bool:
        return len(self.modules) == len(self.entries)

    @property
    def root(self) -> Path:
        """The directory the project lies in (its modules never leave it)."""
        return common_root(self.entries)

    def relative(self, path: Path) -> str:
        """`path` as shown to the user: relative to the project's root."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


class _ComputedImports:
    """The modules `import_module(<computed name>)` calls may load (see
    `analysis/computed_imports.py`); the project's files are listed on first need."""

    def __init__(self, entries: Sequence[Path], boundary: Path) -> None:
        self.entries = entries
        self.boundary = boundary
        self._names: dict[str, Path] | None = None
        self._parsed: dict[Path, ast.Module | None] = {}  # shared by every lookup

    def names(self) -> dict[str, Path]:
        if self._names is None:
            files = [
                path.resolve()
                for index, path in enumerate(_python_files(self.boundary))
                if index < MAX_SCANNED_FILES
            ]
            self._names = local_module_names(_roots(self.entries, self.boundary), files)
        return self._names

    def texts(self) -> Iterator[tuple[Path, str]]:
        for path in self.names().values():
            read = _read_text(path)
            if read is not None:
                yield path, read[0]

    def follow(
        self, path: Path, text: str, record: list[ComputedImport]
    ) -> Iterator[tuple[Path, str]]:
        """The modules to follow from `path`'s computed imports (each call recorded)."""
        if "import_module" not in text and "__import__" not in text:
            return
        for found in computed_imports(path, text, self.names(), self.texts, self._parsed):
            record.append(found)
            for chosen in found.chosen:
                yield chosen, found.written


def copy_python_files(root: Path, destination: Path, limit: int = 5000) -> Path:
    """Copy the .py files below `root` (not hidden or virtual-env folders) into
    `destination`, keeping their layout: a project to run beside the original."""
    copied = 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part.startswith(".") or part in _NOT_SOURCE for part in relative.parts[:-1]):
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied += 1
        if copied >= limit:
            break
    return destination


_NOT_SOURCE = {"venv", "env", "site-packages", "node_modules", "__pycache__", "build", "dist"}


# -- import resolution -------------------------------------------------------------------


def local_imports(
    importer: Path, text: str, entries: Sequence[Path], boundary: Path
) -> Iterator[tuple[Path, str]]:
    """The local modules `importer`'s import statements load, with the import as written.

    Read with Python's own `ast` (cheap, and it does not run anything); a file it
    cannot parse imports nothing as far as discovery goes."""
    if "import" not in text:
        return
    try:
        tree = ast.parse(text, str(importer))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    roots = _roots(entries, boundary)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                for path in _resolve_absolute(alias.name, roots, boundary):
                    yield path, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names if alias.name != "*"]
            shown = f"from {'.' * node.level}{node.module or ''} import ..."
            if node.level:
                found = _resolve_relative(importer, node.level, node.module, names, boundary)
            else:
                found = _resolve_absolute(node.module or "", roots, boundary, names)
            for path in found:
                yield path, shown


def _roots(entries: Sequence[Path], boundary: Path) -> list[Path]:
    """Where top-level imports are looked up: each entry's directory (Python's
    sys.path[0]), then its parents up to MAX_ROOT_ASCENT levels, inside `boundary`."""
    roots: list[Path] = []
    for entry in entries:
        directory = entry.parent
        for _ in range(MAX_ROOT_ASCENT + 1):
            if directory not in roots and _within(directory, boundary):
                roots.append(directory)
            directory = directory.parent
    return roots


def _resolve_absolute(
    dotted: str, roots: Iterable[Path], boundary: Path, names: Sequence[str] = ()
) -> list[Path]:
    if not dotted:
        return []
    parts = dotted.split(".")
    for root in roots:
        found = _module_files(root, parts, names)
        if found:
            return [path for path in found if _within(path, boundary)]
    return []


def _resolve_relative(
    importer: Path, level: int, dotted: str | None, names: Sequence[str], boundary: Path
) -> list[Path]:
    base = importer.parent
    for _ in range(level - 1):
        base = base.parent
    parts = dotted.split(".") if dotted else []
    if not parts:  # `from . import utils, models`: submodules of the package
        found = [base / "__init__.py"] if (base / "__init__.py").is_file() else []
        found += [p for name in names for p in _module_files(base, [name], ())]
        return [path for path in found if _within(path, boundary)]
    return [path for path in _module_files(base, parts, names) if _within(path, boundary)]


def _module_files(root: Path, parts: Sequence[str], names: Sequence[str]) -> list[Path]:
    """The files `import a.b` executes below `root` (a/__init__.py, a/b.py or
    a/b/__init__.py), plus `from a.b import c` where `c` is a submodule."""
    found: list[Path] = []
    directory = root
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        package = directory / part
        if (package / "__init__.py").is_file():
            found.append(package / "__init__.py")
            directory = package
            if last:
                found += [
                    package / f"{name}.py" for name in names if (package / f"{name}.py").is_file()
                ]
                found += [
                    package / name / "__init__.py"
                    for name in names
                    if (package / name / "__init__.py").is_file()
                ]
            continue
        if last and (directory / f"{part}.py").is_file():
            found.append(directory / f"{part}.py")
            return [path.resolve() for path in found]
        if package.is_dir() and not last:  # a namespace package (no __init__.py)
            directory = package
            continue
        return []
    return [path.resolve() for path in found]


def _within(path: Path, boundary: Path) -> bool:
    if "site-packages" in path.parts or "dist-packages" in path.parts:
        return False
    try:
        path.resolve().relative_to(boundary)
    except ValueError:
        return False
    return True


def common_root(paths: Sequence[Path]) -> Path:
    """The directory the project may not leave: the entries' common directory, widened
    to the nearest enclosing repository or package root within MAX_ROOT_ASCENT levels."""
    common = Path(*_common_parts([p.parent.parts for p in paths])) if paths else Path.cwd()
    top = common
    for _ in range(MAX_ROOT_ASCENT):
        if top.parent == top:
            break
        if _is_root_folder(top.parent):
            return top.parent
        top = top.parent
    return common


def _common_parts(all_parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    first = all_parts[0]
    length = len(first)
    for parts in all_parts[1:]:
        length = min(length, len(parts))
        for index in range(length):
            if parts[index] != first[index]:
                length = index
                break
    return first[:length]


# -- one question over several modules ------------------------------------------------------


class ProjectView:
    """The questions `Tree` answers, over every module of a project at once.

    Nodes keep to their module: `statement`, `function`, `parent`, `code` and `qualify`
    use the tree the node belongs to. The roles analysis searches through the view and
    returns what lies in the module it was asked about.
    """

    def __init__(self, trees: Sequence[Tree]) -> None:
        self.trees = list(trees)
        self._owner: dict[int, Tree] = {}
        self.parent = _Parents(self)

    @property
    def view(self) -> ProjectView:
        return self

    def owns(self, node: cst.CSTNode) -> bool:
        return self.owner(node) is not None

    def owner(self, node: cst.CSTNode) -> Tree | None:
        found = self._owner.get(id(node))
        if found is not None:
            return found
        for tree in self.trees:
            if node in tree.order:
                self._owner[id(node)] = tree
                return tree
        return None

    def find(self, kind: type, where: Callable[[cst.CSTNode], bool] | None = None) -> list:
        return [node for tree in self.trees for node in tree.find(kind, where)]

    def calls_where(self, test: Callable[[cst.Call], bool]) -> list[cst.Call]:
        return [call for tree in self.trees for call in tree.calls_where(test)]

    def calls_to(self, *names: str) -> list[cst.Call]:
        return [call for tree in self.trees for call in tree.calls_to(*names)]

    def qualified_calls(self) -> list[tuple[cst.Call, str | None]]:
        return [pair for tree in self.trees for pair in tree.qualified_calls()]

    def call_names(self) -> list[tuple[cst.Call, str | None, str | None]]:
        return [triple for tree in self.trees for triple in tree.call_names()]

    def functions(self) -> dict[str, cst.FunctionDef]:
        found: dict[str, cst.FunctionDef] = {}
        for tree in self.trees:
            for name, func in tree.functions().items():
                found.setdefault(name, func)
        return found

    def _on_owner(self, node: cst.CSTNode, method: str, *args, default=None):
        tree = self.owner(node)
        return getattr(tree, method)(node, *args) if tree is not None else default

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement | None:
        return self._on_owner(node, "statement")

    def function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return self._on_owner(node, "function")

    def scope(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._on_owner(node, "scope")

    def inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        return bool(self._on_owner(node, "inside", container, default=False))

    def within(self, container: cst.CSTNode, kind: type = cst.CSTNode) -> Iterator:
        tree = self.owner(container)
        return tree.within(container, kind) if tree is not None else iter(())

    def code(self, node: cst.CSTNode) -> str:
        return self._on_owner(node, "code", default="")

    def names_in(self, node: cst.CSTNode) -> frozenset[str]:
        return self._on_owner(node, "names_in", default=frozenset())

    def qualify(self, expr: cst.BaseExpression) -> str | None:
        return self._on_owner(expr, "qualify")


class _Parents:
    """`view.parent.get(node)`, as on a Tree."""

    def __init__(self, view: ProjectView) -> None:
        self.view = view

    def get(self, node, default=None):
        tree = self.view.owner(node)
        return tree.parent.get(node, default) if tree is not None else default

    def __getitem__(self, node):
        tree = self.view.owner(node)
        if tree is None:
            raise KeyError(node)
        return tree.parent[node]

    def __contains__(self, node) -> bool:
        tree = self.view.owner(node)
        return tree is not None and node in tree.parent


# -- helpers defined in another module, for the checker ------------------------------------


@dataclass
class LocalFunction:
    """A function a checked file imports from a local module, parsed from that module."""

    node: cst.FunctionDef
    imports: ImportMap  # the defining module's imports (to qualify its calls)
    path: Path
    digest: str  # sha256 of the module's bytes: a cached result depends on it


@dataclass
class LocalClass:
    """A class a checked file imports from a local module (`from data import MyDataset`)."""

    node: cst.ClassDef
    imports: ImportMap
    path: Path
    digest: str

    def methods(self) -> list[cst.FunctionDef]:
        body = self.node.body.body if isinstance(self.node.body, cst.IndentedBlock) else ()
        return [statement for statement in body if isinstance(statement, cst.FunctionDef)]


_Definition = cst.FunctionDef | cst.ClassDef | cst.BaseExpression


class StampedCache:
    """What was computed from each file, kept while the file is unchanged (same mtime and
    size). One entry per path: a new version replaces the old, so a language server whose
    user saves the same helper all day keeps one copy of it, not one per save."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[int, int], object]] = {}

    def get(self, path: Path, compute):
        """compute(path), or the value kept from the last call while `path` is unchanged;
        None when `path` cannot be stat'ed."""
        try:
            info = path.stat()
        except OSError:
            self._entries.pop(path, None)
            return None
        stamp = (info.st_mtime_ns, info.st_size)
        kept = self._entries.get(path)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        value = compute(path)
        self._entries[path] = (stamp, value)
        return value


class LocalFunctions:
    """`utils.save_checkpoint` -> its definition in ./utils.py, for a file being checked.

    Names come from `ImportMap.qualify_local`: absolute (`utils.save_checkpoint`) or as a
    relative import wrote them (`.utils.save_checkpoint`, `..data.build_loader`), which
    resolve from the checked file's package.

    Lazy: nothing is read until a rule asks about an imported name, and then only the
    module it names (beside the file, or up to MAX_ROOT_ASCENT directories above, inside
    nothing but local folders). Parsed modules are shared by the whole run."""

    _parsed = StampedCache()  # parsed modules, shared by the whole run

    def __init__(self, filename: str | None) -> None:
        self.file = Path(filename).resolve() if filename else None
        self.used: dict[str, str] = {}  # path -> digest of each module consulted
        self._found: dict[str, tuple[_Definition, ImportMap, Path, str] | None] = {}
        # (scan, module) -> what the scan of the project's files found, once per check:
        # a rule asks about a helper's importers for each function it holds.
        self._scans: dict[tuple[Callable, Path], list[tuple[Path, str]]] = {}

    def function(self, qualified: str) -> LocalFunction | None:
        found = self._definition(qualified)
        if found is None or not isinstance(found[0], cst.FunctionDef):
            return None
        return LocalFunction(*found)

    def class_(self, qualified: str) -> LocalClass | None:
        found = self._definition(qualified)
        if found is None or not isinstance(found[0], cst.ClassDef):
            return None
        return LocalClass(*found)

    def functions_in(self, qualified: str) -> list[LocalFunction]:
        """The functions a module-level table holds (`DATASET_GETTERS = {"cifar10":
        get_cifar10, ...}`, a list or tuple of them), each defined in the same module;
        empty when `qualified` is no such table."""
        found = self._definition(qualified)
        if found is None or not isinstance(found[0], (cst.Dict, cst.List, cst.Tuple)):
            return []
        table, imports, path, digest = found
        elements = (
            [element.value for element in table.elements if isinstance(element, cst.DictElement)]
            if isinstance(table, cst.Dict)
            else [element.value for element in table.elements]
        )
        module_name = qualified.rpartition(".")[0]
        functions = []
        for value in elements:
            if isinstance(value, cst.Name):
                function = self.function(f"{module_name}.{value.value}")
                if function is not None and function.path == path:
                    functions.append(function)
        return functions

    def _definition(self, qualified: str) -> tuple[_Definition, ImportMap, Path, str] | None:
        if self.file is None or qualified.startswith("torch."):
            return None
        if "." not in qualified:
            return None
        if qualified not in self._found:
            self._found[qualified] = self._lookup(qualified)
        found = self._found[qualified]
        if found is not None:
            self.used[str(found[2])] = found[3]
        return found

    def distributed_importers(self) -> list[Path]:
        """The modules of the project that import the checked file and run distributed
        (see `distributed_importers`); each is recorded as a dependency of the result."""
        if self.file is None:
            return []
        return self.distributed_importers_of(self.file)

    def distributed_importers_of(self, path: Path) -> list[Path]:
        """`distributed_importers` of a module of the project (recorded as dependencies
        of the result, as the checked file's own are)."""
        return self._recorded(self._scan(distributed_importers, path))

    def importers_of(self, path: Path) -> list[Path]:
        """`importers` of a module of the project (recorded as dependencies)."""
        return self._recorded(self._scan(importers, path))

    def _scan(self, scan: Callable, path: Path) -> list[tuple[Path, str]]:
        key = (scan, path)
        if key not in self._scans:
            self._scans[key] = scan(path)
        return self._scans[key]

    def _recorded(self, found: list[tuple[Path, str]]) -> list[Path]:
        for path, digest in found:
            self.used[str(path)] = digest
        return [path for path, _ in found]

    def ddp_wrapping_modules(self) -> list[Path]:
        """The other modules of the project that wrap models in DDP (recorded as
        dependencies of the result)."""
        if self.file is None:
            return []
        found = ddp_wrapping_modules(self.file)
        for path, digest in found:
            self.used[str(path)] = digest
        return [path for path, _ in found]

    def importing_modules(self) -> list[tuple[Path, cst.Module, ImportMap]]:
        """The parsed modules of the project that import the checked file, distributed
        or not (see `importers`): where its functions' call sites are. Each is recorded
        as a dependency of the result."""
        if self.file is None:
            return []
        found = []
        for path, digest in self._scan(importers, self.file):
            parsed = self._parse(path)
            if parsed is None:
                continue
            module, imports, _ = parsed
            self.used[str(path)] = digest
            found.append((path, module, imports))
        return found

    def _candidates(self, module_name: str) -> list[Path]:
        """The files that may define names of `module_name`, the most specific first."""
        assert self.file is not None
        boundary = common_root([self.file])
        if module_name.startswith("."):
            dotted = module_name.lstrip(".")
            level = len(module_name) - len(dotted)
            found = _resolve_relative(self.file, level, dotted or None, (), boundary)
            return list(reversed(found))
        found = _resolve_absolute(module_name, _roots([self.file], boundary), boundary)
        return [
            path
            for path in reversed(found)
            if path.name != "__init__.py" or module_name.split(".")[-1] == path.parent.name
        ]

    def _lookup(self, qualified: str) -> tuple[_Definition, ImportMap, Path, str] | None:
        dots = len(qualified) - len(qualified.lstrip("."))
        module_name, _, name = qualified[dots:].rpartition(".")
        module_name = "." * dots + module_name  # `.helper` -> the package's __init__.py
        return self._defined_in(self._candidates(module_name), name, MAX_REEXPORTS)

    def parse(self, path: Path) -> tuple[cst.Module, ImportMap, str] | None:
        """The parsed local module at `path` (module, its imports, sha256), shared by the
        run; None when it cannot be read or parsed."""
        return self._parse(path)

    def function_in(self, path: Path, name: str) -> LocalFunction | None:
        """The function a bare `name` calls inside the local module at `path`: defined
        there, or imported from another local module (absolute or relative to `path`).
        The defining module is recorded as used."""
        if self.file is None:
            return None
        found = self._defined_in([path], name, MAX_REEXPORTS)
        if found is None or not isinstance(found[0], cst.FunctionDef):
            return None
        self.used[str(found[2])] = found[3]
        return LocalFunction(*found)  # type: ignore[arg-type]

    def _defined_in(
        self, paths: Iterable[Path], name: str, hops: int
    ) -> tuple[_Definition, ImportMap, Path, str] | None:
        """The definition of `name` in the first of `paths` that has one, following a
        package's re-export (`from .util import set_random_seed` in utils/__init__.py)
        up to `hops` times; a module passed through is recorded as used."""
        for path in paths:
            parsed = self._parse(path)
            if parsed is None:
                continue
            module, imports, digest = parsed
            definition = _top_level(module, name)
            if definition is not None:
                return definition, imports, path, digest
            if hops > 0:
                found = self._reexported(path, imports, name, hops - 1)
                if found is not None:
                    self.used[str(path)] = digest
                    return found
        return None

    def _reexported(
        self, path: Path, imports: ImportMap, name: str, hops: int
    ) -> tuple[_Definition, ImportMap, Path, str] | None:
        """Where the module at `path` imports `name` from, when that is a local module."""
        assert self.file is not None
        boundary = common_root([self.file])
        relative = imports.relative.get(name)
        if relative is not None:
            dots = len(relative) - len(relative.lstrip("."))
            module_name, _, original = relative[dots:].rpartition(".")
            found = _resolve_relative(path, dots, module_name or None, (), boundary)
        else:
            absolute = imports.aliases.get(name)
            if absolute is None or "." not in absolute or absolute.startswith("torch."):
                return None
            module_name, _, original = absolute.rpartition(".")
            found = _resolve_absolute(module_name, _roots([self.file], boundary), boundary)
        candidates = [other for other in reversed(found) if other != path]
        return self._defined_in(candidates, original, hops)

    @classmethod
    def _parse(cls, path: Path) -> tuple[cst.Module, ImportMap, str] | None:
        return cls._parsed.get(path, _parse_module)


# -- who imports a helper module -------------------------------------------------------------

# A file that runs several processes says so in one of these words. A textual test on
# purpose: it decides which few files are worth resolving the imports of.
_DISTRIBUTED_WORDS = re.compile(
    r"init_process_group|DistributedDataParallel|DistributedSampler|LOCAL_RANK"
)
MAX_SCANNED_FILES = 2000


def distributed_importers(path: Path) -> list[tuple[Path, str]]:
    """(path, sha256) of the modules of `path`'s project (its repository or package root,
    as `common_root` finds it) that import `path` and run distributed: a helper module's
    only evidence that its code runs on every rank. Asked only by a rule that has a
    candidate finding in a helper module; scans at most MAX_SCANNED_FILES files (each
    read once while unchanged); only those that name the module are parsed."""
    path = path.resolve()
    root = common_root([path])
    stem = path.parent.name if path.name == "__init__.py" else path.stem
    found = []
    for other, text, digest in _files_of(root):
        if other == path or stem not in text:
            continue
        imported = (found for found, _ in local_imports(other, text, [other], root))
        if path in imported:
            found.append((other, digest))
    return found


def importers(path: Path) -> list[tuple[Path, str]]:
    """(path, sha256) of every module of `path`'s project that imports `path`, whether it
    looks distributed or not: an entry script that only calls helpers (`init_distributed()`,
    `get_rank()`) names none of the words `distributed_importers` looks for. Asked only
    by a rule with a candidate finding that hangs on what a caller passes; scans at most
    MAX_SCANNED_FILES files (each read once while unchanged)."""
    path = path.resolve()
    root = _importers_root(path)
    stem = path.parent.name if path.name == "__init__.py" else path.stem
    found = []
    for index, other in enumerate(_python_files(root)):
        if index >= MAX_SCANNED_FILES:
            break
        other = other.resolve()
        read = _read_text(other)
        if other == path or read is None or not _names_in_an_import(stem, read[0]):
            continue
        text, digest = read
        if path in (found_path for found_path, _ in local_imports(other, text, [other], root)):
            found.append((other, digest))
    return found


def _names_in_an_import(stem: str, text: str) -> bool:
    """Whether an import statement of `text` names `stem`: a cheap test before parsing
    (a short module name such as `t` or `data` is in almost every file's text)."""
    if stem not in text:
        return False
    # `from pkg import (\n    data_loader,\n)`: the name may sit inside parentheses.
    pattern = rf"^[ \t]*(?:from|import)[ \t][^\n(]*(?:\([^)]*)?\b{re.escape(stem)}\b"
    return re.search(pattern, text, re.M) is not None


def _importers_root(path: Path) -> Path:
    """Where `path`'s importers may be: the repository or package root `common_root`
    finds, else the folder above `path`'s package (its folders with an `__init__.py`,
    or its own folder). A module is usually imported from there (`main.py` beside
    `data_loading/` imports `data_loading.data_loader`), and a checkout without a marker
    file would otherwise end the search inside the package."""
    root = common_root([path])
    if root != path.parent:
        return root
    top = path.parent
    while (top / "__init__.py").exists() and top.parent != top:
        top = top.parent
    if top != path.parent or _is_root_folder(top) or _unrelated_files(top.parent):
        return top
    return top.parent


def _is_root_folder(folder: Path) -> bool:
    """A repository or package root: nothing above it belongs to the project."""
    return any((folder / marker).exists() for marker in _ROOT_MARKERS)


def _unrelated_files(folder: Path) -> bool:
    """`/`, a top-level folder (`/tmp`, `/work`) or the home folder: what they hold besides
    the script's own folder is someone else's."""
    return folder.parent == folder or folder.parent.parent == folder.parent or folder == Path.home()


# (text, digest) of any Python file `importers` read; of those that look distributed
_texts = StampedCache()
_scanned = StampedCache()


def _read_text(path: Path) -> tuple[str, str] | None:
    return _texts.get(path, text_and_digest)


def text_and_digest(path: Path) -> tuple[str, str] | None:
    """A local module's text (undecodable bytes replaced) and the sha256 of its bytes, read
    bounded; None when it cannot be read."""
    try:
        data = read_bounded(path)
    except SourceError:
        return None
    return data.decode("utf-8", errors="replace"), hashlib.sha256(data).hexdigest()


# `DistributedDataParallel(` in code (not in a comment): the project wraps a model itself.
_WRAPS_IN_DDP = re.compile(r"^[^#\n]*\bDistributedDataParallel\b", re.M)


def ddp_wrapping_modules(path: Path) -> list[tuple[Path, str]]:
    """(path, sha256) of the modules of `path`'s project that name DistributedDataParallel
    in code: evidence that a model a helper module receives (a trainer's `self.model`)
    may be a DDP wrapper, when nothing in the helper module says so."""
    path = path.resolve()
    root = common_root([path])
    return [
        (other, digest)
        for other, text, digest in _files_of(root)
        if other != path and _WRAPS_IN_DDP.search(text)
    ]


def _files_of(root: Path) -> list[tuple[Path, str, str]]:
    """The Python files below `root` that look distributed, with their text and digest."""
    files = []
    for index, path in enumerate(_python_files(root)):
        if index >= MAX_SCANNED_FILES:
            break
        scanned = _scanned.get(path, _scan)
        if scanned is not None:
            text, digest = scanned
            files.append((path.resolve(), text, digest))
    return files


def _scan(path: Path) -> tuple[str, str] | None:
    read = text_and_digest(path)
    return read if read is not None and _DISTRIBUTED_WORDS.search(read[0]) else None


def _python_files(root: Path) -> Iterator[Path]:
    for directory, folders, names in os.walk(root):
        folders[:] = sorted(f for f in folders if not f.startswith(".") and f not in _NOT_SOURCE)
        for name in sorted(names):
            if name.endswith(".py"):
                yield Path(directory) / name


def _top_level(module: cst.Module, name: str) -> _Definition | None:
    """The last top-level `def name`, `class name` or `name = value` of `module`."""
    found: _Definition | None = None
    for statement in module.body:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            if statement.name.value == name:
                found = statement
        elif isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Assign) and any(
                    isinstance(t.target, cst.Name) and t.target.value == name for t in small.targets
                ):
                    found = small.value
    return found


def _parse_module(path: Path) -> tuple[cst.Module, ImportMap, str] | None:
    try:
        data = read_bounded(path)
        text = decode_source(data, str(path)).text
        if risky(text):
            return None  # a helper module is not worth a forked parser
        module = parse_module(text)
    except (SourceError, cst.ParserSyntaxError, RecursionError, MemoryError, ValueError):
        return None
    imports = ImportMap()
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    imports.add(small)
    return module, imports, hashlib.sha256(data).hexdigest()
