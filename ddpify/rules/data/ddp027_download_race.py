"""DDP027: every rank downloads the same dataset into the same place at once."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.downloads import download_argument, downloads_on_any_rank, rank_zero_first
from ddpify.analysis.guards import rank_zero_scope
from ddpify.analysis.names import dotted
from ddpify.analysis.project import LocalClass
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.rank_zero._common import non_zero_guarded
from ddpify.walk import walk

BARRIER = "torch.distributed.barrier"
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")


@dataclass(frozen=True)
class _Download:
    node: cst.CSTNode  # the `download=True` argument, or the call of a helper that downloads
    function: cst.FunctionDef | None  # the function it runs in
    guarded: bool  # under a rank-0 guard or a "rank 0 first" context
    helper: str | None = None  # `get_cifar10 (defined in data/cifar.py)`
    index: int = 0  # the order of the call in the file


@dataclass(frozen=True)
class _Barrier:
    function: cst.FunctionDef | None
    index: int
    others_wait: bool  # `if rank != 0: dist.barrier()`: the other ranks wait for rank 0


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
        self.barriers: list[_Barrier] = []
        self.index = 0
        self.calls: list[tuple[cst.Call, _Download]] = []  # may call a downloading helper

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        self.index += 1
        if type(func) is cst.Attribute and func.attr.value == "barrier":
            if self.context.qualify(func) == BARRIER:
                ancestors = self.context.ancestors
                function = self.context.enclosing(cst.FunctionDef)
                others_wait = non_zero_guarded(ancestors)
                if others_wait or rank_zero_scope(ancestors) is not None:
                    self.barriers.append(_Barrier(function, self.index, others_wait))  # type: ignore[arg-type]
            return
        download = download_argument(node)
        if download is not None:
            self.downloads.append(self._download(download))
        elif self._may_be_local(func):
            self.calls.append((node, self._download(node)))

    def _may_be_local(self, func: cst.BaseExpression) -> bool:
        """An imported name that is not torch's: it may name a helper of a local module."""
        if type(func) is cst.Subscript:  # exact type: see ddpify.walk.is_kind
            func = func.value
        qualified = self.context.imports.qualify_local(func)
        return qualified is not None and not qualified.startswith("torch")

    def _download(self, node: cst.CSTNode, helper: str | None = None) -> _Download:
        ancestors = self.context.ancestors
        guarded = rank_zero_scope(ancestors) is not None or rank_zero_first(ancestors)
        function = self.context.enclosing(cst.FunctionDef)
        return _Download(node, function, guarded, helper, self.index)  # type: ignore[arg-type]

    def _helper_downloads(self) -> list[_Download]:
        """Calls of helpers of local modules that download on whatever rank calls them: a
        dataset getter, a dataset class whose methods download, a table of getters
        (`DATASET_GETTERS[args.dataset](args, root)`). Looked up only now, when the file
        is known to be distributed and unordered."""
        found = []
        for call, where in self.calls:
            if not self._racy(where):
                continue
            helper = self._downloading_helper(call.func)
            if helper is not None:
                found.append(_Download(call, where.function, where.guarded, helper, where.index))
        return found

    def _downloading_helper(self, func: cst.BaseExpression) -> str | None:
        if type(func) is cst.Subscript:
            for function in self.context.local_table_functions(func.value):
                if downloads_on_any_rank(function.node):
                    table = self.context.code(func.value)
                    name = function.node.name.value
                    return (
                        f"`{table}[...]` may call `{name}` (defined in {function.path.name}), which"
                    )
            return None
        callee = self.context.local_callee(func)
        if isinstance(callee, LocalClass):
            if any(downloads_on_any_rank(method) for method in callee.methods()):
                return f"`{callee.node.name.value}` (defined in {callee.path.name}), which"
        elif callee is not None and downloads_on_any_rank(callee.node):
            return f"`{callee.node.name.value}()` (defined in {callee.path.name}), which"
        return None

    def leave_Module(self, node: cst.Module) -> None:
        model = self.context.model
        if model.framework is not None or not model.is_distributed:
            return
        if any(d.guarded for d in self.downloads) and model.calls_any(BARRIER):
            return  # rank 0 downloads, a barrier, then everyone opens the files
        candidates = [d for d in self.downloads if self._racy(d)]
        candidates += self._helper_downloads()
        if not candidates:
            return
        guarded_functions = _called_on_rank_zero_only(node, {d.function for d in candidates})
        for download in candidates:
            if download.function in guarded_functions:
                continue
            if download.helper is None:
                self.report(download.node)
            else:
                self.report(download.node, _helper_message(download.helper))

    def _racy(self, download: _Download) -> bool:
        return not download.guarded and not self._ordered(download) and self._every_rank(download)

    def _ordered(self, download: _Download) -> bool:
        """Rank 0 goes first: `if rank != 0: dist.barrier()` before the download (and no
        rank-0 barrier, which releases the others, in between), in the same function; or
        such a barrier in another function (a "rank 0 first" helper we cannot place)."""
        opened = False
        for barrier in self.barriers:
            if barrier.others_wait and barrier.function is not download.function:
                return True
            if barrier.function is not download.function or barrier.index > download.index:
                continue
            opened = barrier.others_wait
        return opened

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


def _last(expr: cst.BaseExpression) -> str | None:
    name = dotted(expr)
    return name.rsplit(".", 1)[-1] if name else None


def _helper_message(helper: str) -> str:
    return (
        f"{helper} downloads with `download=True`, runs on every rank here, so all of them "
        "write the same files at once; call it on rank 0 first (the other ranks wait at "
        "`dist.barrier()`)"
    )


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
        if type(node) is cst.Call:
            name = _last(node.func)
            if name in sites:
                sites[name].append(rank_zero_scope(ancestors) is not None)

    walk(module, enter, lambda node: ancestors.pop())
    return {by_name[name] for name, guards in sites.items() if guards and all(guards)}
