"""Pass 6, amp: autocast around forward and loss, a GradScaler for fp16, unscale_ before
clipping; legacy `torch.cuda.amp` spellings become `torch.amp`.

AMP is on for GPUs only (USE_AMP), so CPU runs compute exactly what the original did.
bf16 needs no scaler; the scaler is created disabled unless the dtype is fp16, so the
same `SCALER.scale(loss).backward()` lines serve both.

The loss must be computed inside autocast too: outside it, a loss on a bf16 output and a
float32 target fails in backward on CUDA ("Found dtype Float but expected BFloat16").
So a loss computed in the backward statement itself (`loss_fn(out, y).backward()`)
becomes an assignment inside the autocast block, and the backward goes through it. A
script that keeps its tensors on the CPU gets no AMP: `autocast("cuda")` would not touch
its work.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted, method_name
from ddpify.analysis.training import gradient_penalties, is_optimizer_step
from ddpify.analysis.tree import Tree, mentions, names_in
from ddpify.migrate import snippets
from ddpify.migrate.analyze import (
    Plan,
    backward_calls,
    bound_target,
    model_names,
    optimizer_names,
)
from ddpify.migrate.edits import Edits
from ddpify.migrate.entrypoint import after_imports, runs_on_cuda

NAME = "amp"
AUTOCASTS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast")
LEGACY = {
    "torch.cuda.amp.autocast": 'torch.autocast("cuda"{args})',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda"{args})',
}
SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler")
CLIPS = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_")
# Names for a loss that the original computed inside the backward statement.
LOSS_NAMES = ("loss", "batch_loss", "step_loss", "amp_loss")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    _modernise(tree, plan, edits)
    if tree.calls_to(*AUTOCASTS):
        plan.amp_existing = True
        _unscale_before_clip(tree, plan, edits)
        return edits
    if plan.options.amp == "off" or not plan.shape.converts:
        return edits
    if not backward_calls(tree):
        return edits  # a module of a project without a training step of its own
    if not runs_on_cuda(tree):
        plan.needs_human(
            "mixed precision not added: the script keeps its tensors on the CPU, where "
            'autocast("cuda") would change nothing',
            None,
        )
        return edits
    penalties = gradient_penalties(tree.view)
    if penalties:
        plan.needs_human(
            "mixed precision not added: the step differentiates gradients again "
            f"(`{tree.view.code(penalties[0].func)}(..., create_graph=True)`, a gradient "
            "penalty), and a "
            "GradScaler scales only the loss it is given, so under fp16 autocast the "
            "penalty's gradients would be taken unscaled and underflow; add AMP by hand with "
            "the scaled gradient-penalty recipe of the torch.amp examples if it is wanted",
            tree.code(tree.statement(penalties[0])) if tree.owns(penalties[0]) else None,
        )
        return edits
    steps = [step for step in (_training_step(tree, call) for call in backward_calls(tree)) if step]
    if not steps:
        backward = backward_calls(tree)
        plan.needs_human(
            "mixed precision not added: no forward/backward/step sequence found in one block",
            tree.code(tree.statement(backward[0])) if backward else None,
        )
        return edits
    for step in steps:
        _autocast(tree, plan, edits, *step)
    _constants(tree, plan, edits)
    plan.amp_added = True
    return edits


# -- legacy spellings -------------------------------------------------------------------


def _modernise(tree: Tree, plan: Plan, edits: Edits) -> None:
    for call in tree.calls_to(*LEGACY):
        template = LEGACY[tree.qualify(call.func)]  # type: ignore[index]
        args = "".join(", " + tree.code(arg).strip().rstrip(",") for arg in call.args)
        edits.replace(call, snippets.expression(template.format(args=args)))
        plan.change(
            NAME,
            f"{tree.code(call.func)} -> the torch.amp spelling",
            template.format(args=args).split("(")[0] + "(",
            "DDP043",
        )


def _unscale_before_clip(tree: Tree, plan: Plan, edits: Edits) -> None:
    """A script with its own scaler: `scaler.unscale_(opt)` before every clip that lacks it."""
    scalers = {bound_target(tree, c) for c in tree.calls_to(*SCALERS)} - {None}
    for call in tree.find(cst.Call, lambda c: method_name(c) == "step"):
        receiver = dotted(call.func.value)  # type: ignore[union-attr]
        if receiver not in scalers or not call.args:
            continue
        optimizer = tree.code(call.args[0].value)
        statement = tree.statement(call)
        block = list(tree.block(statement).body)
        before = block[: block.index(statement)]
        between = []
        for stmt in reversed(before):
            if ".backward(" in tree.code(stmt):
                break
            between.append(stmt)
        if any("unscale_" in tree.code(stmt) for stmt in between):
            continue
        for stmt in between:
            if any(tree.qualify(c.func) in CLIPS for c in tree.within(stmt, cst.Call)):
                line = f"{receiver}.unscale_({optimizer})"
                edits.before[stmt].append(snippets.statement(line))
                plan.change(
                    NAME,
                    "unscale_ before clipping, so the clip sees true gradients",
                    line,
                    "DDP044",
                )


# -- new AMP ----------------------------------------------------------------------------


def _training_step(tree: Tree, backward: cst.Call):
    """(forward statements, the backward statement, the backward call, the optimizer.step()
    call), all in one block. The forward statements may be none when the backward statement
    computes the loss (and the forward) itself."""
    statement = tree.statement(backward)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    block = list(tree.block(statement).body)
    index = block.index(statement)
    models = model_names(tree)
    receiver = backward.func.value  # type: ignore[union-attr]
    if _computes_loss(tree, receiver) and not _is_whole_statement(statement, backward):
        return None  # `total += f(x).backward()`: nowhere to put the loss
    loss = dotted(receiver)
    start = None
    for i in range(_after_previous_backward(tree, block, index), index):
        if _calls_model(tree, block[i], models):
            start = i
            break
    if start is None:
        if not (_computes_loss(tree, receiver) and _calls_model(tree, statement, models)):
            return None
        forward = []
    else:
        end = start
        for i in range(start, index):
            if loss is None or _assigns(block[i], loss):
                end = i
        forward = block[start : end + 1]
    step = _optimizer_step(tree, block[index + 1 :])
    if step is None:
        return None
    return forward, statement, backward, step


def _after_previous_backward(tree: Tree, block: list, index: int) -> int:
    """Where this step's forward can begin: after the block's previous backward, if any
    (a GAN's discriminator step must not swallow the generator's backward and step)."""
    for i in range(index - 1, -1, -1):
        if any(method_name(c) == "backward" for c in tree.within(block[i], cst.Call)):
            return i + 1
    return 0


def _computes_loss(tree: Tree, receiver: cst.BaseExpression) -> bool:
    """`loss_fn(out, y)` in `loss_fn(out, y).backward()` computes the loss there; a name,
    or `loss.mean()` of one, does not (a call with arguments is the sign)."""
    calls = [receiver, *tree.within(receiver, cst.Call)]
    return any(isinstance(call, cst.Call) and call.args for call in calls)


def _is_whole_statement(statement: cst.SimpleStatementLine, call: cst.Call) -> bool:
    small = statement.body
    return len(small) == 1 and isinstance(small[0], cst.Expr) and small[0].value is call


def _calls_model(tree: Tree, stmt: cst.BaseStatement, models: set[str]) -> bool:
    for call in tree.within(stmt, cst.Call):
        if dotted(call.func) in models:
            return True
        if any(dotted(arg.value) in models for arg in call.args):
            return not (tree.qualify(call.func) or "").startswith("torch.nn.utils")
    return False


def _assigns(stmt: cst.BaseStatement, name: str) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine):
        return mentions(stmt, name)
    small = stmt.body[0]
    if isinstance(small, cst.Assign):
        return any(mentions(t.target, name) for t in small.targets)
    if isinstance(small, (cst.AugAssign, cst.AnnAssign)):
        return mentions(small.target, name)
    return False


def _optimizer_step(tree: Tree, rest: list[cst.BaseStatement]) -> cst.Call | None:
    optimizers = optimizer_names(tree)
    for stmt in rest:
        for call in tree.within(stmt, cst.Call):
            # the optimizer's own `step()`, not a scaler's `step(optimizer)`
            if not call.args and is_optimizer_step(call, optimizers):
                return call
    return None


def _autocast(tree, plan, edits, forward, statement, backward, step) -> None:
    receiver = backward.func.value
    optimizer = tree.code(step.func.value)
    template = snippets.statement(snippets.AUTOCAST)
    if _computes_loss(tree, receiver):
        loss = _fresh_loss_name(tree, statement)
        edits.group([*forward, statement], _loss_inside(template, loss))
        plan.change(
            NAME,
            f"the loss computed in the backward line becomes `{loss}`, inside autocast",
            f"{loss} = {tree.code(receiver).strip()}",
        )
    else:
        loss = tree.code(receiver)
        new_backward = snippets.expression(f"SCALER.scale({loss}).backward()")
        edits.replace(backward, new_backward)
        edits.group(forward, snippets.nested_under(template))
    if step not in edits.replacements:  # two backwards before one step: one update
        edits.replace(step, snippets.expression(f"SCALER.step({optimizer})"))
        last = tree.statement(step)
        for other in _steps_after(tree, step):
            # `opt_g.step(); opt_f.step()` after one backward: the scaled gradients reach
            # both, so both step through the scaler, and it updates once, after them.
            edits.replace(other, snippets.expression(f"SCALER.step({tree.code(other.func.value)})"))
            last = _block_statement(tree, other, last)
            plan.change(
                NAME,
                "optimizer step through the GradScaler",
                f"SCALER.step({tree.code(other.func.value)})",
            )
        edits.after[last].append(snippets.statement("SCALER.update()"))
    plan.change(
        NAME,
        "autocast around the forward pass and the loss",
        'with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):',
    )
    plan.change(NAME, "backward through the GradScaler", f"SCALER.scale({loss}).backward(")
    plan.change(NAME, "optimizer step through the GradScaler", f"SCALER.step({optimizer})")
    block = list(tree.block(statement).body)
    following = block[block.index(statement) + 1 :]
    for stmt in following:
        if tree.inside(step, stmt):
            break
        if any(tree.qualify(c.func) in CLIPS for c in tree.within(stmt, cst.Call)):
            line = f"SCALER.unscale_({optimizer})"
            edits.before[stmt].append(snippets.statement(line))
            plan.change(
                NAME, "unscale_ before clipping, so the clip sees true gradients", line, "DDP044"
            )


def _steps_after(tree: Tree, step: cst.Call) -> list[cst.Call]:
    """The other optimizers' `step()` calls that follow `step` in its block, before the
    next backward: they step on the same scaled gradients."""
    statement = tree.statement(step)
    block = list(tree.block(statement).body)
    optimizers = optimizer_names(tree)
    found = []
    for stmt in block[block.index(statement) + 1 :]:
        calls = list(tree.within(stmt, cst.Call))
        if any(method_name(call) == "backward" for call in calls):
            break
        found += [c for c in calls if not c.args and is_optimizer_step(c, optimizers)]
    return found


def _block_statement(tree: Tree, node: cst.CSTNode, default: cst.CSTNode) -> cst.CSTNode:
    """The statement of `default`'s block that holds `node` (an `if` around a step)."""
    block = tree.block(default)
    current = node
    while current is not None and tree.parent.get(current) is not block:
        current = tree.parent.get(current)
    return current if current is not None else default


def _fresh_loss_name(tree: Tree, statement: cst.BaseStatement) -> str:
    taken = names_in(tree.scope(statement))
    return next((name for name in LOSS_NAMES if name not in taken), "ddpify_loss")


def _loss_inside(template: cst.BaseCompoundStatement, loss: str):
    """A grouping callback for `<forward>; f(out, y).backward()`: the forward and
    `loss = f(out, y)` go under autocast, then `SCALER.scale(loss).backward()`."""

    def build(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        *forward, last = members
        call = last.body[0].value  # type: ignore[attr-defined]
        value = call.func.value
        if not isinstance(value, cst.NamedExpr):  # `loss = (a + b)` reads as `loss = a + b`
            value = value.with_changes(lpar=[], rpar=[])
        assign = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(loss))], value)])
        scaled = snippets.expression(f"SCALER.scale({loss})")
        backward = last.with_changes(
            body=[cst.Expr(call.with_changes(func=call.func.with_changes(value=scaled)))]
        )
        first = forward[0] if forward else last
        body = [snippets.bare(s) for s in forward[:1]] + forward[1:] + [assign]
        block = template.with_changes(
            body=template.body.with_changes(body=body), leading_lines=first.leading_lines
        )
        return [block, backward if forward else snippets.bare(backward)]

    return build


def _constants(tree: Tree, plan: Plan, edits: Edits) -> None:
    anchor = None
    for stmt in tree.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            if dotted(stmt.body[0].targets[0].target) == "WORLD_SIZE":
                anchor = stmt
    if anchor is None and not plan.entry:
        anchor = after_imports(tree)  # a project's module: the rank constants come later
    if anchor is None:
        return
    choice = plan.options.amp
    comment = snippets.AMP_COMMENT.format(choice=snippets.AMP_CHOICE[choice])
    code = snippets.AMP_CONSTANTS.format(dtype=snippets.AMP_DTYPES[choice])
    lines = snippets.statements(code, comment)
    lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine(), *lines[0].leading_lines])
    edits.after[anchor].extend(lines)
    plan.change(NAME, f"mixed precision on GPUs: {snippets.AMP_CHOICE[choice]}", "USE_AMP = ")
