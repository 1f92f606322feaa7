"""DDP043: `torch.cuda.amp.autocast` / `GradScaler` and their `torch.cpu.amp` twins."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.names import dotted, identifiers
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix, Rule
from ddpify.rules.training_loop._common import parents_and_children

LEGACY_MODULES = {"torch.cuda.amp": "cuda", "torch.cpu.amp": "cpu"}
MODERN = ("autocast", "GradScaler")
# Qualified legacy callable -> (name in torch.amp, device string).
LEGACY_CALLS = {
    f"{module}.{name}": (name, device)
    for module, device in LEGACY_MODULES.items()
    for name in MODERN
}
LEGACY_CALLS["torch.cpu.amp.autocast_mode.autocast"] = ("autocast", "cpu")
LEGACY_CALLS["torch.cpu.amp.grad_scaler.GradScaler"] = ("GradScaler", "cpu")
# The legacy autocast takes these positionally; torch.amp.autocast puts dtype second.
AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")
_SHIM_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception"}


@dataclass
class ImportGroup:
    """One `from torch.cuda.amp import autocast, GradScaler` statement."""

    node: cst.ImportFrom
    device: str
    locals: dict[str, str]  # local name -> imported name
    calls: list[cst.Call] = field(default_factory=list)


def _legacy_module(node: cst.ImportFrom) -> str | None:
    if node.relative or node.module is None:
        return None
    module = dotted(node.module)
    if module is None:
        return None
    for legacy in LEGACY_MODULES:
        if module == legacy or module.startswith(legacy + "."):
            return module
    return None


def _alias_local(alias: cst.ImportAlias, from_import: bool) -> str | None:
    """The name an import alias binds: `b` for `import a as b`, `a` for `import a.x`."""
    if alias.asname is not None:
        return alias.asname.name.value if type(alias.asname.name) is cst.Name else None
    name = dotted(alias.name)
    if name is None:
        return None
    return name if from_import else name.split(".")[0]


def _bound_names(node: cst.Import | cst.ImportFrom) -> list[str]:
    if type(node.names) is cst.ImportStar:
        return []
    from_import = type(node) is cst.ImportFrom
    locals_ = (_alias_local(alias, from_import) for alias in node.names)
    return [local for local in locals_ if local is not None]


def _catches_import_failure(node: cst.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None or set(identifiers(handler.type)) & _SHIM_ERRORS:
            return True
    return False


def in_compat_shim(ancestors: list[cst.CSTNode]) -> bool:
    """Inside `try: ... except ImportError:` or `if hasattr(torch, "amp"):`-style code."""
    for node in ancestors:
        if type(node) is cst.Try and _catches_import_failure(node):  # exact: is_kind
            return True
        if type(node) is cst.If:
            words = [name.lower() for name in identifiers(node.test)]
            if any("version" in word or word == "hasattr" for word in words):
                return True
    return False


def _top_level_torch(module: cst.Module) -> str | None:
    """The module-level name bound to `torch` itself, if any."""
    for statement in module.body:
        if type(statement) is not cst.SimpleStatementLine:
            continue
        for small in statement.body:
            if type(small) is not cst.Import:
                continue
            for alias in small.names:
                name = dotted(alias.name)
                if alias.asname is None and name and name.split(".")[0] == "torch":
                    return "torch"
                if name == "torch" and type(alias.asname.name) is cst.Name:
                    return alias.asname.name.value
    return None


def _keyword(name: str, arg: cst.Arg) -> cst.Arg:
    equal = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))
    return arg.with_changes(keyword=cst.Name(name), equal=equal)


def _modern_args(call: cst.Call, name: str, device: str) -> list[cst.Arg] | None:
    """The arguments for `torch.amp.<name>`: the device first, the rest unchanged in meaning."""
    args = list(call.args)
    if name == "autocast":
        if any(arg.star == "*" for arg in args):
            return None
        positional = [i for i, arg in enumerate(args) if arg.keyword is None and not arg.star]
        if len(positional) > len(AUTOCAST_POSITIONAL):
            return None
        for keyword, index in zip(AUTOCAST_POSITIONAL, positional):
            args[index] = _keyword(keyword, args[index])
    device_arg = cst.Arg(cst.SimpleString(f'"{device}"'))
    if args:
        spacing = call.whitespace_before_args
        after = spacing.deep_clone() if type(spacing) is cst.ParenthesizedWhitespace else None
        comma = cst.Comma(whitespace_after=after or cst.SimpleWhitespace(" "))
        device_arg = device_arg.with_changes(comma=comma)
    return [device_arg, *args]


class AmpLegacyApi(Rule):
    """The device-specific AMP entry points are deprecated aliases of `torch.amp`."""

    CODE = "DDP043"
    NAME = "amp-legacy-api"
    SEVERITY = Severity.INFO
    MESSAGE = 'the `torch.cuda.amp` API is deprecated; use `torch.amp` with a device ("cuda")'
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.calls: list[tuple[cst.Call, str]] = []
        self.groups: list[ImportGroup] = []
        self.shim_names: set[str] = set()  # bound by version-compatibility imports

    def visit_Import(self, node: cst.Import) -> None:
        if in_compat_shim(self.context.ancestors):
            self.shim_names.update(_bound_names(node))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if in_compat_shim(self.context.ancestors):
            self.shim_names.update(_bound_names(node))
            return
        module = _legacy_module(node)
        if module is None or type(node.names) is cst.ImportStar:
            return
        device = LEGACY_MODULES.get(module, "")
        names = {}
        for alias in node.names:
            local = _alias_local(alias, from_import=True)
            if local is not None:
                names[local] = dotted(alias.name) or ""
        self.groups.append(ImportGroup(node, device, names))

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        last = func.attr.value if type(func) is cst.Attribute else None
        if last not in MODERN and type(func) is not cst.Name:
            return  # cheap filter: most calls are neither, and qualifying costs
        legacy = self.context.qualify(func)
        if legacy not in LEGACY_CALLS or in_compat_shim(self.context.ancestors):
            return
        head = dotted(node.func).split(".")[0]  # type: ignore[union-attr]
        first = node.args[0].value if node.args else None
        if type(first) is cst.SimpleString and first.evaluated_value in ("cuda", "cpu"):
            return  # already called the `torch.amp` way through a shimmed name
        self.calls.append((node, legacy))
        if type(node.func) is cst.Name:
            for group in self.groups:
                if head in group.locals:
                    group.calls.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        calls = [(c, legacy) for c, legacy in self.calls if self._head(c) not in self.shim_names]
        group_fixes = self._group_fixes()
        called = set()
        for call, legacy in calls:
            name, device = LEGACY_CALLS[legacy]
            written = dotted(call.func) or name
            called.add(written)
            if type(call.func) is cst.Name:
                fix = group_fixes.get(written)
            else:
                fix = self._call_fix(call, name, device)
            self.report(call, _call_message(written, legacy, name, device), fix=fix)
        self._report_uncalled_imports(called)

    @staticmethod
    def _head(call: cst.Call) -> str:
        return (dotted(call.func) or "").split(".")[0]

    def _report_uncalled_imports(self, called: set[str]) -> None:
        """`from torch.cuda.amp import autocast` whose name is only passed around."""
        for group in self.groups:
            for alias in group.node.names:  # type: ignore[union-attr]
                imported = dotted(alias.name)
                local = _alias_local(alias, from_import=True)
                if imported in MODERN and group.device and local not in called:
                    device = group.device
                    message = (
                        f"`torch.{device}.amp.{imported}` is deprecated; import `{imported}` "
                        f'from `torch.amp` and pass "{device}" as its first argument'
                    )
                    self.report(alias, message)

    # -- fixes -------------------------------------------------------------------------

    def _modern_func(self, func: cst.BaseExpression, name: str) -> cst.BaseExpression | None:
        """`torch.amp.<name>`, spelt through the script's own `torch` binding."""
        if (
            type(func) is cst.Attribute
            and type(func.value) is cst.Attribute
            and func.value.attr.value == "amp"
            and type(func.value.value) is cst.Attribute
            and self.context.qualify(func.value.value.value) == "torch"
        ):
            return func.with_changes(value=func.value.with_changes(value=func.value.value.value))
        torch_name = _top_level_torch(self.context.module)
        if torch_name is None:
            return None
        return cst.Attribute(cst.Attribute(cst.Name(torch_name), cst.Name("amp")), cst.Name(name))

    def _call_fix(self, call: cst.Call, name: str, device: str) -> NodeFix | None:
        func = self._modern_func(call.func, name)
        args = _modern_args(call, name, device)
        if func is None or args is None:
            return None
        new = call.with_changes(func=func, args=args)
        return NodeFix(f'Use `torch.amp.{name}("{device}", ...)`', ((call, new),))

    def _group_fixes(self) -> dict[str, NodeFix]:
        """Local name -> one fix that rewrites the import and every call of its names.

        The import and its call sites must change together: `torch.amp.autocast()`
        without a device fails, so a partial rewrite would break the script.
        """
        if not self.groups:
            return {}
        names = {local for group in self.groups for local in group.locals}
        references = _References(self.context.module, names)
        fixes = {}
        for group in self.groups:
            fix = self._group_fix(group, references)
            if fix is not None:
                fixes.update(dict.fromkeys(group.locals, fix))
        return fixes

    def _group_fix(self, group: ImportGroup, references: _References) -> NodeFix | None:
        module = group.node.module
        if not group.device or type(module) is not cst.Attribute:
            return None
        if not all(imported in MODERN for imported in group.locals.values()):
            return None
        for local in group.locals:
            if references.bindings[local] != 1 or local in references.other:
                return None
            if len(references.calls[local]) != sum(dotted(c.func) == local for c in group.calls):
                return None  # a call the legacy map did not resolve to this import
        replacements: list[tuple[cst.CSTNode, cst.CSTNode]] = [
            (module, module.with_changes(value=module.value.value))  # type: ignore[attr-defined]
        ]
        for call in group.calls:
            name = group.locals[dotted(call.func)]  # type: ignore[index]
            args = _modern_args(call, name, group.device)
            if args is None:
                return None
            replacements.append((call, call.with_changes(args=args)))
        message = f'Import from `torch.amp` and pass "{group.device}" to every call'
        return NodeFix(message, tuple(replacements), Applicability.SAFE)


def _call_message(written: str, legacy: str, name: str, device: str) -> str:
    plain = legacy.replace(".autocast_mode", "").replace(".grad_scaler", "")
    subject = f"`{written}`" if written == plain else f"`{written}` (`{plain}`)"
    return f'{subject} is deprecated; use `torch.amp.{name}("{device}", ...)` instead'


class _References:
    """How the module uses some names: as callees, import bindings, or otherwise."""

    def __init__(self, module: cst.Module, names: set[str]) -> None:
        self.names = names
        self.calls: dict[str, list[cst.Name]] = defaultdict(list)
        self.bindings: Counter[str] = Counter()
        self.other: set[str] = set()
        for parent, child in parents_and_children(module):
            if type(child) is cst.Name and child.value in names:
                self._classify(child, parent)
            elif type(child) in (cst.Import, cst.ImportFrom):
                self.bindings.update(local for local in _bound_names(child) if local in names)

    def _classify(self, name: cst.Name, parent: cst.CSTNode) -> None:
        if type(parent) in (cst.ImportAlias, cst.AsName):
            return
        if type(parent) is cst.Attribute and parent.attr is name:
            return
        if type(parent) is cst.Arg and parent.keyword is name:
            return
        if type(parent) is cst.Call and parent.func is name:
            self.calls[name.value].append(name)
            return
        self.other.add(name.value)
