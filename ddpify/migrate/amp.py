"""Pass 6, amp: autocast around forward and loss, a GradScaler for fp16, unscale_ before
clipping; legacy `torch.cuda.amp` spellings become `torch.amp`.

AMP is on for GPUs only (USE_AMP), so CPU runs compute exactly what the original did.
bf16 needs no scaler; the scaler is created disabled unless the dtype is fp16, so the
same `SCALER.scale(loss).backward()` lines serve both.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted, method_name
from ddpify.migrate import snippets
from ddpify.migrate.analyze import (
    Plan,
    backward_calls,
    bound_target,
    model_names,
    optimizer_names,
)
from ddpify.migrate.edits import Edits
from ddpify.migrate.tree import Tree, mentions

NAME = "amp"
AUTOCASTS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast")
LEGACY = {
    "torch.cuda.amp.autocast": 'torch.autocast("cuda"{args})',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda"{args})',
}
SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler")
CLIPS = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    _modernise(tree, plan, edits)
    if tree.calls_to(*AUTOCASTS):
        plan.amp_existing = True
        _unscale_before_clip(tree, plan, edits)
        return edits
    if plan.options.amp == "off" or not plan.shape.converts:
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
    """(forward statements, the backward statement, the optimizer.step() call) in one block."""
    statement = tree.statement(backward)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    block = list(tree.block(statement).body)
    index = block.index(statement)
    models = model_names(tree)
    receiver = backward.func.value  # type: ignore[union-attr]
    loss = dotted(receiver)
    start = None
    for i, stmt in enumerate(block[:index]):
        if _calls_model(tree, stmt, models):
            start = i
            break
    if start is None:
        return None
    end = start
    for i in range(start, index):
        if loss is None or _assigns(block[i], loss):
            end = i
    step = _optimizer_step(tree, block[index + 1 :])
    if step is None:
        return None
    return block[start : end + 1], statement, backward, step


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
            if method_name(call) != "step" or call.args:
                continue
            name = dotted(call.func.value)  # type: ignore[union-attr]
            if name and (name in optimizers or "optim" in name.lower()):
                return call
    return None


def _autocast(tree, plan, edits, forward, statement, backward, step) -> None:
    loss = tree.code(backward.func.value)
    new_backward = snippets.expression(f"SCALER.scale({loss}).backward()")
    edits.replace(backward, new_backward)
    optimizer = tree.code(step.func.value)
    edits.replace(step, snippets.expression(f"SCALER.step({optimizer})"))
    step_statement = tree.statement(step)
    edits.after[step_statement].append(snippets.statement("SCALER.update()"))
    template = snippets.statement(snippets.AUTOCAST)
    edits.group(forward, snippets.nested_under(template))
    plan.change(
        NAME,
        "autocast around the forward pass and the loss",
        'with torch.autocast("cuda", dtype=AMP_DTYPE, enabled=USE_AMP):',
    )
    plan.change(NAME, "backward through the GradScaler", f"SCALER.scale({loss}).backward()")
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


def _constants(tree: Tree, plan: Plan, edits: Edits) -> None:
    anchor = None
    for stmt in tree.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            if dotted(stmt.body[0].targets[0].target) == "WORLD_SIZE":
                anchor = stmt
    if anchor is None:
        return
    choice = plan.options.amp
    comment = snippets.AMP_COMMENT.format(choice=snippets.AMP_CHOICE[choice])
    code = snippets.AMP_CONSTANTS.format(dtype=snippets.AMP_DTYPES[choice])
    lines = snippets.statements(code, comment)
    lines[0] = lines[0].with_changes(leading_lines=[cst.EmptyLine(), *lines[0].leading_lines])
    edits.after[anchor].extend(lines)
    plan.change(NAME, f"mixed precision on GPUs: {snippets.AMP_CHOICE[choice]}", "USE_AMP = ")
