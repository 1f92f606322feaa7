"""Batches a training loop makes by hand, without a DataLoader.

Real scripts slice tensors themselves (`x = data[i:i + bs]`), draw random windows
(`xb, yb = get_batch("train")`), pull from a generator (`x, y = next(batches)`) or train
full-batch on whole tensors built before the loop. The batch "enters the step" at the
assignment, inside the loop, of a name the model is called with. That assignment is
where a migration shards it by rank; when there is none (the model only sees tensors
built outside the loop) the loop trains full-batch.

Purely syntactic, over one loop: `models` are the names of the trained modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted
from ddpify.walk import children

_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


@dataclass
class BatchAssignment:
    """`xb, yb = get_batch("train")` inside a training loop: the batch enters the step."""

    statement: cst.SimpleStatementLine
    names: list[str]  # every name it binds, in order (`xb`, `yb`)
    value: cst.BaseExpression


def body_nodes(loop: cst.CSTNode) -> list[cst.CSTNode]:
    """Every node in the loop in source order, nested functions and classes excluded."""
    found, stack = [], list(children(loop))[::-1]
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue
        found.append(node)
        stack.extend(list(children(node))[::-1])
    return found


def _assigned_names(assign: cst.Assign) -> list[str] | None:
    if len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        names = [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
        return names if len(names) == len(target.elements) else None
    return None


def model_calls(loop: cst.CSTNode, models: set[str]) -> list[cst.Call]:
    """Direct calls of a trained module in the loop: `model(x)`, `G(z)`."""
    return [
        node
        for node in body_nodes(loop)
        if isinstance(node, cst.Call) and dotted(node.func) in models
    ]


def batch_assignments(loop: cst.CSTNode, models: set[str]) -> list[BatchAssignment]:
    """The assignments in the loop that bind what a trained module is called with, other
    than the outputs of a trained module (`fake = G(z)` is not a batch)."""
    arguments = _model_arguments(loop, models)
    outputs = model_outputs(loop, models)
    found: list[BatchAssignment] = []
    entered: set[str] = set()  # names bound from a batch that entered the step earlier
    for node in body_nodes(loop):
        if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
            continue
        assign = node.body[0]
        if not isinstance(assign, cst.Assign):
            continue
        names = _assigned_names(assign)
        if not names or not set(names) & arguments:
            continue
        if model_calls(assign, models) or _already_sharded(assign.value):
            continue
        if names_read(assign.value) & outputs:  # `states = detach(states)`: not a batch
            continue
        if names_read(assign.value) & entered:
            # `xb = xb.to(device)`, `x = torch.Tensor(x)`: the batch that entered above,
            # converted; split there, it must not be split again here.
            entered.update(names)
            continue
        found.append(BatchAssignment(node, names, assign.value))
        entered.update(names)
    return found


def _model_arguments(loop: cst.CSTNode, models: set[str]) -> set[str]:
    calls = model_calls(loop, models)
    return {
        arg.value.value for call in calls for arg in call.args if isinstance(arg.value, cst.Name)
    }


def model_outputs(loop: cst.CSTNode, models: set[str]) -> set[str]:
    """Names the loop binds from a trained module's output (`outputs, states = model(x)`)."""
    found: set[str] = set()
    for node in body_nodes(loop):
        if isinstance(node, cst.Assign) and model_calls(node, models):
            found.update(_assigned_names(node) or ())
    return found


def carried_state(loop: cst.CSTNode, models: set[str]) -> list[str]:
    """What the model is called with that its own output feeds back, step to step: an RNN's
    hidden state (`out, states = model(x, states)`), sized by the batch it started with."""
    carried: set[str] = set()
    seen_as_argument: set[str] = set()
    for node in body_nodes(loop):
        if isinstance(node, cst.Call) and dotted(node.func) in models:
            seen_as_argument |= {a.value.value for a in node.args if isinstance(a.value, cst.Name)}
        elif isinstance(node, cst.Assign) and model_calls(node, models):
            # Bound from the model only after (or where) the model took it: it comes back
            # around the loop. `fake = G(z); D(fake)` is bound first: not carried.
            carried |= set(_assigned_names(node) or ()) & (
                seen_as_argument | _model_arguments(node, models)
            )
    return sorted(carried)


def _already_sharded(value: cst.BaseExpression) -> bool:
    return any(
        isinstance(node, cst.Name) and node.value == "WORLD_SIZE" for node in body_nodes(value)
    )


def single_example(value: cst.BaseExpression) -> bool:
    """`Xtr[[i]]`: a batch of exactly one example, which cannot be split across ranks."""
    nodes = [value, *body_nodes(value)]
    for node in nodes:
        if isinstance(node, cst.Subscript) and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.List):
                if len(index.value.elements) == 1:
                    return True
    return False


def names_read(value: cst.BaseExpression) -> set[str]:
    """Plain names the expression reads (`data_gen` in `data_gen.__next__()`)."""
    nodes = [value, *body_nodes(value)]
    return {node.value for node in nodes if isinstance(node, cst.Name)}
