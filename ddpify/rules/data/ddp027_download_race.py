"""DDP027: every rank downloads the same dataset into the same place at once."""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted, find_arg
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.rank_zero._common import non_zero_guarded
from ddpify.walk import walk

BARRIER = "torch.distributed.barrier"
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")
# `with torch_distributed_zero_first(rank):`, `with main_process_first():`: rank 0 goes first.
_FIRST_CONTEXT = re.compile(r"(zero|main|master|primary|rank_?0|leader)\w*first", re.I)


@dataclass(frozen=True)
class _Download:
    arg: cst.Arg  # the `download=True` argument
    function: cst.FunctionDef | None  # the function it runs in
    guarded: bool  # under a rank-0 guard or a "rank 0 first" context


class DownloadRace(Rule):
    """`download=True` on every rank: N writers to one dataset directory."""

    CODE = "DDP027"
    NAME = "download-race"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`download=True` runs on every rank, so all of them write the same files at once; "
        "download on rank 0, then `dist.barrier()`"
    )

    def __init__(self, context) -> None:
        super().__init__(context)
        self.downloads: list[_Download] = []
        self.ordered = False  # a barrier that only the other ranks reach: rank 0 goes first

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "barrier":
            if self.context.qualify(func) == BARRIER:
                self.ordered |= non_zero_guarded(self.context.ancestors)
            return
        if not any(
            arg.keyword is not None and arg.keyword.value == "download" for arg in node.args
        ):
            return
        download = find_arg(node, "download")
        if download is not None and _is_true(download.value):
            ancestors = self.context.ancestors
            guarded = rank_zero_scope(ancestors) is not None or _rank_zero_first(ancestors)
            function = self.context.enclosing(cst.FunctionDef)
            self.downloads.append(_Download(download, function, guarded))

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not model.is_distributed or self.ordered:
            return
        if any(d.guarded for d in self.downloads) and model.calls_any(BARRIER):
            return  # rank 0 downloads, a barrier, then everyone opens the files
        candidates = [d for d in self.downloads if not d.guarded and self._every_rank(d)]
        if not candidates:
            return
        guarded_functions = _called_on_rank_zero_only(node, {d.function for d in candidates})
        for download in candidates:
            if download.function not in guarded_functions:
                self.report(download.arg)

    def _every_rank(self, download: _Download) -> bool:
        """Whether the call runs in every process. With mp.spawn, the parent's code (module
        level, `main()`) runs once: only the spawned worker function runs on every rank."""
        spawns = self.context.model.calls_to(*SPAWN)
        if not spawns:
            return True
        if download.function is None:
            return False
        targets = {dotted(call.args[0].value) for call in spawns if call.args}
        return download.function.name.value in targets


def _is_true(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "True"


def _last(expr: cst.BaseExpression) -> str | None:
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name else None


def _rank_zero_first(ancestors) -> bool:
    for node in ancestors:
        if isinstance(node, cst.With):
            for item in node.items:
                call = item.item
                target = call.func if isinstance(call, cst.Call) else call
                if _FIRST_CONTEXT.search(_last(target) or ""):
                    return True
    return False


def _called_on_rank_zero_only(
    module: cst.Module, functions: set[cst.FunctionDef | None]
) -> set[cst.FunctionDef]:
    """Those of `functions` whose every call in the file sits under a rank-0 guard
    (`if rank == 0: prepare_data()`); one extra walk, only for files with a download."""
    by_name = {f.name.value: f for f in functions if f is not None}
    if not by_name:
        return set()
    sites: dict[str, list[bool]] = {name: [] for name in by_name}
    ancestors: list[cst.CSTNode] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        if isinstance(node, cst.Call):
            name = _last(node.func)
            if name in sites:
                sites[name].append(rank_zero_scope(ancestors) is not None)

    walk(module, enter, lambda node: ancestors.pop())
    return {by_name[name] for name, guards in sites.items() if guards and all(guards)}
