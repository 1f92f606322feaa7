"""Pass 7, rank-zero: saves, prints, loggers, writers and progress bars on global rank 0.

Consecutive side effects share one `if RANK == 0:`; an `if` that holds nothing else
gets `and RANK == 0` added to its test. Writers are created on rank 0 only, progress
bars are disabled elsewhere, and a barrier keeps other ranks from reading a checkpoint
before rank 0 has written it.
"""

from __future__ import annotations

import bisect

import libcst as cst

from ddpify.analysis.batches import model_calls
from ddpify.analysis.guards import Scope, rank_scope, rank_zero_scope
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.reachability import never_run
from ddpify.analysis.roles import calls_forward, calls_training, replicated_steps
from ddpify.analysis.side_effects import FILE_WRITERS, STDOUT_WRITES
from ddpify.analysis.tree import Tree, names_in
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan, backward_calls, model_names, training_loops
from ddpify.migrate.args import append_arg, keyword
from ddpify.migrate.edits import Edits

NAME = "rank-zero"
LOG_METHODS = {"info", "debug", "warning", "warn", "log"}
LOGGER_NAMES = {"logger", "log", "logging", "LOGGER", "LOG", "_logger"}
WRITER_CLASSES = ("SummaryWriter",)
WANDB = {"init", "log", "finish", "save", "watch", "log_artifact"}
BUFFER_WORDS = ("BatchNorm", "register_buffer", "running_mean")
RANK_CONSTANT = 'RANK = int(os.environ.get("RANK", "0"))\n'


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    rank = _rank_name(tree, plan, edits)
    test = f"{rank} == 0"
    writers = _writers(tree, plan, edits, rank)
    effects = [s for s in _side_effects(tree, writers) if _needs_guard(tree, plan, s, rank)]
    local = _shard_values(tree)
    for run_ in _runs(tree, effects):
        _guard(tree, plan, edits, run_, test, local)
    _progress_bars(tree, plan, edits, rank)
    _barriers(tree, plan, edits)
    return edits


def _rank_name(tree: Tree, plan: Plan, edits: Edits) -> str:
    """RANK for converted scripts; an already-distributed script's own module-level rank."""
    for stmt in tree.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            assign = stmt.body[0]
            target = assign.targets[0].target
            if isinstance(target, cst.Name) and rank_scope(target) is Scope.GLOBAL:
                if rank_scope(assign.value) is Scope.GLOBAL or target.value == "RANK":
                    return target.value
    if not plan.shape.converts and plan.entry:
        _add_rank_constant(tree, plan, edits)
    return "RANK"  # a project's other modules get it from the imports pass when they use it


def _add_rank_constant(tree: Tree, plan: Plan, edits: Edits) -> None:
    last = None
    for stmt in tree.module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
            stmt.body[0], (cst.Import, cst.ImportFrom)
        ):
            last = stmt
    plan.needs.add("os")
    line = snippets.statements(RANK_CONSTANT, snippets.ENV_COMMENT)[0]
    if last is None:
        edits.before[tree.module.body[0]].append(line)
    else:
        edits.after[last].append(line)
    plan.change(NAME, "the global rank from torchrun's environment", "RANK = int(")


# -- what to guard ----------------------------------------------------------------------


def _writers(tree: Tree, plan: Plan, edits: Edits, rank: str) -> set[str]:
    """`writer = SummaryWriter(...)` -> created on rank 0 only (None elsewhere)."""
    names = set()
    for call, path, qualified in tree.call_names():
        name = qualified or path or ""
        if name.rsplit(".", 1)[-1] not in WRITER_CLASSES:
            continue
        statement = tree.statement(call)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not isinstance(small, cst.Assign) or small.value is not call:
            continue
        target = dotted(small.targets[0].target)
        if target:
            names.add(target)
        if rank_zero_scope(tree.ancestors(call)) is not None:
            continue
        if never_run(tree.view, call):
            continue
        read = _value_read(tree, target) if target else None
        if read is not None:
            plan.needs_human(
                f"{target} is created on every rank: `{tree.code(read)}` reads it where every "
                "rank runs, so it cannot be None on the others; its writes run on rank 0 only, "
                "the other ranks leave empty event files",
                tree.code(statement),
            )
            continue
        new = f"{tree.code(call)} if {rank} == 0 else None"
        edits.replace(call, snippets.expression(new))
        plan.change(
            NAME, f"{target} is created on rank 0 only", f"if {rank} == 0 else None", "DDP052"
        )
    return names | _writer_aliases(tree)


def _value_read(tree: Tree, writer: str) -> cst.Attribute | None:
    """A use of `writer` that reads a value from it (`writer.log_dir`, `d =
    writer.get_logdir()`) outside a rank-0 guard: with None on the other ranks it would
    fail there. A bare method call (`writer.add_scalar(...)`) is a write, guarded itself."""
    for node in tree.find(cst.Attribute, lambda a: dotted(a.value) == writer):
        parent = tree.parent.get(node)
        statement = tree.statement(node)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        bare = isinstance(small, cst.Expr) and small.value is parent
        if isinstance(parent, cst.Call) and parent.func is node and bare:
            continue
        if rank_zero_scope(tree.ancestors(node)) is None:
            return node
    return None


def _writer_aliases(tree: Tree) -> set[str]:
    """A writer kept in an attribute travels (`config.tb_logger = SummaryWriter(...)`,
    read in another module as `tb_logger = self.config.tb_logger`): the names in this
    module bound to, or spelled as, an attribute of that name anywhere in the project."""
    attributes = set()
    for call, path, qualified in tree.view.call_names():
        name = qualified or path or ""
        if name.rsplit(".", 1)[-1] not in WRITER_CLASSES:
            continue
        statement = tree.view.statement(call)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and isinstance(small.targets[0].target, cst.Attribute):
            attributes.add(small.targets[0].target.attr.value)
    found = set()
    for node in tree.find(cst.Attribute, lambda a: a.attr.value in attributes):
        spelled = dotted(node)
        if spelled:
            found.add(spelled)
        statement = tree.statement(node)
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and small.value is node:
            found |= {dotted(t.target) for t in small.targets} - {None}  # type: ignore[arg-type]
    return found


def _side_effects(tree: Tree, writers: set[str]) -> list[cst.BaseStatement]:
    found = []
    for stmt in tree.find(cst.SimpleStatementLine):
        small = stmt.body[0] if len(stmt.body) == 1 else None
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            if _kind(tree, small.value, writers):
                found.append(stmt)
    for stmt in tree.find(cst.With):
        if any(_writes_file(tree, item.item) for item in stmt.items):
            found.append(stmt)
    return sorted(found, key=lambda s: tree.order[s])


def _kind(tree: Tree, call: cst.Call, writers: set[str]) -> str | None:
    name = dotted(call.func) or ""
    qualified = tree.qualify(call.func) or ""
    if name == "print" or qualified in STDOUT_WRITES:
        return "print"
    if qualified in FILE_WRITERS:
        return "save"
    receiver, _, method = name.rpartition(".")
    if receiver in writers:
        return "writer"
    if qualified.startswith("wandb.") and method in WANDB:
        return "wandb"
    if method in LOG_METHODS and receiver in LOGGER_NAMES | _loggers(tree):
        return "log"
    return None


def _loggers(tree: Tree) -> set[str]:
    if not hasattr(tree, "_loggers"):
        names = set()
        for call in tree.calls_to("logging.getLogger"):
            small = tree.statement(call)
            if isinstance(small, cst.SimpleStatementLine) and isinstance(small.body[0], cst.Assign):
                target = dotted(small.body[0].targets[0].target)
                if target:
                    names.add(target)
        tree._loggers = names  # type: ignore[attr-defined]
    return tree._loggers  # type: ignore[attr-defined]


def _writes_file(tree: Tree, expr: cst.BaseExpression) -> bool:
    if not isinstance(expr, cst.Call) or dotted(expr.func) != "open":
        return False
    mode = find_arg(expr, "mode", 1)
    value = mode.value if mode else None
    return isinstance(value, cst.SimpleString) and any(c in value.evaluated_value for c in "wax")


def _needs_guard(tree: Tree, plan: Plan, stmt: cst.BaseStatement, rank: str) -> bool:
    if never_run(tree.view, stmt):
        return False  # an imported module's demo: the project's run never runs it
    scope = rank_zero_scope(tree.ancestors(stmt))
    if scope is Scope.GLOBAL:
        return False
    if scope is Scope.LOCAL:
        plan.needs_human(
            "guarded by a node-local rank: one copy per node runs this; use the "
            "global rank (DDP050)",
            tree.code(stmt),
        )
        return False
    if tree.function(stmt) is None and not _after_rank(tree, stmt, rank):
        return False
    trains = calls_training(tree, stmt)
    if trains is not None:
        # Guarded, rank 0 alone would train: the others wait in its all-reduce.
        plan.needs_human(
            f"this calls `{tree.code(trains.func)}`, which runs a training step, so it is left "
            "on every rank: compute the value on every rank and log it under "
            f"`if {rank} == 0:`",
            tree.code(stmt),
        )
        return False
    forward = model_calls(stmt, model_names(tree)) or calls_forward(tree, stmt)
    if _has_buffers(tree) and forward:
        # DDP's forward broadcasts the buffers to every rank: on rank 0 alone it would hang.
        plan.needs_human(
            "this runs the model's forward, which every rank must run under DDP (it syncs "
            "buffers), so it is left on every rank: compute the value on every rank and "
            "log it under `if RANK == 0:` (DDP053)",
            tree.code(stmt),
        )
        return False
    return True


def _has_buffers(tree: Tree) -> bool:
    """Whether the script's models hold buffers (BatchNorm statistics, registered
    buffers), which DDP's forward broadcasts from rank 0 to the others."""
    cache = tree.__dict__.setdefault("_rank_zero_buffers", [])
    if not cache:
        trees = tree.trees
        names = frozenset().union(*(t.names() for t in trees))
        cache.append(any(word in name for name in names for word in BUFFER_WORDS))
    return cache[0]


def _after_rank(tree: Tree, stmt: cst.BaseStatement, rank: str) -> bool:
    for top in tree.module.body:
        if isinstance(top, cst.SimpleStatementLine) and isinstance(top.body[0], cst.Assign):
            if dotted(top.body[0].targets[0].target) == rank:
                return tree.after(stmt, top)
    return True  # defined by this pass after the imports


def _runs(tree: Tree, effects: list[cst.BaseStatement]) -> list[list[cst.BaseStatement]]:
    """Consecutive side effects in the same block."""
    runs: list[list[cst.BaseStatement]] = []
    taken: set[cst.CSTNode] = set()  # every statement of every run so far
    for stmt in effects:
        if any(node in taken for node in tree.ancestors(stmt)):
            continue
        taken.add(stmt)
        if runs and tree.block(runs[-1][-1]) is tree.block(stmt):
            if _next_to(tree.block(stmt).body, runs[-1][-1], stmt):
                runs[-1].append(stmt)
                continue
        runs.append([stmt])
    return runs


def _next_to(body, previous: cst.BaseStatement, stmt: cst.BaseStatement) -> bool:
    """Whether `stmt` follows `previous` directly in `body` (by identity, like index)."""
    for index, item in enumerate(body):
        if item is previous:
            return index + 1 < len(body) and body[index + 1] is stmt
    return False


# -- guarding ---------------------------------------------------------------------------


def _shard_values(tree: Tree) -> set[str]:
    """Names computed in a training loop: under DDP they describe this rank's shard only.
    A replicated step (migrate/replicate.py) computes the whole batch on every rank, so
    what it computes is the original's value: its loop, and a loop around it (the epoch
    loop that logs its loss), hold no shard values."""
    whole = [step.loop for step in replicated_steps(tree)]
    sharded = [
        loop
        for loop in training_loops(tree)
        if not any(loop is w or tree.inside(w, loop) for w in whole)
    ]
    names = {"loss"} if sharded else set()
    for loop in sharded:
        for node in tree.within(loop, (cst.Assign, cst.AugAssign)):
            targets = node.targets if isinstance(node, cst.Assign) else [node]
            names |= {dotted(t.target) for t in targets} - {None}  # type: ignore[operator]
    return names


def _guard(tree, plan, edits, run: list[cst.BaseStatement], test: str, local: set[str]) -> None:
    for stmt in run:
        _record(tree, plan, stmt, local)
    block = tree.block(run[0])
    owner = tree.parent.get(block)
    if (
        isinstance(owner, cst.If)
        and owner.orelse is None
        and len(block.body) == len(run)
        and not isinstance(owner.test, (cst.BooleanOperation, cst.IfExp, cst.NamedExpr))
    ):
        new_test = snippets.expression(f"{tree.code(owner.test)} and {test}")
        edits.replace(owner.test, new_test)
        return
    template = snippets.statement(f"if {test}:\n    pass\n")
    edits.group(run, snippets.nested_under(template))


def _record(tree: Tree, plan: Plan, stmt: cst.BaseStatement, local: set[str]) -> None:
    code = tree.code(stmt).strip()
    first = code.splitlines()[-1] if isinstance(stmt, cst.SimpleStatementLine) else code
    writes = any(tree.qualify(call.func) in FILE_WRITERS for call in tree.within(stmt, cst.Call))
    if writes or "open(" in code:
        plan.change(NAME, "writes on global rank 0 only", first, "DDP050")
    else:
        plan.change(NAME, "logs on global rank 0 only", first, "DDP052")
    if isinstance(stmt, cst.SimpleStatementLine) and "save" not in code:
        if names_in(stmt) & local:
            plan.needs_human(
                "this logs rank 0's shard only; all-reduce the value if it should "
                "cover all ranks (DDP054)",
                first,
            )


def _progress_bars(tree: Tree, plan: Plan, edits: Edits, rank: str) -> None:
    for call in tree.find(cst.Call):
        name = dotted(call.func) or ""
        if name.rsplit(".", 1)[-1] not in ("tqdm", "trange") or find_arg(call, "disable"):
            continue
        if rank_zero_scope(tree.ancestors(call)) is not None:
            continue
        if never_run(tree.view, call):
            continue
        flag = keyword("disable", snippets.expression(f"{rank} != 0"))
        edits.replace(call, lambda updated, flag=flag: append_arg(updated, flag))
        plan.change(NAME, "progress bar on rank 0 only", f"disable={rank} != 0", "DDP052")


def _barriers(tree: Tree, plan: Plan, edits: Edits) -> None:
    """Rank 0 writes a checkpoint that every rank then loads: wait for the write."""
    saves = tree.calls_to("torch.save")
    saved_elsewhere = bool(tree.view.calls_to("torch.save"))
    if not saves and not saved_elsewhere:
        return
    barriers = [tree.order[b] for b in tree.find(cst.Call, lambda c: method_name(c) == "barrier")]
    saves_in: dict[cst.CSTNode, list[int]] = {}  # scope -> its saves' positions, in order
    for save in saves:
        saves_in.setdefault(tree.scope(save), []).append(tree.order[save])
    done = set()
    for load in tree.calls_to("torch.load"):
        at = tree.order[load]
        in_scope = saves_in.get(tree.scope(load), [])
        earlier = in_scope[: bisect.bisect_left(in_scope, at)]  # its scope's saves before it
        if not earlier and saved_elsewhere:
            # The best checkpoint reloaded after training, saved by a helper of another
            # module or method (`early_stopping(loss, model, path)` in the loop).
            scope = tree.scope(load)
            steps = [tree.order[b] for b in backward_calls(tree) if tree.scope(b) is scope]
            earlier = sorted(b for b in steps if b < at)
        if not earlier or rank_zero_scope(tree.ancestors(load)) is not None:
            continue
        last_save = earlier[-1]
        # A barrier between that save and the load already waits.
        if bisect.bisect_right(barriers, last_save) < bisect.bisect_left(barriers, at):
            continue
        statement = tree.statement(load)
        if statement in done:
            continue
        done.add(statement)
        plan.needs.add("dist")
        line = f"{plan.dist}.barrier()"
        comment = "# ddpify: wait until rank 0 has written the checkpoint"
        edits.before[statement].append(snippets.statements(line, comment)[0])
        plan.change(NAME, "barrier before reading what rank 0 wrote", line, "DDP050")
