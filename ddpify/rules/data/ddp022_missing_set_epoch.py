import builtins

import libcst as cst

from ddpify.analysis.endless import pass_restarts
from ddpify.analysis.loaders import EpochLoop, LoaderFacts, SamplerCall
from ddpify.diagnostics import FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.data._common import LoaderRule, looks_like_eval

# Callees that may take a loader without setting its sampler's epoch.
_HARMLESS_PACKAGES = ("torch.", "tqdm", "itertools.", "math.", "time.", "logging.")
_BUILTINS = set(dir(builtins))


class MissingSetEpoch(LoaderRule):
    """A DistributedSampler whose `set_epoch` is never called in a script with epochs."""

    CODE = "DDP022"
    NAME = "missing-set-epoch"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`set_epoch` is never called on this DistributedSampler, so every epoch sees the "
        "same order; call `sampler.set_epoch(epoch)` at the start of each epoch"
    )
    FIX = FixAvailability.SOMETIMES

    def leave_Module(self, node: cst.Module) -> None:
        facts = self.facts
        if self.context.model.framework is not None or not facts.samplers:
            return
        if facts.may_set_epoch() or _hands_loaders_away(facts):
            return
        for sampler in facts.samplers:
            if sampler.shuffles is False or _is_evaluation(sampler):
                continue  # the order does not matter
            if facts.epoch_loops:
                loop = _only_loop_in_scope(sampler, facts)
                fix = _fix(sampler, loop, facts)
                self.report(sampler.call.func, _message(sampler, loop), fix=fix)
            else:
                self._check_endless(sampler)

    def _check_endless(self, sampler: SamplerCall) -> None:
        """No epoch loop: a step loop may draw from an endless generator that restarts
        the loader (`def cycle(dl): while True: yield from dl`). Each restart is a new
        pass in the same order unless the epoch is set there, as migrate's stream pass
        does (the same `endless.pass_restarts` answer)."""
        loaders = {loader.target for loader in self.facts.loaders_drawing_from(sampler)}
        restarts = pass_restarts(self.context.tree.view, loaders - {None})
        if restarts:
            restart = restarts[0]
            message = (
                f"`set_epoch` is never called on this DistributedSampler, and "
                f"`{restart.function.name.value}()` restarts its loader endlessly: every "
                "pass sees the same order; call `sampler.set_epoch(n)` where a new pass "
                "begins, counting the passes"
            )
            self.report(sampler.call.func, message)


def _is_evaluation(sampler: SamplerCall) -> bool:
    loader = sampler.loader.target if sampler.loader else None
    return looks_like_eval(sampler.target, loader)


def _hands_loaders_away(facts: LoaderFacts) -> bool:
    """Whether a loader or sampler is passed to code outside this file, which may well
    call `set_epoch` (`engine.train_one_epoch(model, train_loader, epoch)`)."""
    known = facts.sampler_names() | facts.loader_names()
    for escape in facts.calls_passing_names():
        if not any(_is_loader_like(name, known) for name in escape.arguments):
            continue
        callee = escape.callee
        if callee is None:
            return True
        if facts.defines(callee) or callee in _BUILTINS and not facts.imports.aliases.get(callee):
            continue
        head, _, rest = callee.partition(".")
        qualified = f"{facts.imports.aliases.get(head, '')}.{rest}"
        if not qualified.startswith(_HARMLESS_PACKAGES):
            return True
    return False


def _is_loader_like(name: str, known: set[str]) -> bool:
    if name in known:
        return True
    last = name.rsplit(".", 1)[-1]
    if last[:1].isupper():
        return False  # a class such as `yaml.Loader` or `yaml.SafeLoader`, not a data loader
    return "loader" in last.lower() or "sampler" in last.lower()


def _only_loop_in_scope(sampler: SamplerCall, facts: LoaderFacts) -> EpochLoop | None:
    """The one outermost epoch loop that can see the sampler's name, if there is one."""
    receiver = sampler.receiver
    if receiver is None:
        return None
    where = sampler.where
    if receiver.split(".", 1)[0] == "self":
        loops = [
            loop
            for loop in facts.epoch_loops
            if where.class_def is not None and loop.where.class_def is where.class_def
        ]
    else:
        loops = [
            loop
            for loop in facts.epoch_loops
            if loop.where.function is where.function and loop.where.order > where.order
        ]
    outer = [loop for loop in loops if not loop.nested]
    return outer[0] if len(outer) == 1 else None


def _fix(sampler: SamplerCall, loop: EpochLoop | None, facts: LoaderFacts) -> NodeFix | None:
    if loop is None or loop.epoch_name is None or type(loop.node.body) is not cst.IndentedBlock:
        return None
    if not _always_a_sampler(sampler, loop, facts):
        return None
    call = f"{sampler.receiver}.set_epoch({loop.epoch_name})"
    body = loop.node.body
    new_body = body.with_changes(body=[cst.parse_statement(call + "\n"), *body.body])
    return NodeFix(f"Call `{call}` at the start of the epoch loop", ((body, new_body),))


def _always_a_sampler(sampler: SamplerCall, loop: EpochLoop, facts: LoaderFacts) -> bool:
    """Whether the receiver surely holds this sampler when the loop runs: bound once, to
    the sampler (or its loader) itself, under no `if` the loop is not also under. Else
    `train_sampler = DistributedSampler(ds) if distributed else None` would make the
    inserted call fail in single-process runs."""
    holder, value = sampler.target, sampler.call
    if holder is None and sampler.loader is not None:
        holder, value = sampler.loader.target, sampler.loader.call
    bound = facts.model.bindings.get(holder, []) if holder else []
    if len(bound) != 1 or bound[0] is not value:
        return False
    conditions = sampler.where.conditions
    outer = loop.where.conditions[: len(conditions)]
    return len(outer) == len(conditions) and all(a is b for a, b in zip(outer, conditions))


def _message(sampler: SamplerCall, loop: EpochLoop | None) -> str:
    receiver = sampler.receiver
    epoch = loop.epoch_name if loop is not None and loop.epoch_name else "epoch"
    if receiver is None:
        return (
            "`set_epoch` is never called on this DistributedSampler, so every epoch sees the "
            f"same order; keep it in a variable and call its `set_epoch({epoch})` at the start "
            "of each epoch"
        )
    return (
        f"`{receiver}.set_epoch({epoch})` is never called, so the DistributedSampler gives "
        "every epoch the same order; call it at the start of each epoch"
    )
