"""Pass 8, imports: add what the other passes used, drop what they made unused."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import DDP, DIST_SAMPLER, Plan
from ddpify.migrate.edits import Edits
from ddpify.migrate.entrypoint import after_imports

NAME = "imports"
DROPPABLE = ("torch.multiprocessing", "torch.cuda.amp")
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    imports = _top_imports(tree)
    if not imports:
        return edits
    torch_imports = [s for s in imports if _module(s).startswith("torch")]
    after = torch_imports[-1] if torch_imports else imports[-1]
    wanted = []
    # A module that imported only `from torch import nn` (or `from torch.backends import
    # cudnn`) and now reads `torch.cuda...` in the code the passes added.
    needs_torch = "torch" in plan.needs or _reads_undefined(tree, ("torch",))
    if needs_torch and tree.alias_for("torch") is None:
        wanted.append("import torch")
    if "dist" in plan.needs and tree.alias_for("torch.distributed") is None:
        wanted.append(f"import torch.distributed as {plan.dist}")
    if "ddp" in plan.needs and tree.alias_for(DDP) is None:
        wanted.append(f"from torch.nn.parallel import DistributedDataParallel as {plan.ddp}")
    if "sampler" in plan.needs and tree.alias_for(DIST_SAMPLER) is None:
        wanted.append("from torch.utils.data.distributed import DistributedSampler")
    for line in wanted:
        edits.after[after].append(snippets.statement(line))
        plan.change(NAME, line, line)
    if not plan.entry and _reads_undefined(tree, ENV_NAMES):
        # A module of the project that now uses the rank: it reads the environment as the
        # entry script does (torchrun sets it; a plain run is rank 0 of 1).
        constants = snippets.statements(snippets.ENV_CONSTANTS, snippets.ENV_COMMENT)
        constants[0] = constants[0].with_changes(
            leading_lines=[cst.EmptyLine(), *constants[0].leading_lines]
        )
        # After the whole import block: the module may import `os` below its torch imports.
        edits.after[after_imports(tree) or after].extend(constants)
        plan.needs.add("os")
        plan.change(
            NAME, "read RANK, LOCAL_RANK and WORLD_SIZE from the environment", "RANK = int("
        )
    if "os" in plan.needs and not _imports_os_at_top(tree):
        first_torch = torch_imports[0] if torch_imports else None
        stdlib = [s for s in imports if first_torch is None or tree.after(first_torch, s)]
        if stdlib:
            edits.after[stdlib[-1]].append(snippets.statement("import os"))
        else:
            first = imports[0]
            edits.before[first].append(snippets.statement("import os"))
        plan.change(NAME, "import os", "import os")
    _drop_unused(tree, plan, edits, imports)
    return edits


def _top_imports(tree: Tree) -> list[cst.SimpleStatementLine]:
    return [
        s
        for s in tree.module.body
        if isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], (cst.Import, cst.ImportFrom))
    ]


def _imports_os_at_top(tree: Tree) -> bool:
    """`import os` among the module's top-level statements: one inside a function (a
    helper's `import os`) does not bind it for the constants that read the environment."""
    if tree.imports.aliases.get("os") != "os":
        return False
    return any(
        isinstance(s.body[0], cst.Import)
        and any(dotted(a.name) == "os" and a.asname is None for a in s.body[0].names)
        for s in _top_imports(tree)
    ) or any(
        isinstance(s, (cst.If, cst.Try)) and "import os" in tree.code(s) for s in tree.module.body
    )


def _module(stmt: cst.SimpleStatementLine) -> str:
    node = stmt.body[0]
    if isinstance(node, cst.Import):
        return dotted(node.names[0].name) or ""
    return dotted(node.module) if node.module is not None else ""  # type: ignore[return-value]


def _used_names(tree: Tree) -> set[str]:
    skipped = _import_line_names(tree)
    used = set()
    for name in tree.find(cst.Name):
        parent = tree.parent.get(name)
        if isinstance(parent, cst.Attribute) and parent.attr is name:
            continue  # `torch.autocast` does not use a local name `autocast`
        if id(name) in skipped:
            continue
        used.add(name.value)
    return used


def _import_line_names(tree: Tree) -> set[int]:
    """The ids of the names on a statement line that begins with an import (`import a;
    b()` too): what a walk up from each name to its statement would tell, asked once per
    import rather than once per name of the module."""
    skipped: set[int] = set()
    for node in tree.find((cst.Import, cst.ImportFrom)):
        line = tree.parent.get(node)
        if (
            isinstance(line, cst.SimpleStatementLine)
            and isinstance(line.body[0], (cst.Import, cst.ImportFrom))
            and tree.statement(line) is line
        ):
            skipped.update(id(name) for name in tree.within(line, cst.Name))
    return skipped


def _drop_unused(tree, plan, edits, imports) -> None:
    used = _used_names(tree)
    for stmt in imports:
        module = _module(stmt)
        node = stmt.body[0]
        if isinstance(node.names, cst.ImportStar):
            continue
        bound = [_bound(alias) for alias in node.names]
        if module.startswith(DROPPABLE):
            keep = [alias for alias, name in zip(node.names, bound) if name in used]
        else:
            # Only what a pass stopped using: an import the user left unused stays.
            dropped = plan.replaced_names - used
            keep = [alias for alias, name in zip(node.names, bound) if name not in dropped]
        if len(keep) == len(bound):
            continue
        if not keep:
            edits.removed.add(stmt)
        else:
            keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            edits.replace(node, node.with_changes(names=keep))
        plan.change(NAME, f"dropped unused imports from {module}", None)


def _bound(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return dotted(alias.asname.name) or ""  # type: ignore[arg-type]
    return (dotted(alias.name) or "").split(".")[0]


def _reads_undefined(tree: Tree, names: tuple[str, ...]) -> bool:
    """Whether the module reads one of `names` that no top-level statement binds (the
    `torch` of `import torch.nn as nn` is no read)."""
    in_imports = {
        id(name)
        for statement in tree.find((cst.Import, cst.ImportFrom))
        for name in tree.within(statement, cst.Name)
    }
    read = {
        node.value
        for node in tree.find(cst.Name)
        if node.value in names and id(node) not in in_imports
    }
    if not read:
        return False
    bound = set()
    for statement in tree.module.body:
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Assign):
                    bound |= {dotted(t.target) for t in small.targets}
    return bool(read - bound)
