"""What the callers of a helper module's function give it, read in the modules that
import it: a loader factory `get_data_loaders(flags, ...)` that seeds its sampler with
`flags.seed` is as right as the `flags.seed` its caller set.

Only plain cases are read: a module-level function, a parameter used as is (`seed`) or
through one attribute (`flags.seed`), a call written with the function's imported name.
For an attribute, what counts is the caller's last assignment to it before the call,
in the function that makes the call; with no such assignment nothing is known.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from ddpify.analysis.guards import classify, excludes_rank_zero, rank_zero_scope
from ddpify.analysis.model import ScriptModel
from ddpify.analysis.names import ImportMap, dotted, find_arg
from ddpify.analysis.training import parameter_index
from ddpify.analysis.values import per_process_source
from ddpify.analysis.wrappers import collect_with_calls
from ddpify.walk import children, walk


@dataclass(frozen=True)
class ParameterUse:
    """`flags.seed` in `def get_data_loaders(flags, ...)`: parameter `flags`, attribute
    `seed`; `seed` alone: attribute None."""

    function: cst.FunctionDef
    parameter: str
    attribute: str | None


@dataclass(frozen=True)
class PerProcessValue:
    """A call site that gives the parameter a value differing between processes."""

    path: Path  # the calling module
    call: cst.Call
    shown: str  # what the caller wrote: `flags.seed = worker_seed`, `seed=args.seed + rank`
    source: str  # why it differs: "the rank", "the clock", "the process id"


def parameter_use(
    module: cst.Module, node: cst.CSTNode, expr: cst.BaseExpression
) -> ParameterUse | None:
    """`expr` (inside `node`) read from a parameter of the module-level function holding
    `node`: `flags.seed`, `seed`. None for anything else, or when the function holds no
    such parameter."""
    name = dotted(expr)
    if name is None:
        return None
    parameter, _, attribute = name.partition(".")
    if "." in attribute:
        return None
    function = _top_level_function_holding(module, node)
    if function is None or not parameter_index(function, parameter)[1]:
        return None
    return ParameterUse(function, parameter, attribute or None)


def per_process_values(
    use: ParameterUse, helper: Path, importers: Sequence[tuple[Path, cst.Module, ImportMap]]
) -> Iterator[PerProcessValue]:
    """The calls of `use.function`, in the modules that import `helper`, that give its
    parameter (or the parameter's attribute) a value that differs between processes."""
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    name = use.function.name.value
    position = parameter_index(use.function, use.parameter)[0]
    for path, module, imports in importers:
        model: ScriptModel | None = None
        for call, scope in _calls(module, imports, f"{stem}.{name}"):
            arg = find_arg(call, use.parameter, position)
            if arg is None or arg.star:
                continue
            if model is None:
                model = _model_of(module)
            found = _passed(use, module, arg, call, scope, model)
            if found is not None:
                shown, source = found
                yield PerProcessValue(path, call, shown, source)


def calling_modules(name: str, helper: Path, importers: Sequence[Path]) -> list[Path]:
    """The modules among `importers` (paths) that call `name`, a module-level function or
    class of `helper`, by its imported name (`load_checkpoint(model, path)`,
    `checkpoint.load_checkpoint(...)`, or `ModelEma(model)` after `from timm.utils import *`).

    Read with Python's `ast`: an entry script libcst would rather not parse in this
    process (deep nesting) still says what it calls."""
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    return [path for path in importers if _calling_owners(path, stem, name) is not None]


def owners_calling(name: str, helper: Path, importer: Path) -> list[str]:
    """The module-level functions and classes of `importer` whose code calls `name` of
    `helper` (`Launcher`, whose `__init__` builds a `CheckPoint`)."""
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    return [owner for owner in _calling_owners(importer, stem, name) or () if owner]


def _calling_owners(path: Path, stem: str, name: str) -> list[str] | None:
    """The names of the module-level functions and classes of `path` that call `name` of
    module `stem` ("" for a call outside them); None when nothing in `path` calls it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    aliases, star_modules, defined = _ast_bindings(tree)
    star = (
        name not in aliases
        and name not in defined
        and any(module.rsplit(".", 1)[-1] == stem for module in star_modules)
    )
    owners = []
    for statement in tree.body:
        if _ast_calls_in(statement, aliases, f"{stem}.{name}", name if star else None):
            owner = isinstance(statement, _AST_OWNERS) and statement.name  # type: ignore[union-attr]
            owners.append(owner or "")
    return owners or None


_AST_OWNERS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _ast_calls_in(root: ast.AST, aliases: dict[str, str], suffix: str, bare: str | None) -> bool:
    for node in ast.walk(root):
        if not isinstance(node, ast.Call):
            continue
        written = _ast_dotted(node.func)
        if written is None:
            continue
        head, _, rest = written.partition(".")
        if head in aliases:
            qualified = f"{aliases[head]}.{rest}" if rest else aliases[head]
            if qualified == suffix or qualified.endswith(f".{suffix}"):
                return True
        elif written == bare:
            return True
    return False


def _ast_bindings(tree: ast.Module) -> tuple[dict[str, str], list[str], set[str]]:
    """Names bound by imports (`local -> module.name` as written, relative dots kept),
    the modules imported with `*`, and the names the module defines at top level."""
    aliases: dict[str, str] = {}
    star_modules: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                if alias.name == "*":
                    star_modules.append(module)
                else:
                    aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return aliases, star_modules, defined


def _ast_dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


@dataclass(frozen=True)
class MethodCall:
    """`model.save_training_state(logger)` in an importer, `model = Model(...)` there."""

    path: Path  # the calling module
    call: cst.Call


def unguarded_method_calls(
    cls: str,
    method: str,
    helper: Path,
    importers: Sequence[tuple[Path, cst.Module, ImportMap]],
) -> list[MethodCall]:
    """The calls of `method` on an instance of `cls` (a module-level class of `helper`) in
    `importers`, made inside a function and under no rank guard of that function: the
    instance is a name the importer assigns a construction of `cls` to (`model =
    Model(hp, net)`). What calls that function is not followed."""
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    found = []
    for path, module, imports in importers:
        constructions = {id(call) for call, _ in _calls(module, imports, f"{stem}.{cls}")}
        if not constructions:
            continue
        instances = _names_assigned(module, constructions)
        found.extend(MethodCall(path, call) for call in _unguarded_calls(module, method, instances))
    return found


def _names_assigned(module: cst.Module, calls: set[int]) -> set[str]:
    names: set[str] = set()

    def enter(node: cst.CSTNode) -> None:
        if type(node) is cst.Assign and id(node.value) in calls:
            names.update(filter(None, (dotted(t.target) for t in node.targets)))

    walk(module, enter, lambda node: None)
    return names


def _unguarded_calls(module: cst.Module, method: str, receivers: set[str]) -> list[cst.Call]:
    ancestors: list[cst.CSTNode] = []
    found: list[cst.Call] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if (
            type(node) is cst.Call
            and type(node.func) is cst.Attribute
            and node.func.attr.value == method
            and dotted(node.func.value) in receivers
            and any(type(a) is cst.FunctionDef for a in ancestors)
            and not _rank_guarded(ancestors)
        ):
            found.append(node)

    walk(module, enter, lambda node: ancestors.pop())
    return found


def classify_rank(test: cst.BaseExpression) -> bool:
    return classify(test) is not None or excludes_rank_zero(test)


def _rank_guarded(ancestors: Sequence[cst.CSTNode]) -> bool:
    """Under a rank-0 guard, or a branch of a test that names a rank either way."""
    if rank_zero_scope(ancestors) is not None:
        return True
    return any(
        type(parent) is cst.If and child is not parent.test and classify_rank(parent.test)
        for parent, child in zip(ancestors, ancestors[1:])
    )


def constructor_arguments(
    cls: cst.ClassDef,
    parameter: str,
    helper: Path,
    importers: Sequence[tuple[Path, cst.Module, ImportMap]],
) -> list[tuple[ScriptModel, cst.BaseExpression]] | None:
    """What every construction of `cls` (`Trainer(model, ...)`), in the modules that
    import `helper`, passes for its `__init__`'s `parameter`, each with the calling
    module's model to judge it by. None when some construction passes nothing readable
    (a `*args`, a default), or `cls` has no `__init__` of its own with that parameter."""
    init = next(
        (
            statement
            for statement in cls.body.body  # type: ignore[union-attr]
            if isinstance(statement, cst.FunctionDef) and statement.name.value == "__init__"
        ),
        None,
    )
    if init is None or not parameter_index(init, parameter)[1]:
        return None
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    position = parameter_index(init, parameter)[0]
    found = []
    for _, module, imports in importers:
        calls = [call for call, _ in _calls(module, imports, f"{stem}.{cls.name.value}")]
        if not calls:
            continue
        model = _model_of(module)
        for call in calls:
            arg = find_arg(call, parameter, position)
            if arg is None or arg.star:
                return None
            found.append((model, arg.value))
    return found


@dataclass(frozen=True)
class WrapperArgument:
    """A call site that hands a function's parameter the DDP wrapper."""

    path: Path  # the calling module
    call: cst.Call
    wrap: cst.BaseExpression  # the value the argument's name was last assigned: `DDP(m)`


def wrapper_arguments(
    function: cst.FunctionDef,
    parameter: str,
    helper: Path,
    importers: Sequence[tuple[Path, cst.Module, ImportMap]],
) -> Iterator[WrapperArgument]:
    """The calls of `function` (module-level in `helper`), in the modules that import
    `helper`, whose argument for `parameter` is a name holding a DDP wrapper there: its
    latest assignment before the call, in source order, wraps a model (`model =
    DDP(model, ...)` in `main()`, then `evaluate(model, ...)`), as the rank-0 rules read
    a name, or is an alias or `torch.compile` of one."""
    stem = helper.parent.name if helper.name == "__init__.py" else helper.stem
    suffix = f"{stem}.{function.name.value}"
    position = parameter_index(function, parameter)[0]
    for path, module, imports in importers:

        def named(call: cst.Call, imports: ImportMap = imports) -> bool:
            qualified = imports.qualify_local(call.func) or ""
            return qualified == suffix or qualified.endswith(f".{suffix}")

        if not any(named(call) for call, _ in _calls(module, imports, suffix)):
            continue
        facts, calls = collect_with_calls(module, named)
        for call, place in calls:
            arg = find_arg(call, parameter, position)
            if arg is None or arg.star:
                continue
            binding = facts.forwarding_wrapper_binding(arg.value, place)
            if binding is not None:
                yield WrapperArgument(path, call, binding.value)


def _passed(
    use: ParameterUse,
    module: cst.Module,
    arg: cst.Arg,
    call: cst.Call,
    scope: cst.CSTNode,
    model: ScriptModel,
) -> tuple[str, str] | None:
    """(what the caller wrote, why it differs per process) for one call site."""
    if use.attribute is None:
        source = per_process_source(arg.value, model.imports, model.bindings)
        shown = module.code_for_node(arg).strip().rstrip(",")
        return (shown, source) if source is not None else None
    target = dotted(arg.value)
    if target is None:
        return None
    assignment = _last_assignment_before(scope, f"{target}.{use.attribute}", call)
    if assignment is None:
        return None
    source = per_process_source(assignment.value, model.imports, model.bindings)
    if source is None:
        return None
    return module.code_for_node(assignment).strip(), source


def _calls(
    module: cst.Module, imports: ImportMap, suffix: str
) -> Iterator[tuple[cst.Call, cst.CSTNode]]:
    """Calls whose imported name ends with `<helper module>.<function>`, each with the
    function (or the module) that makes it."""
    scopes: list[cst.CSTNode] = [module]
    found: list[tuple[cst.Call, cst.CSTNode]] = []

    def enter(node: cst.CSTNode) -> None:
        if isinstance(node, cst.FunctionDef):
            scopes.append(node)
        elif isinstance(node, cst.Call):
            qualified = imports.qualify_local(node.func) or ""
            if qualified == suffix or qualified.endswith(f".{suffix}"):
                found.append((node, scopes[-1]))

    def leave(node: cst.CSTNode) -> None:
        if isinstance(node, cst.FunctionDef):
            scopes.pop()

    walk(module, enter, leave)
    yield from found


def _last_assignment_before(
    scope: cst.CSTNode, target: str, call: cst.Call
) -> cst.Assign | cst.AugAssign | None:
    """The last `target = ...` / `target += ...` of `scope`'s own code that comes before
    `call` in the source, leaving out one that holds the call (`flags.seed = f(flags)`
    assigns after the call ran)."""
    assignments: list[cst.Assign | cst.AugAssign] = []
    for node in _own_preorder(scope):
        if node is call:
            before = [a for a in assignments if not _holds(a, call)]
            return before[-1] if before else None
        if isinstance(node, cst.Assign) and any(dotted(t.target) == target for t in node.targets):
            assignments.append(node)
        elif isinstance(node, cst.AugAssign) and dotted(node.target) == target:
            assignments.append(node)
    return None


def _own_preorder(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """`root`'s nodes in source order, without nested functions and classes."""
    stack = list(reversed(list(children(root))))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            stack.extend(reversed(list(children(node))))


def _top_level_function_holding(module: cst.Module, node: cst.CSTNode) -> cst.FunctionDef | None:
    for statement in module.body:
        if isinstance(statement, cst.FunctionDef) and _holds(statement, node):
            return statement
    return None


def _holds(root: cst.CSTNode, node: cst.CSTNode) -> bool:
    stack = [root]
    while stack:
        current = stack.pop()
        if current is node:
            return True
        stack.extend(children(current))
    return False


def _model_of(module: cst.Module) -> ScriptModel:
    """The bindings and imports of a calling module (read by `per_process_source`), in a
    model of its own: the parsed module's import map is shared and stays as it is."""
    model = ScriptModel(ImportMap())
    walk(module, model.visit, lambda node: None)
    return model
