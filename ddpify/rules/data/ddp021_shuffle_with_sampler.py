import enum

import libcst as cst

from ddpify.analysis.loaders import LOADER_PARAMETERS, LoaderCall, LoaderFacts
from ddpify.analysis.names import dotted
from ddpify.arguments import drop_arg
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.data._common import LoaderRule, comments, is_none, is_true_literal


class _Kind(enum.Enum):
    """What the sampler argument is, as far as the file shows."""

    SHUFFLING = "a DistributedSampler that shuffles"
    ORDERED = "a DistributedSampler built with shuffle=False"
    OTHER = "another sampler, or one we cannot see"


class ShuffleWithSampler(LoaderRule):
    """`DataLoader(shuffle=True, sampler=...)`: the two are mutually exclusive."""

    CODE = "DDP021"
    NAME = "shuffle-with-sampler"
    SEVERITY = Severity.ERROR
    MESSAGE = "`shuffle=True` with a sampler makes DataLoader raise ValueError; drop `shuffle=True`"
    FIX = FixAvailability.SOMETIMES

    def leave_Module(self, node: cst.Module) -> None:
        facts = self.facts
        for loader in facts.loaders:
            shuffle = loader.arg("shuffle")
            if shuffle is None or not is_true_literal(shuffle.value):
                continue
            for key in ("sampler", "batch_sampler"):
                arg = loader.arg(key)
                sources = _sources(arg.value, facts) if arg is not None else []
                if all(is_none(source) for source in sources):
                    continue  # no argument, or one that is only ever None
                kind = _kind(sources, facts) if key == "sampler" else _Kind.OTHER
                self.report(
                    shuffle,
                    _message(key, self.context.code(arg.value), kind),
                    severity=_severity(arg.value, loader),
                    fix=self._fix(loader, shuffle, kind),
                )
                break

    def _fix(self, loader: LoaderCall, shuffle: cst.Arg, kind: _Kind) -> NodeFix | None:
        if kind is _Kind.ORDERED:
            return None  # the script asks for both orders; a person has to choose
        new_call = drop_arg(loader.call, shuffle, LOADER_PARAMETERS)
        if new_call is None:
            return None  # the arguments after it cannot be given by keyword
        keeps_comments = comments(new_call) == comments(loader.call)
        safe = kind is _Kind.SHUFFLING and keeps_comments
        return NodeFix(
            "Drop `shuffle=True`",
            ((loader.call, new_call),),
            Applicability.SAFE if safe else Applicability.UNSAFE,
        )


def _sources(value: cst.BaseExpression, facts: LoaderFacts) -> list[cst.BaseExpression]:
    """What a sampler argument may evaluate to: both branches of `a if c else b`, and for
    a name, every value the file assigns to it."""
    pending, found, seen = [value], [], set()
    while pending:
        expr = pending.pop()
        if type(expr) is cst.IfExp:
            pending += [expr.body, expr.orelse]
            continue
        name = dotted(expr)
        bound = facts.model.bindings.get(name, []) if name else []
        if bound and name not in seen:
            seen.add(name)
            pending += bound
            continue
        found.append(expr)
    return found


def _kind(sources: list[cst.BaseExpression], facts: LoaderFacts) -> _Kind:
    samplers = {sampler.call: sampler for sampler in facts.samplers}
    kinds = set()
    for source in sources:
        if is_none(source):
            continue
        sampler = samplers.get(source) if type(source) is cst.Call else None
        shuffles = sampler.shuffles if sampler is not None else None
        if shuffles is None:  # not a DistributedSampler, or its shuffle is computed
            return _Kind.OTHER
        kinds.add(_Kind.SHUFFLING if shuffles else _Kind.ORDERED)
    return _Kind.ORDERED if _Kind.ORDERED in kinds else _Kind.SHUFFLING


def _severity(value: cst.BaseExpression, loader: LoaderCall) -> Severity:
    """INFO for a helper's `sampler=None` parameter: it raises only if a caller passes one."""
    function = loader.where.function
    if function is None or type(value) is not cst.Name:
        return Severity.ERROR
    for param in function.params.params + function.params.kwonly_params:
        if param.name.value == value.value and param.default is not None:
            return Severity.INFO if is_none(param.default) else Severity.ERROR
    return Severity.ERROR


def _message(key: str, value: str, kind: _Kind) -> str:
    given = f"`{key}={value}`" if len(value) <= 40 and "\n" not in value else f"`{key}=...`"
    head = f"`shuffle=True` together with {given} makes DataLoader raise ValueError"
    if kind is _Kind.SHUFFLING:
        return f"{head}; drop `shuffle=True` (DistributedSampler shuffles by default)"
    if kind is _Kind.ORDERED:
        return (
            f"{head}; drop `shuffle=True`, or build the sampler with `shuffle=True` "
            "if the data should be shuffled"
        )
    return f"{head}; drop `shuffle=True` and let the sampler decide the order"
