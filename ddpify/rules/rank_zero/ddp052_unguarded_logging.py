from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.guards import Scope, rank_zero_scope
from ddpify.analysis.names import dotted
from ddpify.analysis.side_effects import STDOUT_WRITES
from ddpify.diagnostics import Severity
from ddpify.rules.rank_zero._common import (
    Ancestors,
    RankZeroRule,
    keyword_arg,
    last_name,
    mentions_rank,
    non_zero_guarded,
    statement_of,
)

PRINTS = {"rich.print", "builtins.print"}
LOG_LEVELS = {"info", "debug"}
PROGRESS_BARS = {
    f"tqdm.{module}{bar}"
    for module in ("", "auto.", "std.", "notebook.", "rich.")
    for bar in ("tqdm", "trange")
}
WRITERS = {
    "torch.utils.tensorboard.SummaryWriter",
    "torch.utils.tensorboard.writer.SummaryWriter",
    "tensorboardX.SummaryWriter",
}
LOG_CONFIG = {"logging.basicConfig", "logging.disable"}
# Helpers (torchvision's references, DETR, MAE...) that silence `print` off rank 0.
PRINT_SILENCERS = {"setup_for_distributed", "init_distributed_mode", "suppress_output"}

PRINT, LOGGER, BAR, WRITER, RUN, RUN_LOG = "print", "logger", "bar", "writer", "run", "log"
TRACKERS = (WRITER, RUN, RUN_LOG)  # files and runs, not just console lines: warnings


@dataclass(frozen=True)
class _Kind:
    effect: str  # what happens on every rank
    advice: str
    per_node: str = ""  # what a local-rank guard still leaves (trackers only)


KINDS = {
    PRINT: _Kind(
        "prints the same line once per rank",
        "print under a rank-0 guard, or include the rank in the message",
    ),
    LOGGER: _Kind(
        "logs the same record once per rank",
        "log under a rank-0 guard, or raise the level on the other ranks",
    ),
    BAR: _Kind("draws one progress bar per rank", "pass `disable=dist.get_rank() != 0`"),
    WRITER: _Kind(
        "writes one event file per rank", "create it only on rank 0", "its own event file"
    ),
    RUN: _Kind("starts one run per rank", "call it only on rank 0", "its own run"),
    RUN_LOG: _Kind(
        "logs the same metrics from every rank",
        "call it only on rank 0",
        "its own log calls",
    ),
}


@dataclass(frozen=True)
class _Output:
    call: cst.Call
    kind: str
    ancestors: Ancestors


class UnguardedLogging(RankZeroRule):
    """Console and experiment-tracker output from every rank."""

    CODE = "DDP052"
    NAME = "unguarded-logging"
    SEVERITY = Severity.INFO
    MESSAGE = "`print` prints the same line once per rank; print under a rank-0 guard"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.outputs: list[_Output] = []
        self.per_rank_logging = False  # the log level or handlers depend on the rank
        self.per_rank_print = False  # `print` replaced or stdout redirected off rank 0
        self.per_rank_wandb = False  # `wandb.init(mode="disabled" if rank ...)`

    def on_call(self, node: cst.Call, qualified: str | None) -> None:
        self._note_configuration(node, qualified)
        kind = self._kind(node, qualified)
        if kind is None or self._deliberately_per_rank(node, kind):
            return
        self.outputs.append(_Output(node, kind, self.snapshot()))

    def visit_Assign(self, node: cst.Assign) -> None:
        super().visit_Assign(node)
        for target in node.targets:
            name = dotted(target.target)
            if name in {"builtins.print", "__builtin__.print"}:
                self.per_rank_print = True
            elif name == "sys.stdout" and self._rank_dependent():
                self.per_rank_print = True

    def _note_configuration(self, node: cst.Call, qualified: str | None) -> None:
        method = last_name(node.func)
        if method in PRINT_SILENCERS:
            self.per_rank_print = True
        configures = qualified in LOG_CONFIG or method in {"setLevel", "remove", "disable"}
        if configures and (mentions_rank(node) or self._rank_dependent()):
            self.per_rank_logging = True
        if qualified == "wandb.init" and any(
            arg.keyword is not None and mentions_rank(arg.value) for arg in node.args
        ):
            self.per_rank_wandb = True

    def _rank_dependent(self) -> bool:
        ancestors = self.context.ancestors
        return rank_zero_scope(ancestors) is not None or non_zero_guarded(ancestors)

    def _kind(self, node: cst.Call, qualified: str | None) -> str | None:
        if qualified is None and type(node.func) is cst.Name and node.func.value == "print":
            return PRINT
        if qualified in PRINTS or qualified in STDOUT_WRITES:
            return PRINT
        if qualified in PROGRESS_BARS:
            return BAR
        if qualified in WRITERS:
            return WRITER
        if qualified == "wandb.init":
            return RUN
        if qualified == "wandb.log":
            return RUN_LOG
        if self._is_log_call(node, qualified):
            return LOGGER
        return None

    def _is_log_call(self, node: cst.Call, qualified: str | None) -> bool:
        func = node.func
        if type(func) is not cst.Attribute or func.attr.value not in LOG_LEVELS:
            return False
        if qualified is not None:
            return qualified.startswith(("logging.", "loguru.logger."))
        receiver = func.value
        if type(receiver) is cst.Call:  # `logging.getLogger(__name__).info(...)`
            return self.context.qualify(receiver.func) == "logging.getLogger"
        name = dotted(receiver)
        return name is not None and name in self.context.model.names_bound_to("logging.getLogger")

    @staticmethod
    def _deliberately_per_rank(node: cst.Call, kind: str) -> bool:
        if kind in (PRINT, LOGGER):
            return any(mentions_rank(arg.value) for arg in node.args if arg.keyword is None)
        if kind == BAR:
            disable = keyword_arg(node, "disable")
            return disable is not None and mentions_rank(disable.value)
        if kind in (RUN, RUN_LOG):
            return any(arg.keyword is not None and mentions_rank(arg.value) for arg in node.args)
        return False

    def leave_Module(self, node: cst.Module) -> None:
        if (
            not self.outputs
            or self.delegates_to_framework()
            or not self.context.model.is_distributed
        ):
            return
        statements: set[int] = set()
        loggers = self.context.model.names_bound_to("logging.getLogger")
        for output in self.outputs:
            if output.kind == LOGGER and not self._is_logger(output.call, loggers):
                continue
            if self._configured_per_rank(output):
                continue
            resolution = self.facts.resolve(output.ancestors)
            if not resolution.known or resolution.scope is Scope.GLOBAL:
                continue
            if resolution.scope is Scope.LOCAL and output.kind not in TRACKERS:
                continue  # one copy per node is a fair price for console output
            statement = id(statement_of(output.ancestors))
            if statement in statements:
                continue
            statements.add(statement)
            self._report(output, resolution.scope)

    def _is_logger(self, call: cst.Call, loggers: set[str]) -> bool:
        receiver = call.func.value  # type: ignore[attr-defined]
        return (
            type(receiver) is cst.Call
            or self.context.qualify(call.func) is not None
            or (dotted(receiver) in loggers)
        )

    def _configured_per_rank(self, output: _Output) -> bool:
        if output.kind == PRINT:
            return self.per_rank_print
        if output.kind == LOGGER:
            return self.per_rank_logging
        if output.kind in (RUN, RUN_LOG):
            return self.per_rank_wandb
        return False

    def _report(self, output: _Output, scope: Scope | None) -> None:
        shown = self.context.code(output.call.func)
        kind = KINDS[output.kind]
        if scope is Scope.LOCAL:
            message = (
                f"`{shown}` is guarded by a local rank, so every node keeps {kind.per_node}; "
                "guard it with the global rank (`dist.get_rank() == 0`)"
            )
            self.report(output.call, message, severity=Severity.INFO)
            return
        severity = Severity.WARNING if output.kind in TRACKERS else Severity.INFO
        self.report(output.call, f"`{shown}` {kind.effect}; {kind.advice}", severity=severity)
