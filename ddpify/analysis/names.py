"""Qualified names from an import-alias map built during the one visit.

libcst's QualifiedNameProvider runs full scope analysis, about ten times the cost of
parsing; training scripts bind torch names through plain imports, so a map of
`local name -> dotted path` answers the same question for a fraction of the price.
"""

from __future__ import annotations

import libcst as cst

from ddpify.walk import children

# Public aliases that name the same object; keys are rewritten to values.
CANONICAL = {
    "torch.nn.parallel.distributed.DistributedDataParallel": (
        "torch.nn.parallel.DistributedDataParallel"
    ),
    "torch.nn.DataParallel": "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel": "torch.nn.parallel.DataParallel",
    "torch.utils.data.distributed.DistributedSampler": "torch.utils.data.DistributedSampler",
    "torch.utils.data.dataloader.DataLoader": "torch.utils.data.DataLoader",
    "torch.nn.modules.batchnorm.SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "torch.distributed.distributed_c10d.init_process_group": "torch.distributed.init_process_group",
    "torch.cuda.amp.autocast_mode.autocast": "torch.cuda.amp.autocast",
    "torch.cuda.amp.grad_scaler.GradScaler": "torch.cuda.amp.GradScaler",
    "torch.nn.utils.clip_grad.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    # The private module torch 2.0-2.1 exported the device mesh from.
    "torch.distributed._tensor.device_mesh.init_device_mesh": (
        "torch.distributed.device_mesh.init_device_mesh"
    ),
    "torch.distributed._tensor.init_device_mesh": "torch.distributed.device_mesh.init_device_mesh",
}


# Names a `from utils import *` re-exports that can mean one module only (the scripts
# call `sys.stdout.write(...)` with `sys` imported by the star-imported module alone).
_STAR_EXPORTED = {"torch": "torch", "nn": "torch.nn", "sys": "sys", "os": "os"}
_UNKNOWN = object()


def dotted(node: cst.BaseExpression) -> str | None:
    """`a.b.c` for a Name/Attribute chain, None for anything else."""
    # `type() is`, not isinstance: neither class has a subclass, and a miss through ABC's
    # isinstance costs more than the rest of this function (every rule asks, every node).
    parts = []
    while type(node) is cst.Attribute:
        parts.append(node.attr.value)  # type: ignore[attr-defined]
        node = node.value  # type: ignore[attr-defined]
    if type(node) is not cst.Name:
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))


def root_name(node: cst.BaseExpression) -> str | None:
    """The name a Name/Attribute chain starts from (`self` of `self.net.fc`), else None."""
    while type(node) is cst.Attribute:
        node = node.value  # type: ignore[attr-defined]
    return node.value if type(node) is cst.Name else None  # type: ignore[attr-defined]


def _module_path(node: cst.BaseExpression | None) -> str | None:
    return dotted(node) if node is not None else None


class ImportMap:
    """Local names bound by import statements, mapped to fully qualified names."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.modules: set[str] = set()
        self.star_imports = False  # `from models import *` may bind `torch` and `nn`
        # `from .utils import save` -> {"save": ".utils.save"}: a module of this package,
        # kept apart so `qualify` never mistakes it for a library name.
        self.relative: dict[str, str] = {}
        # node -> what `qualify` answered: every rule qualifies the callee of every call
        # it visits. Valid until the next import is added (imports only ever come through
        # `add`; nothing else writes the maps above).
        self._qualified: dict[cst.BaseExpression, str | None] = {}

    def add(self, node: cst.Import | cst.ImportFrom) -> None:
        self._qualified.clear()
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = _module_path(alias.name)
                if full is None:
                    continue
                self.modules.add(full)
                if alias.asname is not None:
                    local = dotted(alias.asname.name)  # type: ignore[arg-type]
                    if local:
                        self.aliases[local] = full
                else:
                    top = full.split(".")[0]
                    self.aliases[top] = top
            return
        if node.relative:
            self._add_relative(node)
            return
        if node.module is None:
            return
        module = _module_path(node.module)
        if module is None:
            return
        self.modules.add(module)
        if isinstance(node.names, cst.ImportStar):
            self.star_imports = True
            return
        for alias in node.names:
            name = alias.name.value if isinstance(alias.name, cst.Name) else None
            if name is None:
                continue
            local = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            self.aliases[local] = f"{module}.{name}"

    def _add_relative(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        dots = "." * len(node.relative)
        module = _module_path(node.module) if node.module is not None else ""
        prefix = f"{dots}{module}." if module else dots
        for alias in node.names:
            if not isinstance(alias.name, cst.Name):
                continue
            local = alias.name.value
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            self.relative[local] = f"{prefix}{alias.name.value}"

    def qualify_local(self, node: cst.BaseExpression) -> str | None:
        """What `qualify` answers, or for a name bound by a relative import the name as
        the import wrote it (`..utils.save`): for finding helpers in the project."""
        found = self.qualify(node)
        if found is not None:
            return found
        path = dotted(node)
        if path is None:
            return None
        head, _, rest = path.partition(".")
        base = self.relative.get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def qualify(self, node: cst.BaseExpression) -> str | None:
        """The canonical dotted name `node` refers to, or None if it is not imported."""
        qualified = self._qualified
        found = qualified.get(node, _UNKNOWN)
        if found is _UNKNOWN:
            found = qualified[node] = self._qualify(node)
        return found  # type: ignore[return-value]

    def _qualify(self, node: cst.BaseExpression) -> str | None:
        path = dotted(node)
        if path is None:
            return None
        head, _, rest = path.partition(".")
        base = self.aliases.get(head)
        if base is None and self.star_imports:
            # Research code re-exports torch through `from utils import *`; only the
            # conventional names of _STAR_EXPORTED are trusted there.
            base = _STAR_EXPORTED.get(head)
        if base is None and head == "torch" and self.imports_any("torch"):
            # A torch script that uses `torch.` without `import torch` (a NameError the
            # author has not hit yet, as pytorch/examples' minGPT main.py once did): the
            # name can only mean torch, and the call is still what the author meant.
            base = "torch"
        if base is None:
            return None
        full = f"{base}.{rest}" if rest else base
        return CANONICAL.get(full, full)

    def imports_any(self, *prefixes: str) -> bool:
        return any(
            module == prefix or module.startswith(prefix + ".")
            for module in self.modules
            for prefix in prefixes
        )


def and_terms(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """`a and b and c` -> [a, b, c]; any other test -> [test]."""
    if type(test) is cst.BooleanOperation and type(test.operator) is cst.And:
        return [*and_terms(test.left), *and_terms(test.right)]
    return [test]


def call_name(call: cst.Call, imports: ImportMap) -> str | None:
    return imports.qualify(call.func)


def method_name(call: cst.Call) -> str | None:
    """`set_epoch` for `x.y.set_epoch(...)`; None when the callee is not an attribute."""
    # An exact type test: isinstance against libcst's ABCs is slow (ddpify.walk.is_kind).
    return call.func.attr.value if type(call.func) is cst.Attribute else None


def find_arg(call: cst.Call, keyword: str, position: int | None = None) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg
    if position is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if position < len(positional):
            return positional[position]
    return None


def identifiers(node: cst.CSTNode) -> list[str]:
    """Every Name and attribute identifier in `node`, in source order."""
    found: list[str] = []
    stack = [node]
    while stack:  # cheaper than `walk` with callbacks (asked for every loop of a file)
        current = stack.pop()
        if type(current) is cst.Name:
            found.append(current.value)
        else:
            stack.extend(reversed(list(children(current))))
    return found


def class_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """The methods a class body defines, by name; of two `def`s of one name the later,
    as Python keeps it."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return {s.name.value: s for s in body if isinstance(s, cst.FunctionDef)}
