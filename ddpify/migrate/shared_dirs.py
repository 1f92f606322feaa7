"""Pass, folders: a folder reset that every rank would run, run on rank 0 alone.

Scripts start by preparing their experiment folder: `if os.path.exists(d):
shutil.rmtree(d)`, then `os.makedirs(d)`. Under torchrun every rank runs that, and the
ranks race on the same folder: one removes what another has just made, or `makedirs`
fails with FileExistsError on the second rank. Here the statement of the function that
holds the reset runs on global rank 0, and a barrier after it keeps the other ranks
from using the folder before it exists.

Only where that is safe: in a function (never at import time, before the process group
exists) that every rank calls (no call of it under a rank-0 guard, where the barrier
would wait forever), outside the training loop and the model's forward passes (an
evaluation: DDP's forward is a collective), and when the guarded statement binds
no name that the code after it reads (the other ranks skip those assignments). An exit
inside the reset (`print("Folder exists."); sys.exit(0)`) then runs on rank 0 alone: it is
reported, since leaving the reset to every rank would make the usual path race.

A reset that cannot move is left to every rank. Where it only makes a folder that a test
just found missing (`if not os.path.isdir(d): os.mkdir(d)`, in an evaluation that runs
the model), the make becomes `os.makedirs(d, exist_ok=True)` in place: a rank that loses
the race then finds the folder made, as the single process would have. Any other reset
left to every rank is reported.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

from ddpify.analysis.downloads import runs_rank_zero_first_by_callers
from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import and_terms, dotted, find_arg
from ddpify.analysis.roles import runs_model
from ddpify.analysis.tree import Tree, names_in
from ddpify.migrate import snippets
from ddpify.migrate.analyze import INIT_PG, SETUP_FUNCTION, Plan, backward_calls
from ddpify.migrate.args import append_arg, keyword
from ddpify.migrate.edits import Edits

NAME = "folders"
REMOVE = ("shutil.rmtree",)
MAKE = ("os.makedirs", "os.mkdir")
EXITS = ("sys.exit", "exit", "quit", "os._exit")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if not plan.shape.converts:
        return edits
    done: list[cst.BaseStatement] = []
    for call in tree.find(cst.Call, lambda c: _resets_folder(tree, c)):
        statement = _reset_statement(tree, call)
        if statement is None or any(tree.inside(statement, d) for d in done):
            continue
        if not _safe(tree, call, statement):
            _leave_to_every_rank(tree, plan, edits, call)
            continue
        done.append(statement)
        edits.group([statement], _guarded_then_barrier(plan))
        _report_exit(tree, plan, statement)
        plan.needs.add("dist")
        line = tree.code(statement).strip().splitlines()[0]
        plan.change(
            NAME,
            "the folder is reset on global rank 0 only, the other ranks wait for it "
            "(every rank removing and making the same folder races)",
            line,
        )
    return edits


def _leave_to_every_rank(tree: Tree, plan: Plan, edits: Edits, call: cst.Call) -> None:
    """A reset left on every rank where it may race: a make under a test that the folder is
    missing is made race-free in place, anything else is said; nothing where rank 0 alone
    runs it already or it is part of the training step."""
    func = tree.function(call)
    if rank_zero_scope(tree.ancestors(call)) is not None or func is None:
        return
    if runs_rank_zero_first_by_callers(tree, func):
        return  # rank 0 runs it alone, first: nothing races
    if any(tree.inside(step, tree.statement(call)) for step in backward_calls(tree)):
        return
    race_free = _race_free_make(tree, call)
    if race_free is not None:
        edits.replace(call, race_free)
        why = _RACE_FREE_WHY
        if tree.qualify(call.func) == "os.mkdir":
            why += _MKDIR_WIDENED
        plan.change(NAME, why, tree.code(race_free))
        return
    plan.needs_human(
        "every rank removes or makes this folder, and they race (one rank removes what "
        "another made, or makedirs fails on the second); ddpify did not move it under "
        "rank 0 because not every rank would then reach the barrier after it (it is under "
        "a test of the folder, in a loop, or in a block that runs the model, whose forward is a "
        "collective under DDP); run it on rank 0 and call dist.barrier() "
        "where every rank passes",
        tree.code(tree.statement(call)),
    )


_RACE_FREE_WHY = (
    "every rank still makes this folder when the test above finds it missing, now with "
    "os.makedirs(..., exist_ok=True): a rank that loses the race finds it made instead of "
    "stopping with FileExistsError"
)
_MKDIR_WIDENED = " (os.makedirs also makes missing parent folders, where os.mkdir stopped)"


def _race_free_make(tree: Tree, call: cst.Call) -> cst.Call | None:
    """`os.makedirs(d, exist_ok=True)` for a make that runs only where a test just found
    `d` missing (`if not os.path.exists(d):` around it): the same result for the single
    process, and no FileExistsError for a rank that loses the race. None for any other
    make, or a spelling this cannot keep (`from os import mkdir`, `dir_fd=`)."""
    positional = [a for a in call.args if a.keyword is None]
    keywords = {a.keyword.value for a in call.args if a.keyword is not None}
    if not positional or not isinstance(call.func, cst.Attribute) or keywords - _KEPT_KEYWORDS:
        return None
    if not _tested_missing(tree, call, tree.code(positional[0].value)):
        return None
    # os.mkdir(path, mode) and os.makedirs(name, mode, exist_ok): the same first two places
    kept = [*positional[:2], *(a for a in call.args if a.keyword and a.keyword.value == "mode")]
    if kept != list(call.args):
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    made = call.with_changes(func=call.func.with_changes(attr=cst.Name("makedirs")), args=kept)
    return append_arg(made, keyword("exist_ok", cst.Name("True")))


_KEPT_KEYWORDS = {"mode", "exist_ok"}


def _tested_missing(tree: Tree, call: cst.Call, path: str) -> bool:
    """`call` is a statement of the body of `if not os.path.exists(path):` (or `isdir`),
    that test alone or one of the terms of an `and` (`if args.save and not ...:`)."""
    node: cst.CSTNode = call
    while isinstance(node, _BETWEEN_CALL_AND_IF) or node is call:
        node = tree.parent.get(node)
    if not isinstance(node, cst.If) or not tree.inside(call, node.body):
        return False
    return any(_finds_missing(tree, term, path) for term in and_terms(node.test))


def _finds_missing(tree: Tree, term: cst.BaseExpression, path: str) -> bool:
    """`not os.path.exists(path)` or `not os.path.isdir(path)`."""
    if not isinstance(term, cst.UnaryOperation) or not isinstance(term.operator, cst.Not):
        return False
    tested = term.expression
    return (
        isinstance(tested, cst.Call)
        and tree.qualify(tested.func) in ("os.path.exists", "os.path.isdir")
        and len(tested.args) == 1
        and tree.code(tested.args[0].value) == path
    )


# What lies between `os.mkdir(d)` and the `if` whose body holds it as a statement.
_BETWEEN_CALL_AND_IF = (
    cst.Expr,
    cst.SimpleStatementLine,
    cst.SimpleStatementSuite,
    cst.IndentedBlock,
)


def _report_exit(tree: Tree, plan: Plan, statement: cst.BaseStatement) -> None:
    """The reset may leave (`print("Folder exists."); sys.exit(0)`): under rank 0, only
    rank 0 leaves and the others wait at the barrier. Racing ranks in the usual path would
    be worse, so the reset is still guarded, and the exit is reported."""
    leaving = _leaving_node(tree, statement)
    if leaving is None:
        return
    plan.needs_human(
        "this exit now runs on rank 0 only (it is part of the folder reset moved under rank "
        "0); the other ranks would wait at the barrier after it: decide on every rank "
        "whether to stop (e.g. test the folder before the reset) or broadcast the decision",
        tree.code(tree.statement(leaving)),
    )


def _guarded_then_barrier(plan: Plan):
    template = snippets.statement(f"if {plan.rank} == 0:\n    pass\n")
    barrier = snippets.statement(f"{plan.dist}.barrier()")

    def build(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        return [*snippets.nested_under(template)(members), barrier]

    return build


def _resets_folder(tree: Tree, call: cst.Call) -> bool:
    name = tree.qualify(call.func)
    if name in REMOVE:
        return True
    if name in MAKE:
        exist_ok = find_arg(call, "exist_ok", 2 if name == "os.makedirs" else 99)
        return exist_ok is None or dotted(exist_ok.value) in ("False", None)
    return False


def _reset_statement(tree: Tree, call: cst.Call) -> cst.BaseStatement | None:
    """The largest statement around `call`, inside its function, whose effects the
    other ranks can skip: one that binds no name the function reads after it (its
    `if os.path.exists(d): ... else: ...` and the config file written into the folder,
    not the logger set-up that every rank needs). None outside a function."""
    func = tree.function(call)
    if func is None:
        return None
    statement = tree.statement(call)
    if _assigned(tree, statement) & _read_after(tree, func, statement):
        return None
    while tree.block(statement) is not func.body:
        owner = tree.parent.get(tree.block(statement))
        while owner is not None and not isinstance(owner, cst.BaseStatement):
            owner = tree.parent.get(owner)
        if owner is None or _assigned(tree, owner) & _read_after(tree, func, owner):
            break
        if runs_model(tree, owner):
            break  # an evaluation's `with torch.no_grad():` around the reset: see _safe
        statement = owner
    return statement


def _safe(tree: Tree, call: cst.Call, statement: cst.BaseStatement) -> bool:
    func = tree.function(statement)
    if func is None or rank_zero_scope(tree.ancestors(call)) is not None:
        return False
    if any(tree.inside(c, statement) for c in backward_calls(tree)):
        return False
    if runs_model(tree, statement):
        return False  # the model's forward under DDP is a collective: every rank runs it
    if not every_rank_reaches(tree, func, statement):
        return False
    return called_on_every_rank(tree, func)


def _leaving_node(tree: Tree, statement: cst.BaseStatement) -> cst.CSTNode | None:
    """Where `statement` may leave its function or the program: a return, a raise, an exit."""
    for node in tree.within(statement, (cst.Return, cst.Raise)):
        return node
    for call in tree.within(statement, cst.Call):
        if tree.qualify(call.func) in EXITS:
            return call
    return None


def every_rank_reaches(
    tree: Tree,
    func: cst.FunctionDef | None,
    statement: cst.BaseStatement,
    same_test: Callable[[Tree, cst.BaseExpression], bool] | None = None,
) -> bool:
    """Every rank takes the same path to `statement` in `func` (None: at module level),
    so all of them meet the barrier: no loop around it, no `try` that handles an error
    (a `try: ... finally:` only cleans up), and no `if` whose test may differ between
    the ranks: by default one that calls anything (`os.path.exists(d)` reads the folder
    that rank 0 is changing), else as `same_test` judges it."""
    same_test = same_test or _calls_nothing
    for node in tree.ancestors(statement)[:-1]:
        if func is not None and (not tree.inside(node, func) or node is func):
            continue
        if func is None and isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(node, cst.Try) and not node.handlers:
            continue
        if isinstance(node, (cst.For, cst.While, cst.Try, cst.With)):
            return False
        if isinstance(node, cst.If) and not same_test(tree, node.test):
            return False
    return True


def _calls_nothing(tree: Tree, expr: cst.BaseExpression) -> bool:
    return not isinstance(expr, cst.Call) and not any(True for _ in tree.within(expr, cst.Call))


def _assigned(tree: Tree, statement: cst.BaseStatement) -> set[str]:
    """Names `statement` binds or mutates (`x` for `x.attr = ...` and `x[i] = ...`)."""
    names: set[str] = set()
    for node in tree.within(statement, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        else:
            targets = [node.target]
        for target in targets:
            names |= names_in(target)
    for node in tree.within(statement, (cst.AsName, cst.For)):
        names |= names_in(node.name if isinstance(node, cst.AsName) else node.target)
    return names


def _read_after(tree: Tree, func: cst.FunctionDef, statement: cst.BaseStatement) -> set[str]:
    """Names whose value at the end of `statement` the function may still read: a name
    mentioned after it (not inside it), unless first bound again there in a block that
    holds every later mention (`overwrite = False` before a later `if overwrite:`)."""
    later: dict[str, list[cst.Name]] = {}
    for name in tree.within(func, cst.Name):
        if tree.after(name, statement) and not tree.inside(name, statement):
            later.setdefault(name.value, []).append(name)
    return {value for value, names in later.items() if not _rebound_first(tree, names)}


def _rebound_first(tree: Tree, names: list[cst.Name]) -> bool:
    first = names[0]
    if not _bound_here(tree, first):
        return False
    block = tree.block(tree.statement(first))
    return all(tree.inside(name, block) for name in names)


def _bound_here(tree: Tree, name: cst.Name) -> bool:
    parent = tree.parent.get(name)
    return isinstance(parent, cst.AssignTarget) or (
        isinstance(parent, cst.AsName) and parent.name is name
    )


def called_on_every_rank(tree: Tree, func: cst.FunctionDef) -> bool:
    """Every call of `func` in the project runs on all ranks (none under a rank guard,
    none in a module-level statement that runs before the process group exists)."""
    view = tree.view
    name = func.name.value
    calls = view.find(cst.Call, lambda c: (dotted(c.func) or "").rsplit(".", 1)[-1] == name)
    if not calls or runs_rank_zero_first_by_callers(tree, func):
        return False
    for call in calls:
        owner = view.owner(call)
        if owner is None or rank_zero_scope(owner.ancestors(call)) is not None:
            return False
        if owner.function(call) is None and not after_group_exists(owner, call):
            return False
    return True


def after_group_exists(tree: Tree, call: cst.Call) -> bool:
    """A module-level call that runs after the process group is set up (in the
    `__main__` block, after `init_distributed()`)."""
    return any(
        tree.after(call, init) and tree.function(init) is None
        for init in tree.find(cst.Call, lambda c: _sets_up_group(tree, c))
    )


def _sets_up_group(tree: Tree, call: cst.Call) -> bool:
    return (dotted(call.func) or "") == SETUP_FUNCTION or tree.qualify(call.func) == INIT_PG
