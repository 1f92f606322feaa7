"""The migration pipeline: gates around a sequence of passes over one module.

Each pass analyses the current tree, plans edits and applies them; its output must
compile before the next pass runs, so a broken rewrite is blamed on the pass that made
it. At the end the whole migration must be idempotent and `ddpify check` must not
report any code the migration claims to have fixed. A failed gate raises GateError and
nothing is written.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Callable

import libcst as cst

from ddpify import splice
from ddpify.analysis.project import ProjectView
from ddpify.analysis.tree import Tree
from ddpify.codegen import ModuleText
from ddpify.gates import (
    GateError,
    check_comments_kept,
    check_compiles,
    compile_verdict,
    parse_input,
    require_compiles,
    require_roundtrip,
)
from ddpify.gc_tuning import no_collections
from ddpify.guarded import PARALLEL_CHARS, Beside, GaveUp, guarded
from ddpify.libcst_speed import parse_module
from ddpify.migrate import (
    amp,
    data,
    device,
    downloads,
    entrypoint,
    imports,
    rank_zero,
    shared_dirs,
    type_tests,
    unwrap,
    wrap,
)
from ddpify.migrate.analyze import NotMigrated, Options, Plan, analyze_project
from ddpify.migrate.edits import Edits
from ddpify.migrate.report import HumanItem, MigrationResult

Pass = tuple[str, Callable[[Tree, Plan], Edits]]

PASSES: list[Pass] = [
    (entrypoint.NAME, entrypoint.run),
    (device.NAME, device.run),
    (wrap.NAME, wrap.run),
    (type_tests.NAME, type_tests.run),
    (data.NAME, data.run),
    (amp.NAME, amp.run),
    (rank_zero.NAME, rank_zero.run),
    (shared_dirs.NAME, shared_dirs.run),
    (downloads.NAME, downloads.run),
    (imports.NAME, imports.run),
    # Reads the wrapped script once its DDP import is there: copies, checkpoints by name.
    (unwrap.NAME, unwrap.run),
]


def migrate_source(
    text: str,
    filename: str = "train.py",
    options: Options | None = None,
    *,
    gates: bool = True,
    passes: Sequence[Pass] | None = None,
) -> MigrationResult:
    """Migrate one script's text. Raises GateError when a safety gate fails, and fails
    the `parse` gate for a file that crashes or stalls the parser (see guarded.py)."""
    return migrate_sources({filename: text}, options, gates=gates, passes=passes)[0]


def migrate_sources(
    texts: dict[str, str],
    options: Options | None = None,
    *,
    gates: bool = True,
    passes: Sequence[Pass] | None = None,
) -> list[MigrationResult]:
    """Migrate a project: the entry script first, then the local modules it imports
    (name -> text). One result per module, in the same order; every module passes the
    gates or GateError names the first that does not."""
    try:
        return guarded(_migrate_guarded, "\n".join(texts.values()), texts, options, gates, passes)
    except GaveUp as exc:
        raise GateError("parse", f"cannot analyse: {exc}") from None


def _migrate_guarded(_joined, texts, options, gates, passes) -> list[MigrationResult]:
    with no_collections():
        passes = PASSES if passes is None else passes
        render = ModuleText(inner=True)  # the statements inside blocks too: see codegen.py
        return _migrate_sources(texts, options or Options(), gates, passes, render)


def _migrate_sources(
    texts: dict[str, str],
    options: Options,
    gates: bool,
    passes: Sequence[Pass],
    render: ModuleText,
    parsed: list[cst.Module] | None = None,
    walked: list[Tree] | None = None,
) -> list[MigrationResult]:
    """`render` renders modules (one per run: it remembers statements); `parsed`, the
    modules of `texts` when a gate has parsed them already; `walked`, trees whose walk of
    the statements `parsed` shares with them can be reused (see Tree)."""
    names = list(texts)
    several = len(names) > 1
    # A large input's compile and render are checked in a forked child while this process
    # builds its tree, analyses the project and runs the passes (seconds each on 100k
    # lines): it must compile and render back to its text. A second run's input (the
    # output, parsed by the output gate) is compiled and mostly rendered already.
    if parsed is None:
        beside = [len(texts[name]) >= PARALLEL_CHARS for name in names]
        parsed = [
            _in_file(name, several, parse_input, texts[name], not large)
            for name, large in zip(names, beside)
        ]
        rendered = [
            _rendering(render, module, texts[name], large)
            for name, module, large in zip(names, parsed, beside)
        ]
    else:
        rendered = [(lambda module=module: (render.code(module), None)) for module in parsed]
    modules = parsed
    # Each pass's module per file; its code is rendered when a gate asks (see Stages).
    stages = {name: [("input", module)] for name, module in zip(names, modules)}
    try:
        try:
            trees = link(
                [
                    Tree(module, texts[name], previous=walked[index] if walked else None)
                    for index, (name, module) in enumerate(zip(names, modules))
                ]
            )
            plans = analyze_project(trees, options)
            for pass_name, run in passes:
                changed = False
                for index, name in enumerate(names):
                    tree, plan = trees[index], plans[index]
                    module = _in_file(name, several, _run_pass, pass_name, run, tree, plan)
                    if module is not tree.module:
                        trees[index] = Tree(module, previous=tree, render=render.code)
                        changed = True
                        stages[name].append((pass_name, module))
                if changed:
                    trees = link(trees)
        finally:
            # Before any other verdict (a text that does not round-trip is not read), but
            # after the passes: a large input's compile and render beside take about as
            # long as its analysis and passes, not its analysis alone.
            for name, (code, compile_error) in zip(names, _all_called(rendered)):
                _in_file(name, several, require_compiles, compile_error)
                _in_file(name, several, require_roundtrip, code, texts[name])
    except NotMigrated as exc:
        return [
            MigrationResult(name, texts[name], texts[name], exc.shape.value, False, exc.reason)
            for name in names
        ]
    results = [
        _result(name, texts[name], _output_code(stages[name], texts[name], render), plan)
        for name, plan in zip(names, plans)
    ]
    if not gates:
        return _located(results)
    finals = [tree.module for tree in trees]
    ahead = _FinalGatesAhead.start(names, results, options, passes, render, finals, trees)
    try:
        outputs = []  # each output as libcst parses it (parsed once, for every gate)
        for index, (name, result) in enumerate(zip(names, results)):
            ends = (modules[index], finals[index])
            _in_file(name, several, _gate_compiles, stages[name], render, result.output)
            parse = _output_parser(*ends, render)
            outputs.append(
                _in_file(
                    name, several, check_compiles, result.output, "output", "<output>", parse, True
                )
            )
            _in_file(name, several, _gate_comments, stages[name], render)
        if any(result.changed for result in results):
            if ahead is not None and all(map(splice.same_tree, outputs, finals)):
                found = ahead.results()
            else:
                found = _gate_idempotent_and_check(
                    names, results, options, passes, render, outputs, trees
                )
            for result, items in zip(results, found):
                result.needs_human.extend(items)
    finally:
        if ahead is not None:
            ahead.close()
    return _located(results)


def _located(results: list[MigrationResult]) -> list[MigrationResult]:
    for result in results:
        result.locate()
    return results


def _output_parser(before: cst.Module, after: cst.Module, render: ModuleText):
    """`cst.parse_module` for the output, re-parsing only what the passes changed when
    the module spliced from `before` (the input's parse) renders back to the text."""

    def parse(text: str) -> cst.Module:
        module = splice.splice_parse(before, after, text)
        if module is not None and render.code(module) == text:
            return module
        return parse_module(text)

    return parse


def link(trees: list[Tree]) -> list[Tree]:
    """Make every tree of a project search the whole project (see analysis/project.py)."""
    if len(trees) > 1:
        view = ProjectView(trees)
        for tree in trees:
            tree.view = view
    return trees


def _in_file(name: str, several: bool, fn, *args):
    """`fn(*args)`; in a project, a failed gate names the file it failed on."""
    try:
        return fn(*args)
    except GateError as exc:
        if several and not exc.reason.startswith(f"{name}: "):
            raise GateError(exc.pass_name, f"{name}: {exc.reason}") from None
        raise


def _all_called(functions: list[Callable[[], Any]]) -> list[Any]:
    """Each function's value; when one raises, the others are still called (each waits
    for its child) before the first error is raised."""
    values, error = [], None
    for function in functions:
        try:
            values.append(function())
        except Exception as exc:  # noqa: BLE001 - raised below, once every child is done
            error = error or exc
    if error is not None:
        raise error
    return values


def _rendering(
    render: ModuleText, module: cst.Module, text: str, beside: bool
) -> Callable[[], tuple[str, SyntaxError | None]]:
    """A function that returns `module`'s code and CPython's verdict on `text` (a
    SyntaxError, or None: it compiles; None too where `parse_input` compiled it).
    `beside`: both are made beside this process (see `ModuleText.code_beside`), else
    the code is rendered here when called."""
    if beside:
        return render.code_beside(module, functools.partial(compile_verdict, text))
    return lambda: (render.code(module), None)


def _run_pass(name: str, run, tree: Tree, plan: Plan) -> cst.Module:
    """The module after the pass (`tree.module` itself when it changed nothing)."""
    try:
        edits = run(tree, plan)
        if not edits:
            return tree.module
        return edits.apply(tree.module, tree.parent)
    except NotMigrated:
        raise
    except Exception as exc:  # a bug in the pass: blame it, write nothing
        raise GateError(name, f"{type(exc).__name__}: {exc}") from exc


# The modules a file went through: ("input", the parse), then (pass, its output) for each
# pass that changed it. Only the last is rendered on every run; a gate that fails renders
# the others to blame a pass (rendering after every pass cost seconds on 100k lines).
Stages = list[tuple[str, cst.Module]]


def _output_code(stages: Stages, text: str, render: ModuleText) -> str:
    return text if len(stages) == 1 else render.code(stages[-1][1])


def _written_code(
    render: ModuleText, before: cst.Module, after: cst.Module, code: str
) -> str | None:
    """The code of the top-level statements of `after` that `before` does not hold (what
    the pass wrote), or None when the whole text must be compiled. A top-level statement
    begins and ends a line with nothing open across it, so it compiles alone as it does
    in the module, except under a `__future__` import (it changes the grammar)."""
    if (
        not after.has_trailing_newline
        or (before.default_indent, before.default_newline)
        != (after.default_indent, after.default_newline)
        or "__future__" in code
    ):
        return None
    kept = {id(statement) for statement in before.body}
    return "".join(
        render.code_of(after, statement) for statement in after.body if id(statement) not in kept
    )


def _compile_error(code: str) -> Exception | None:
    try:
        compile(code, "<output>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        return exc
    return None


def _gate_compiles(stages: Stages, render: ModuleText, output: str) -> None:
    """The output (the code of the last stage) must compile under Python's own compiler.
    The input compiled, so the statements the passes wrote are compiled alone (see
    `_written_code`); when they do not compile, the first pass whose output does not
    compile is blamed."""
    written = _written_code(render, stages[0][1], stages[-1][1], output)
    if _compile_error(output if written is None else written) is None:
        return
    for pass_name, module in stages[1:]:
        error = _compile_error(render.code(module))
        if error is not None:
            raise GateError(pass_name, f"output does not compile: {error}") from None
    error = _compile_error(output)  # the statements alone do not, the whole text may
    if error is not None:
        raise GateError("pipeline", f"output does not compile: {error}") from None


def _result(filename: str, text: str, output: str, plan: Plan) -> MigrationResult:
    return MigrationResult(
        filename=filename,
        original=text,
        output=output,
        shape=plan.shape.value,
        migrated=True,
        changes=plan.changes,
        needs_human=plan.human,
        batch_policy=plan.options.batch_policy,
        lr_scaling=plan.lr_scaling,
        lr_rule=plan.lr_rule,
        amp=_amp_label(plan),
        hand_made=plan.hand_made,
        replicated=plan.replicated,
    )


def _amp_label(plan: Plan) -> str:
    if plan.amp_added:
        return plan.options.amp
    if plan.amp_existing:
        return "the script's own (kept)"
    return "off" if plan.shape.converts else "unchanged"


def _gate_comments(stages: Stages, render: ModuleText) -> None:
    """No comment of the input may be lost; blame the first pass that dropped one."""
    if not render.lost_comments(stages[0][1], stages[-1][1]):
        return
    codes = [(name, render.code(module)) for name, module in stages]
    for (_, before), (name, after) in zip(codes, codes[1:]):
        check_comments_kept(before, after, name)
    check_comments_kept(codes[0][1], codes[-1][1], "pipeline")


def _gate_idempotent(
    results: list[MigrationResult],
    options: Options,
    passes,
    render: ModuleText,
    parsed: list[cst.Module],
    walked: list[Tree],
) -> None:
    outputs = {result.filename: result.output for result in results}
    # The output's statements that no pass rewrote are the input's objects, walked
    # already: the second run's trees reuse those walks.
    again = _migrate_sources(outputs, options, False, passes, render, parsed, walked)
    for result, second in zip(results, again):
        if second.output != result.output:
            culprits = sorted({c.pass_name for c in second.changes}) or ["pipeline"]
            where = f"{result.filename}: " if len(results) > 1 else ""
            raise GateError(
                ", ".join(culprits),
                f"{where}not idempotent: migrating the output again changes it",
            )


def _gate_idempotent_and_check(
    names: list[str],
    results: list[MigrationResult],
    options: Options,
    passes,
    render: ModuleText,
    outputs: list[cst.Module],
    trees: list[Tree],
) -> list[list[HumanItem]]:
    """The idempotency gate, and `_gate_check` on every output (its items per file): for
    a large output the check runs in a forked child while this process migrates the
    output again (each costs seconds on 100k lines; a fork, milliseconds)."""
    large = sum(len(result.output) for result in results) >= PARALLEL_CHARS
    checking = Beside(_leftovers_of, names, results, outputs) if large else None
    try:
        _gate_idempotent(results, options, passes, render, outputs, trees)
        if checking is not None:
            return checking.result()
        return _leftovers_of(names, results, outputs)
    finally:
        if checking is not None:
            checking.close()


class _FinalGatesAhead:
    """The idempotency and check gates of a large migration, each started in a forked
    child on the passes' own final modules while this process runs the output gates
    (compile, parse, comments): on 100k lines each gate costs seconds, a fork
    milliseconds. The output's parse is what the gates must read; when it is not the
    same tree as the final module (`splice.same_tree`), the caller drops these and
    runs the gates again on the parse."""

    def __init__(self, idempotency: Beside, check: Beside) -> None:
        self._idempotency, self._check = idempotency, check

    @classmethod
    def start(cls, names, results, options, passes, render, finals, trees):
        """None for a small or unchanged migration (the gates run after the parse)."""
        if not any(result.changed for result in results):
            return None
        if sum(len(result.output) for result in results) < PARALLEL_CHARS:
            return None
        return cls(
            Beside(_gate_idempotent, results, options, passes, render, finals, trees),
            Beside(_leftovers_of, names, results, finals),
        )

    def results(self) -> list[list[HumanItem]]:
        """The idempotency gate's verdict first (a GateError), then the check gate's
        items per file, as `_gate_idempotent_and_check` gives them."""
        self._idempotency.result()
        return self._check.result()

    def close(self) -> None:
        self._idempotency.close()
        self._check.close()


def _leftovers_of(
    names: list[str], results: list[MigrationResult], outputs: list[cst.Module]
) -> list[list[HumanItem]]:
    several = len(names) > 1
    return [
        _in_file(name, several, _gate_check, result, module)
        for name, result, module in zip(names, results, outputs)
    ]


# Codes that only the DDP wrap brings about, so a check of the input cannot see them and
# no pass fixes them: gradient accumulation that all-reduces on every micro-step once the
# model is wrapped (DDP040). Their findings on the output are items that need a human.
ONLY_ON_THE_OUTPUT = frozenset({"DDP040"})


def _gate_check(result: MigrationResult, module: cst.Module) -> list[HumanItem]:
    """`ddpify check` must not report a code the migration claims to fix where it fixed
    it. The same code at a site no pass touched (a shape the pass does not handle) is
    not a broken rewrite: it is returned, as an item that needs a human."""
    from ddpify.engine import check_module
    from ddpify.rules import ALL_RULES

    claimed = result.fixed_codes
    # Only the claimed codes' rules: each rule reports on its own (engine.py), so their
    # findings are the ones a check with every rule makes, at a fraction of the cost.
    asked = claimed | ONLY_ON_THE_OUTPUT
    rules = [rule for rule in ALL_RULES if rule.CODE in asked]
    if not rules:
        return []
    found = check_module(module, result.output, result.filename, rules).diagnostics
    left = [d for d in found if d.code in asked]
    if not left:
        return []
    result.locate()
    fixed_at = {(c.code, c.line) for c in result.changes if c.code}
    # A change with no line of its own claims its code for the whole file.
    broken = [d for d in left if {(d.code, d.location.row), (d.code, None)} & fixed_at]
    if broken:
        passes = sorted({c.pass_name for c in result.changes if c.code in {d.code for d in broken}})
        listed = "; ".join(f"{d.code} at line {d.location.row}: {d.message}" for d in broken[:3])
        raise GateError(", ".join(passes), f"`ddpify check` still reports {listed}")
    return [
        HumanItem(
            f"{d.message} ({d.code}; the migration did not change this one)", line=d.location.row
        )
        for d in left
    ]
