"""DDP023: a DistributedSampler seeded differently on each rank.

In this file, or, for a loader factory seeded from its parameter (`seed=flags.seed` in
`def get_data_loaders(flags, ...)`), in the modules that call it: what they assign to
`flags.seed` before the call."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.call_sites import (
    ParameterUse,
    PerProcessValue,
    parameter_use,
    per_process_values,
)
from ddpify.analysis.loaders import (
    DISTRIBUTED_SAMPLER,
    project_samplers,
    sampler_seed,
    seed_arguments,
)
from ddpify.analysis.values import mentions_world_size, per_process_source
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix, Rule


class DivergentSamplerSeed(Rule):
    """`DistributedSampler(ds, seed=args.seed + rank)`: every rank shuffles differently."""

    CODE = "DDP023"
    NAME = "divergent-sampler-seed"
    SEVERITY = Severity.ERROR
    MESSAGE = (
        "the DistributedSampler's seed differs between ranks, so their shards overlap and "
        "some samples are never seen; use the same seed on every rank"
    )
    FIX = FixAvailability.SOMETIMES

    def leave_Module(self, node: cst.Module) -> None:
        if self.context.model.framework is not None:
            return
        model = self.context.model
        for call in model.calls_to(DISTRIBUTED_SAMPLER):
            seed = sampler_seed(call)
            if seed is None or seed.star:
                continue
            source = per_process_source(seed.value, model.imports, model.bindings)
            if source is not None:
                self.report(
                    seed,
                    _message(self.context.code(seed.value), source),
                    fix=self._fix(seed),
                )
            else:
                self._check_callers(call, seed)
        self._check_project_samplers()

    def _check_callers(self, call: cst.Call, seed: cst.Arg) -> None:
        """`seed=flags.seed` in a function of this module that takes `flags`: the seed is
        what the callers, in the modules importing this one, put there. Reported when one
        of them assigns it a per-rank value before the call (`flags.seed = worker_seed`,
        `worker_seed = worker_seeds[local_rank]`); silent when they assign nothing."""
        model = self.context.model
        use = parameter_use(self.context.module, call, seed.value)
        if use is None or self.context.local.file is None:
            return
        written = f"{use.parameter}.{use.attribute}" if use.attribute else use.parameter
        if model.bindings.get(written) or model.bindings.get(use.parameter):
            return  # this module sets it itself somewhere: which value reaches here is unclear
        importers = self.context.importing_modules()
        found = next(per_process_values(use, self.context.local.file, importers), None)
        if found is not None:
            self.report(
                seed,
                _caller_message(self.context.code(seed.value), use, found),
                severity=Severity.WARNING,  # read through a call site in another module
            )

    def _check_project_samplers(self) -> None:
        """A sampler class of the project's own that is told the world size (so it splits
        the data between the ranks) and seeded per rank: `BucketingSampler(n, batch *
        world_size, epochs, rng)` with `rng = np.random.default_rng(seed + local_rank)`.
        Every rank then orders the data its own way before taking its share."""
        model = self.context.model
        for call in project_samplers(model):
            if not any(mentions_world_size(arg.value) for arg in call.args):
                continue  # a sampler that does not split the data may well differ per rank
            for seed in seed_arguments(call):
                source = per_process_source(seed.value, model.imports, model.bindings)
                if source is not None:
                    self.report(
                        seed,
                        _project_message(
                            self.context.code(call.func),
                            seed,
                            source,
                            self.context.code(seed.value),
                        ),
                        severity=Severity.WARNING,  # what the sampler does is inferred
                    )
                    break

    def _fix(self, seed: cst.Arg) -> NodeFix | None:
        """Keep the part of the seed that every rank shares (`args.seed` of `args.seed +
        rank`); a seed made only of the rank or the clock becomes the default, 0."""
        model = self.context.model
        value = seed.value
        if type(value) is cst.BinaryOperation and type(value.operator) is cst.Add:
            shared = [
                side
                for side in (value.left, value.right)
                if per_process_source(side, model.imports, model.bindings) is None
            ]
            if len(shared) != 1:
                return None
            new_value: cst.BaseExpression = shared[0]
        elif type(value) in (cst.Name, cst.Attribute):
            return None  # the name may feed other seeds too: a person decides
        else:
            new_value = cst.Integer("0")
        new_value = new_value.with_changes(lpar=(), rpar=()) if _bare(new_value) else new_value
        shown = self.context.code(new_value)
        return NodeFix(
            f"Use `{shown}` as the seed on every rank",
            ((seed, seed.with_changes(value=new_value)),),
            Applicability.SAFE,
        )


def _bare(expr: cst.BaseExpression) -> bool:
    return type(expr) in (cst.Name, cst.Attribute, cst.Integer)


def _project_message(sampler: str, seed: cst.Arg, source: str, shown: str) -> str:
    what = f"`{seed.keyword.value}={shown}`" if seed.keyword is not None else f"`{shown}`"
    return (
        f"{what}, which seeds `{sampler}`, depends on {source}, while the sampler splits the "
        "data between the ranks: each rank orders the data its own way before taking its "
        "share, so the shares overlap and some samples are never seen; seed it alike on "
        "every rank"
    )


def _caller_message(seed: str, use: ParameterUse, found: PerProcessValue) -> str:
    function = use.function.name.value
    if use.attribute is not None:
        passed = f"sets `{found.shown}` before calling it"
    else:
        passed = f"passes `{found.shown}`"
    return (
        f"`seed={seed}` comes from the callers of `{function}()`: {found.path.name} {passed}, "
        f"which depends on {found.source}, so each rank shuffles with its own permutation: "
        "the shards overlap and some samples are never seen; give the sampler a seed "
        "shared by every rank"
    )


def _message(seed: str, source: str) -> str:
    return (
        f"`seed={seed}` depends on {source}, so each rank shuffles with its own permutation: "
        "the shards overlap and some samples are never seen; give every rank the same seed"
    )
