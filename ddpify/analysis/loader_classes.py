"""Loaders whose class the configuration chooses: `getattr(dataloaders, config["type"])(...)`.

Config-driven projects (the pytorch-template family) build their loaders with
`get_instance(module, name, config)`, which is `getattr(module, config[name]["type"])(...)`.
Which class that names is only known at run time, but when every callable the local
module `module` binds is a class deriving (through the project) from one DataLoader
subclass of the project, whatever the configuration names is a DataLoader of that base
class: its `__init__` is where the sampler is handed to DataLoader, for every candidate.

`chosen_loader_modules(project)` answers that per local module (reading modules without
torch too: a `dataloaders/__init__.py` only imports); then `chosen_loader_base(tree, call,
modules)` says whether a call makes such a loader, and `chosen_training_loaders` which
training loops iterate one. Anything else a module binds (a function, a variable, a class
from outside the project, a star import) could be what the configuration names: no answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.project import Project
from ddpify.analysis.roles import iterated_source, train_loaders, view_cached
from ddpify.analysis.tree import Tree
from ddpify.libcst_speed import parse_module

DATA_LOADER = "torch.utils.data.DataLoader"
# Bindings `getattr(module, name)` can never name as a class to call (documentation).
_IGNORED = frozenset({"__all__", "__version__", "__author__", "__doc__"})


@dataclass(frozen=True)
class LoaderBase:
    """The project's DataLoader subclass every class of a module derives from."""

    module: str  # dotted, as the entry script would import it: `base.base_dataloader`
    name: str  # `BaseDataLoader`
    members: tuple[str, ...]  # the classes the configuration may name: `COCO`, `VOC`


@dataclass
class _Module:
    tree: Tree
    package: bool


def module_names(project: Project) -> dict[str, Path]:
    """Each local module's dotted name as the entry script imports it (its folder first
    on sys.path), for those under the entry's folder."""
    top = project.entries[0].parent
    names: dict[str, Path] = {}
    for path in project.modules:
        try:
            parts = list(path.relative_to(top).with_suffix("").parts)
        except ValueError:
            continue
        if parts and parts[-1] == "__init__":
            parts.pop()
        if parts:
            names[".".join(parts)] = path
    return names


def chosen_loader_modules(project: Project) -> dict[str, LoaderBase]:
    """The local modules whose every callable is a DataLoader class of one project base,
    by dotted name: of those some call passes first (`getattr(dataloaders, ...)`,
    `get_instance(dataloaders, ...)`). Only the modules the answer needs are parsed."""
    texts = [module.text for module in project.modules.values()]
    if not any("getattr(" in text for text in texts):
        return {}
    modules = _LazyModules(project, module_names(project))
    resolver = _Resolver(modules)
    found = {}
    for name in modules.names:
        if not _passed_first(name, texts):
            continue
        base = resolver.loader_base_of_namespace(name)
        if base is not None:
            found[name] = base
    return found


def _passed_first(name: str, texts: list[str]) -> bool:
    """Whether some call takes `name` as its first argument (a cheap text search)."""
    pattern = re.compile(r"\(\s*" + re.escape(name) + r"\s*,")
    return any(pattern.search(text) for text in texts)


class _LazyModules:
    """The local modules by dotted name, each parsed on first use."""

    def __init__(self, project: Project, names: dict[str, Path]) -> None:
        self.project = project
        self.names = names
        self._parsed: dict[str, _Module] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def get(self, name: str) -> _Module | None:
        if name not in self.names:
            return None
        if name not in self._parsed:
            path = self.names[name]
            tree = Tree(parse_module(self.project.modules[path].text))
            self._parsed[name] = _Module(tree, path.stem == "__init__")
        return self._parsed[name]

    def __getitem__(self, name: str) -> _Module:
        module = self.get(name)
        if module is None:
            raise KeyError(name)
        return module


class _Resolver:
    """Names of local modules resolved like Python would: to a class of a local module,
    to a local module, or to nothing known (None)."""

    def __init__(self, modules: _LazyModules) -> None:
        self.modules = modules

    def loader_base_of_namespace(self, name: str) -> LoaderBase | None:
        members: list[str] = []
        roots = set()
        for symbol, statement in _top_level_bindings(self.modules[name].tree.module):
            if symbol in _IGNORED:
                continue
            target = self.resolve(name, symbol, statement)
            if target is None:
                return None  # a function, a variable, a class from outside: not provable
            if target[0] == "module":
                continue  # a module cannot be called: the configuration cannot name it
            root = self.loader_root(target[1], target[2], 0)
            if root is None:
                return None
            roots.add(root)
            members.append(symbol)
        if len(roots) != 1 or not members:
            return None
        module, cls = roots.pop()
        return LoaderBase(module, cls, tuple(members))

    def resolve(self, name: str, symbol: str, statement: cst.CSTNode | None = None, depth=0):
        """("class", module, ClassDef) or ("module", module) or None."""
        module = self.modules.get(name)
        if module is None or depth > 8:
            return None
        if statement is None:
            statement = dict(_top_level_bindings(module.tree.module)).get(symbol)
        if statement is None:
            if f"{name}.{symbol}" in self.modules:
                return ("module", f"{name}.{symbol}")
            return self._through_star_imports(name, module, symbol, depth)
        if isinstance(statement, cst.ClassDef):
            return ("class", name, statement)
        if isinstance(statement, cst.Import):
            return ("module", symbol)  # `import x` binds a module
        if isinstance(statement, cst.ImportFrom):
            source = self._imported_module(name, module.package, statement)
            original = _original_name(statement, symbol)
            if source is None or original is None:
                return None
            if f"{source}.{original}" in self.modules:
                return ("module", f"{source}.{original}")
            return self.resolve(source, original, None, depth + 1)
        return None

    def _through_star_imports(self, name: str, module: _Module, symbol: str, depth: int):
        """`from .base_dataloader import *`: the last local module that binds `symbol`."""
        found = None
        for statement in _star_imports(module.tree.module):
            source = self._imported_module(name, module.package, statement)
            if source in self.modules:
                found = self.resolve(source, symbol, None, depth + 1) or found
        return found

    def loader_root(self, name: str, cls: cst.ClassDef, depth: int) -> tuple[str, str] | None:
        """The project class deriving from DataLoader directly that `cls` derives from."""
        if depth > 8:
            return None
        tree = self.modules[name].tree
        for base in cls.bases:
            if tree.qualify(base.value) == DATA_LOADER:
                return (name, cls.name.value)
            target = self._resolve_dotted(name, dotted(base.value))
            if target is not None and target[0] == "class":
                root = self.loader_root(target[1], target[2], depth + 1)
                if root is not None:
                    return root
        return None

    def _resolve_dotted(self, name: str, path: str | None):
        if path is None:
            return None
        first, *rest = path.split(".")
        target = self.resolve(name, first)
        for part in rest:
            if target is None or target[0] != "module":
                return None
            target = self.resolve(target[1], part)
        return target

    def _imported_module(self, name: str, package: bool, node: cst.ImportFrom) -> str | None:
        level = len(node.relative)
        module = dotted(node.module) if node.module is not None else ""
        if level == 0:
            return module or None
        parts = name.split(".") if package else name.split(".")[:-1]
        if level > 1:
            parts = parts[: len(parts) - (level - 1)] if len(parts) >= level - 1 else []
        return ".".join([*parts, module] if module else parts) or None


def _original_name(node: cst.ImportFrom, bound: str) -> str | None:
    if isinstance(node.names, cst.ImportStar):
        return None
    for alias in node.names:
        shown = alias.asname.name if alias.asname is not None else alias.name
        if dotted(shown) == bound:  # type: ignore[arg-type]
            return dotted(alias.name)
    return None


def _star_imports(module: cst.Module) -> list[cst.ImportFrom]:
    return [
        small
        for statement in module.body
        if isinstance(statement, cst.SimpleStatementLine)
        for small in statement.body
        if isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar)
    ]


def _top_level_bindings(module: cst.Module) -> list[tuple[str, cst.CSTNode]]:
    """What a module binds at its top level, each name with the statement that binds it;
    a statement ddpify does not read binds `?` (so the namespace is not provable)."""
    found: list[tuple[str, cst.CSTNode]] = []
    for statement in module.body:
        if isinstance(statement, (cst.ClassDef, cst.FunctionDef)):
            found.append((statement.name.value, statement))
            continue
        if not isinstance(statement, cst.SimpleStatementLine):
            found.append(("?", statement))  # if/try/with at top level: not followed
            continue
        for small in statement.body:
            found.extend(_small_bindings(small))
    return found


def _small_bindings(small: cst.BaseSmallStatement) -> list[tuple[str, cst.CSTNode]]:
    if isinstance(small, cst.Import):
        return [
            (dotted(a.asname.name) if a.asname else dotted(a.name).split(".")[0], small)  # type: ignore[arg-type,union-attr]
            for a in small.names
        ]
    if isinstance(small, cst.ImportFrom):
        if isinstance(small.names, cst.ImportStar):
            return [("?", small)]
        return [(dotted(a.asname.name if a.asname else a.name), small) for a in small.names]  # type: ignore[misc]
    if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
        targets = small.targets if isinstance(small, cst.Assign) else [small]
        return [(dotted(t.target) or "?", small) for t in targets]
    if isinstance(small, cst.Expr) or isinstance(small, cst.Pass):
        return []
    return [("?", small)]


def chosen_loader_base(
    tree: Tree, call: cst.Call, modules: dict[str, LoaderBase]
) -> LoaderBase | None:
    """The project base class of the loader `call` makes, when it makes one whose class is
    chosen at run time among the classes of a module of `modules`: `getattr(dataloaders,
    config["type"])(...)`, or a project helper that returns that form for a module it is
    passed (`get_instance(dataloaders, "train_loader", config)`)."""
    if not modules:
        return None
    return modules.get(module_chosen_from(tree, call) or "")


def module_chosen_from(tree: Tree, call: cst.Call) -> str | None:
    """The module (qualified: `dataloaders`, `torch.optim`) whose class `call` makes when
    the class is chosen at run time: `getattr(module, name)(...)`, or a project helper
    returning that form for a module it is passed (`get_instance(torch.optim, ...)`)."""
    view = tree.view
    module = _getattr_module(call.func)
    if module is not None:
        return view.qualify(module)
    callee = dotted(call.func)
    helper = view.functions().get(callee.rsplit(".", 1)[-1]) if callee else None
    if helper is None:
        return None
    position = _module_parameter(view, helper)
    if position is None or position >= len(call.args) or call.args[position].keyword:
        return None
    return view.qualify(call.args[position].value)


def _getattr_module(func: cst.BaseExpression) -> cst.BaseExpression | None:
    """`module` in `getattr(module, name)`, the callee of `getattr(module, name)(...)`."""
    if isinstance(func, cst.Call) and dotted(func.func) == "getattr" and len(func.args) == 2:
        return func.args[0].value
    return None


def _module_parameter(view, helper: cst.FunctionDef) -> int | None:
    """The position of the parameter every `return getattr(param, ...)(...)` of `helper`
    takes its module from; None unless every return is that form."""
    params = [p.name.value for p in helper.params.params]
    returns = [r.value for r in view.within(helper, cst.Return)]
    positions = set()
    for value in returns:
        module = _getattr_module(value.func) if isinstance(value, cst.Call) else None
        name = dotted(module) if module is not None else None
        if name not in params:
            return None
        positions.add(params.index(name))
    return positions.pop() if len(positions) == 1 else None


@dataclass
class ChosenTrainingLoader:
    """A training loop over a loader whose class the configuration chooses."""

    loop: cst.For
    site: cst.Call  # the call that makes the training loader: get_instance(dataloaders, ...)
    base: LoaderBase


def chosen_training_loaders(
    tree: Tree, modules: dict[str, LoaderBase]
) -> list[ChosenTrainingLoader]:
    """The training loops of the project (in any module) that iterate a loader of a
    configuration-chosen class of `modules`, each with the call that made it (computed
    once per project view: every pass asks it for every module)."""
    if not modules:
        return []
    key = ("chosen_training_loaders", id(modules))
    return view_cached(tree.view, key, lambda: _chosen_training_loaders(tree, modules))


def _chosen_training_loaders(tree: Tree, modules: dict[str, LoaderBase]) -> list:
    found = []
    for owner in tree.trees:
        for loop in train_loaders(owner)[1]:
            if not isinstance(loop, cst.For):
                continue
            source = iterated_source(owner, loop)
            made_by = source.made_by if source is not None else None
            base = chosen_loader_base(tree, made_by, modules) if made_by is not None else None
            if base is not None:
                found.append(ChosenTrainingLoader(loop, made_by, base))  # type: ignore[arg-type]
    return found
