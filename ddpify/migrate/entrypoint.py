"""Pass 2, entrypoint: the torchrun environment, process-group set-up and tear-down.

Adds RANK / LOCAL_RANK / WORLD_SIZE from the environment and an `init_distributed()`
that sets the device before joining the group (a lone `python` process makes a
one-process group, so nothing else changes between the two ways of running). mp.spawn,
hard-coded MASTER_* variables, explicit rank/world size and `--local_rank` give way to
the environment; destroy_process_group runs in a `finally`.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.devices import cuda_placement
from ddpify.analysis.guards import classify
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.roles import trained_model_names
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import (
    DESTROY_PG,
    INIT_PG,
    SETUP_FUNCTION,
    SPAWN,
    Plan,
    Shape,
    local_rank_arguments,
    train_loaders,
)
from ddpify.migrate.edits import Edits

NAME = "entrypoint"
SET_DEVICE = "torch.cuda.set_device"
MASTER_ENV = ("MASTER_ADDR", "MASTER_PORT")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if plan.shape is Shape.TORCHRUN:
        _add_destroy(tree, plan, edits)
        return edits
    if not plan.shape.converts:
        return edits
    if not plan.entry:
        # A module the entry script imports: the process group is the entry's; a GPU this
        # module picks itself would override the local rank's.
        if plan.shape in (Shape.SINGLE, Shape.DATA_PARALLEL):
            _remove_set_device(tree, plan, edits)
        return edits
    plan.needs |= {"os", "dist"}
    anchor = after_imports(tree)
    cuda = runs_on_cuda(tree)
    setup = [
        *snippets.statements(snippets.ENV_CONSTANTS, snippets.ENV_COMMENT),
        *snippets.setup_function(plan.dist, cuda),
    ]
    setup[0] = setup[0].with_changes(leading_lines=[cst.EmptyLine(), *setup[0].leading_lines])
    _insert_after(tree, edits, anchor, setup)
    _two_blank_lines_after(tree, edits, anchor)
    plan.change(
        NAME,
        "read RANK, LOCAL_RANK and WORLD_SIZE from the torchrun environment",
        "RANK = int(",
        "DDP003" if plan.shape is Shape.LAUNCH else None,
    )
    plan.change(
        NAME,
        f"{SETUP_FUNCTION}(): set_device, then a process group with nccl for CUDA tensors and "
        "gloo for CPU ones (gloo alone without GPUs)"
        if cuda
        else f"{SETUP_FUNCTION}(): a gloo process group, as the script keeps its tensors on the "
        "CPU (nccl cannot carry CPU tensors)",
        f"def {SETUP_FUNCTION}():",
        "DDP005",
    )
    if plan.shape in (Shape.SINGLE, Shape.DATA_PARALLEL):
        _start_and_stop(tree, plan, edits, anchor, setup)
        _remove_set_device(tree, plan, edits)
    else:
        _replace_launcher(tree, plan, edits)
    return edits


def runs_on_cuda(tree: Tree) -> bool:
    """Whether the script, or any module of its project, puts anything on a GPU (else it
    trains on the CPU everywhere)."""
    trees = tree.trees
    return any(cuda_placement(t.nodes, t.qualify, t.parent) is not None for t in trees)


def after_imports(tree: Tree) -> cst.BaseStatement | None:
    """The last top-level import before the first function or class."""
    last = None
    for stmt in tree.module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        ):
            last = stmt
        elif isinstance(stmt, cst.Try) and last is not None:
            last = stmt  # `try: import x except ImportError: ...` in the import block
    return last


def _two_blank_lines_after(tree: Tree, edits: Edits, anchor) -> None:
    """The statement after the inserted function keeps PEP 8's two blank lines."""
    body = list(tree.module.body)
    index = body.index(anchor) + 1 if anchor is not None else 0
    if index >= len(body):
        return
    following = body[index]
    blank = 0
    for line in following.leading_lines:
        if line.comment is not None:
            break
        blank += 1
    if blank < 2:
        extra = [cst.EmptyLine()] * (2 - blank)
        edits.replace(
            following,
            lambda updated: updated.with_changes(leading_lines=[*extra, *updated.leading_lines]),
        )


def _insert_after(tree, edits, anchor, statements) -> None:
    if anchor is not None:
        edits.after[anchor].extend(statements)
    else:
        first = tree.module.body[0]
        edits.before[first].extend(statements)


def _call(plan: Plan, code: str) -> cst.BaseStatement:
    return snippets.statement(code.format(dist=plan.dist, setup=SETUP_FUNCTION))


def _start_and_stop(tree, plan, edits, anchor, setup) -> None:
    guard = tree.main_guard()
    destroy = _call(plan, "{dist}.destroy_process_group()")
    if guard is not None:
        body = list(guard.body.body)
        built = _built_at_import(tree, guard)
        if built is None:
            edits.prepend[guard].append(_call(plan, "{setup}()"))
            plan.change(
                NAME, "join the process group under the __main__ guard", f"{SETUP_FUNCTION}()"
            )
        else:
            # DDP(...) and DistributedSampler(...) need the group where the model or the
            # loader is built: at import, above the guard.
            _insert_after(tree, edits, anchor, [_call(plan, "\n\n{setup}()")])
            plan.change(
                NAME,
                f"join the process group at module level, before `{built}` builds what DDP "
                "and the sampler need (the __main__ guard only runs the training)",
                f"{SETUP_FUNCTION}()",
            )

        def wrap(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
            return [snippets.try_finally(members, destroy)]

        edits.group(body, wrap)
        plan.change(NAME, "destroy_process_group() in a finally", "finally:", "DDP002")
        return
    _insert_after(tree, edits, anchor, [_call(plan, "\n\n{setup}()")])
    last = tree.module.body[-1]
    edits.after[last].append(_call(plan, "\n{dist}.destroy_process_group()"))
    plan.change(NAME, "join the process group before the training code", f"{SETUP_FUNCTION}()")
    plan.change(
        NAME,
        "destroy_process_group() at the end of the script",
        f"{plan.dist}.destroy_process_group()",
        "DDP002",
    )


def _built_at_import(tree: Tree, guard: cst.If) -> str | None:
    """The first line of a module-level statement outside the __main__ guard that builds a
    trained model or the training loader (wrapped in DDP / given a DistributedSampler
    right there, so the process group must exist before it), else None."""
    models = trained_model_names(tree)
    loaders = [loader.call for loader in train_loaders(tree)[0] if tree.owns(loader.call)]
    for stmt in tree.module.body:
        if stmt is guard or isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        small = stmt.body[0]
        binds = isinstance(small, cst.Assign) and any(
            dotted(t.target) in models for t in small.targets
        )
        if binds or any(tree.inside(call, stmt) for call in loaders):
            return tree.code(stmt).strip().splitlines()[0]
    return None


def _remove_set_device(tree: Tree, plan: Plan, edits: Edits) -> None:
    """A single-GPU script's own choice of GPU: init_distributed() picks the local rank's."""
    for call in tree.calls_to(SET_DEVICE):
        _remove_statement(tree, edits, call)
        plan.change(
            NAME,
            "removed torch.cuda.set_device(...): init_distributed() sets the local rank's GPU",
            None,
            "DDP010",
        )


def _replace_launcher(tree: Tree, plan: Plan, edits: Edits) -> None:
    for call in tree.calls_to(INIT_PG):
        edits.replace(call, snippets.expression(f"{SETUP_FUNCTION}()"))
        plan.change(
            NAME,
            "init_process_group(...) with explicit settings -> init_distributed()",
            f"{SETUP_FUNCTION}()",
            "DDP004",
        )
    for call in tree.calls_to(SET_DEVICE):
        _remove_statement(tree, edits, call)
    for node in _master_env_writes(tree):
        _remove_statement(tree, edits, node)
        plan.change(
            NAME,
            "removed a hard-coded MASTER_ADDR/MASTER_PORT (torchrun sets them)",
            None,
            "DDP004",
        )
    if plan.shape is Shape.SPAWN:
        _replace_spawn(tree, plan, edits)
        _replace_local_rank_uses(tree, plan, edits)  # a spawn script may take it too
    else:
        _replace_local_rank(tree, plan, edits)


def _remove_statement(tree: Tree, edits: Edits, node: cst.CSTNode) -> None:
    statement = tree.statement(node)
    if statement is None:
        return
    block = tree.block(statement)
    owner = tree.parent.get(block)
    if (
        isinstance(owner, cst.If)
        and len(block.body) == 1
        and owner.orelse is None
        and tree.statement(owner) is owner
    ):
        statement = owner
    edits.removed.add(statement)


def _master_env_writes(tree: Tree) -> list[cst.CSTNode]:
    found = []
    for assign in tree.find(cst.Assign):
        for target in assign.targets:
            node = target.target
            if (
                isinstance(node, cst.Subscript)
                and dotted(node.value) in ("os.environ", "environ")
                and isinstance(node.slice[0].slice, cst.Index)
                and isinstance(node.slice[0].slice.value, cst.SimpleString)
                and node.slice[0].slice.value.evaluated_value in MASTER_ENV
            ):
                found.append(assign)
    for call in tree.find(cst.Call, lambda c: method_name(c) == "setdefault"):
        if dotted(call.func.value) in ("os.environ", "environ") and call.args:  # type: ignore[union-attr]
            key = call.args[0].value
            if isinstance(key, cst.SimpleString) and key.evaluated_value in MASTER_ENV:
                found.append(call)
    return found


def _replace_spawn(tree: Tree, plan: Plan, edits: Edits) -> None:
    call = tree.calls_to(*SPAWN)[0]
    extra = find_arg(call, "args", 1)
    values = []
    if extra is not None and isinstance(extra.value, cst.Tuple):
        values = [tree.code(e.value) for e in extra.value.elements]
    elif extra is not None:
        values = [f"*{tree.code(extra.value)}"]
    worker = tree.code(call.args[0].value)
    new_call = snippets.expression(f"{worker}({', '.join(['RANK', *values])})")
    edits.replace(call, new_call)
    plan.change(
        NAME,
        f"mp.spawn -> {worker}(RANK, ...): torchrun starts the processes",
        tree.module.code_for_node(new_call),
        "DDP004",
    )
    nprocs = find_arg(call, "nprocs", 2)
    if nprocs is not None and isinstance(nprocs.value, cst.Name):
        _rebind_world_size(tree, plan, edits, call, nprocs.value.value)
    _ensure_destroy(tree, plan, edits, tree.statement(call))


def _rebind_world_size(tree, plan, edits, call, name: str) -> None:
    """`world_size = torch.cuda.device_count()` before the spawn -> WORLD_SIZE."""
    statement = tree.statement(call)
    block = tree.block(statement)
    for stmt in block.body:
        if stmt is statement:
            break
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and dotted(small.targets[0].target) == name:
            edits.replace(small.value, snippets.expression("WORLD_SIZE"))
            plan.change(
                NAME, f"{name} comes from torchrun's WORLD_SIZE", f"{name} = WORLD_SIZE", "DDP004"
            )


def _replace_local_rank(tree: Tree, plan: Plan, edits: Edits) -> None:
    _replace_local_rank_uses(tree, plan, edits)
    plan.change(NAME, "args.local_rank -> LOCAL_RANK", "LOCAL_RANK", "DDP003")
    guard = tree.main_guard()
    if guard is not None:
        _ensure_destroy(tree, plan, edits, None, guard)
    elif not tree.calls_to(DESTROY_PG):
        last = tree.module.body[-1]
        edits.after[last].append(_call(plan, "\n{dist}.destroy_process_group()"))
        plan.change(
            NAME,
            "destroy_process_group() at the end of the script",
            f"{plan.dist}.destroy_process_group()",
            "DDP002",
        )


def _replace_local_rank_uses(tree: Tree, plan: Plan, edits: Edits) -> None:
    """Drop `--local_rank` from argparse; `args.local_rank` reads become LOCAL_RANK."""
    for call in local_rank_arguments(tree):
        _remove_statement(tree, edits, call)
        plan.change(
            NAME, "removed the --local_rank argument (torchrun sets LOCAL_RANK)", None, "DDP003"
        )
    for attr in tree.find(cst.Attribute, lambda a: a.attr.value == "local_rank"):
        statement = tree.statement(attr)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and any(t.target is attr for t in small.targets):
            edits.removed.add(statement)
            continue
        if _in_rank_guard_test(tree, attr):
            # `if args.local_rank == 0:` meant "the main process": I/O goes to global rank 0.
            edits.replace(attr, cst.Name("RANK"))
            plan.change(
                NAME, "rank-0 guard on the local rank -> global RANK", "RANK == 0", "DDP050"
            )
            continue
        edits.replace(attr, cst.Name("LOCAL_RANK"))


def _in_rank_guard_test(tree: Tree, node: cst.CSTNode) -> bool:
    current = tree.parent.get(node)
    while current is not None and not isinstance(current, cst.BaseStatement):
        parent = tree.parent.get(current)
        if isinstance(parent, cst.If) and parent.test is current:
            return classify(current) is not None
        current = parent
    return False


def _ensure_destroy(tree, plan, edits, statement, guard=None) -> None:
    if tree.calls_to(DESTROY_PG):
        return
    destroy = _call(plan, "{dist}.destroy_process_group()")
    if guard is not None:
        body = list(guard.body.body)
        edits.group(body, lambda members: [snippets.try_finally(members, destroy)])
    elif statement is not None:
        edits.group([statement], lambda members: [snippets.try_finally(members, destroy)])
    else:
        return
    plan.change(NAME, "destroy_process_group() in a finally", "finally:", "DDP002")


def _add_destroy(tree: Tree, plan: Plan, edits: Edits) -> None:
    """An already-torchrun script that never destroys its group: a finally in the guard."""
    if not tree.calls_to(INIT_PG) or tree.calls_to(DESTROY_PG):
        return
    guard = tree.main_guard()
    if guard is None:
        plan.needs_human(
            "the process group is never destroyed; call "
            "dist.destroy_process_group() when training ends",
            tree.code(tree.statement(tree.calls_to(INIT_PG)[0])),
        )
        return
    plan.needs.add("dist")
    _ensure_destroy(tree, plan, edits, None, guard)
