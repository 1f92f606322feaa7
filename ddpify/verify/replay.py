"""Replay a run's optimizer on its recorded gradients, to tell why weights differ.

Gradients are compared at every step; the weights after the last step check what the
optimizer did with them. An adaptive optimizer (Adam, RMSprop, ...) divides each gradient
by its running magnitude plus eps, so where a gradient is near eps (1e-8) a difference far
inside the gradient tolerance (float32 rounding of a different summation order) becomes a
difference of up to lr in the weight. Replaying the optimizer, from the same initial weights,
on the gradients each run recorded separates the two questions: when the replay reproduces
both runs' weights, the optimizer did the same thing in both and the weight difference is
what the (matching) gradient differences make of it; when it does not, something in the
optimizer (learning rate, state, an extra or missing step) differs and the mismatch stands.
"""

from __future__ import annotations

# Optimizers whose step needs a closure (LBFGS) or keeps state we cannot rebuild are not replayed.
REPLAYABLE = {
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
}
# Implementation switches: the replay uses the plain single-tensor path on CPU.
IMPLEMENTATION_KEYS = {"foreach", "fused", "capturable", "differentiable"}


def replay_weights(record: dict, optimizer: int, steps: list[int]) -> list | None:
    """The weights optimizer `optimizer` of this run would reach by stepping on the gradients
    it recorded at `steps`, from its recorded initial weights; None when it cannot be replayed."""
    import torch

    info = record["optimizers"][optimizer] if optimizer < len(record["optimizers"]) else {}
    groups = info.get("groups")
    initial = record["initial"].get(optimizer)
    by_step = {s["step"]: s for s in record["steps"] if s["optimizer"] == optimizer}
    if info.get("class") not in REPLAYABLE or not groups or initial is None:
        return None
    if any(step not in by_step for step in steps) or sum(g["params"] for g in groups) != len(
        initial
    ):
        return None
    params = [torch.nn.Parameter(t.detach().clone()) for t in initial]
    param_groups, start = [], 0
    for group in groups:
        settings = {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS | {"params"}}
        size = group["params"]
        param_groups.append({**settings, "params": params[start : start + size]})
        start += size
    try:
        opt = getattr(torch.optim, info["class"])(param_groups)
        for step in sorted(steps):
            _take_recorded_step(opt, params, by_step[step])
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None  # a hyperparameter this torch does not take: no replay, no explanation
    return [p.detach() for p in params]


def _take_recorded_step(opt, params: list, recorded: dict) -> None:
    """One optimizer step as the run took it: its learning rates, its gradients."""
    for group, lr in zip(opt.param_groups, recorded["lrs"]):
        group["lr"] = lr
    for p, grad in zip(params, recorded["grads"]):
        p.grad = None if grad is None else grad.detach().clone().to(p.dtype)
    opt.step()


def replay_events(record: dict, events: list[tuple[int, int]]) -> dict | None:
    """Parameter values, by the probe's tensor id, after replaying the run's optimizer steps
    `events` ((optimizer, step) in the order the run took them) on its recorded gradients, every
    optimizer over the same tensors where they share parameters (a GAN's info optimizer over
    the generator and the discriminator). Starts from each optimizer's recorded initial
    weights for parameters no earlier optimizer holds. None when it cannot be replayed."""
    import torch

    ids = record.get("param_ids", {})
    by_event = {(s["optimizer"], s["step"]): s for s in record["steps"]}
    tensors: dict[int, torch.nn.Parameter] = {}
    optimizers: dict[int, tuple] = {}
    try:
        for optimizer, step in events:
            if optimizer not in optimizers:
                made = _shared_optimizer(record, optimizer, ids.get(optimizer), tensors)
                if made is None:
                    return None
                optimizers[optimizer] = made
            opt, params = optimizers[optimizer]
            _take_recorded_step(opt, params, by_event[(optimizer, step)])
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None
    return {key: p.detach() for key, p in tensors.items()}


def _shared_optimizer(record: dict, optimizer: int, ids, tensors: dict):
    """Optimizer `optimizer` rebuilt over the shared tensors (made from its initial weights
    where new); None when it is not replayable or holds a tensor twice."""
    import torch

    info = record["optimizers"][optimizer] if optimizer < len(record["optimizers"]) else {}
    groups, initial = info.get("groups"), record["initial"].get(optimizer)
    if info.get("class") not in REPLAYABLE or not groups or initial is None or not ids:
        return None
    if len(set(ids)) != len(ids) or len(ids) != len(initial):
        return None
    if sum(g["params"] for g in groups) != len(initial):
        return None
    params = []
    for key, value in zip(ids, initial):
        if key not in tensors:
            tensors[key] = torch.nn.Parameter(value.detach().clone())
        params.append(tensors[key])
    param_groups, start = [], 0
    for group in groups:
        settings = {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS | {"params"}}
        param_groups.append({**settings, "params": params[start : start + group["params"]]})
        start += group["params"]
    return getattr(torch.optim, info["class"])(param_groups), params
