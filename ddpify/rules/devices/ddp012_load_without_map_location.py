from __future__ import annotations

from pathlib import Path

import libcst as cst

from ddpify.analysis.call_sites import calling_modules, owners_calling
from ddpify.analysis.devices import cuda_placement
from ddpify.analysis.names import find_arg, method_name
from ddpify.analysis.project import LocalFunctions
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix
from ddpify.rules.devices._common import DistributedRule, function_parameters
from ddpify.walk import walk

TORCH_LOAD = "torch.load"
CUDA_AVAILABLE = "torch.cuda.is_available"


def _with_cpu_map_location(call: cst.Call) -> cst.Call:
    """`torch.load(p)` -> `torch.load(p, map_location="cpu")`, keeping a trailing comma."""
    new_arg = cst.Arg(
        keyword=cst.Name("map_location"),
        value=cst.SimpleString('"cpu"'),
        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
    )
    *head, last = call.args
    if type(last.comma) is cst.Comma:
        new_arg = new_arg.with_changes(comma=last.comma)
    last = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(args=[*head, last, new_arg])


class LoadWithoutMapLocation(DistributedRule):
    """Every rank restores a checkpoint onto the device it was saved from."""

    CODE = "DDP012"
    NAME = "load-without-map-location"
    SEVERITY = Severity.WARNING
    MESSAGE = "`torch.load` without `map_location` restores every rank's tensors onto GPU 0"
    FIX = FixAvailability.ALWAYS

    def __init__(self, context) -> None:
        super().__init__(context)
        self.loads: list[tuple[cst.Call, bool]] = []
        self.mentions_cuda = False
        # Loads in a function that takes the caller's device: a helper module's candidates.
        self.helper_loads: list[tuple[cst.Call, cst.FunctionDef, str, bool]] = []
        # Other loads in a module-level function or class: (load, that function or class,
        # the function the load is in).
        self.module_level_loads: list[
            tuple[cst.Call, cst.FunctionDef | cst.ClassDef, cst.FunctionDef | None]
        ] = []

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        raw = node.raw_value
        self.mentions_cuda |= raw.startswith("cuda") or raw == "nccl"

    def visit_FormattedStringText(self, node: cst.FormattedStringText) -> None:
        self.mentions_cuda |= node.value.startswith("cuda")

    def visit_Call(self, node: cst.Call) -> None:
        if self.context.qualify(node.func) != TORCH_LOAD or not node.args:
            return
        if find_arg(node, "map_location", 1) is not None or any(a.star for a in node.args):
            return
        if self.context.rank_zero_scope() is not None:
            return  # global rank 0 usually saved the file from the same GPU index
        if self._other_branch_maps():
            return
        self.loads.append((node, self._feeds_load_state_dict()))
        if not self._note_helper_load(node):
            self._note_module_level_load(node)

    def _note_helper_load(self, node: cst.Call) -> bool:
        """`def pt_load(path, map_location=None): torch.load(path)`, or `def load(w, device):
        torch.load(w).to(device)`: the caller says where to restore and the load ignores it."""
        function = self.context.enclosing(cst.FunctionDef)
        if type(function) is not cst.FunctionDef:
            return False
        parameters = function_parameters(function)
        if "map_location" in parameters:
            self.helper_loads.append((node, function, "map_location", True))
            return True
        for device in sorted(parameters & _DEVICE_PARAMETERS):
            if _moves_to(function, device):
                self.helper_loads.append((node, function, device, False))
                return True
        return False

    def _note_module_level_load(self, node: cst.Call) -> None:
        """`def load_checkpoint(model, path): torch.load(path)`, or a method of a class
        (`ModelEma._load_checkpoint`): what runs it is a caller of that module-level
        function or class."""
        ancestors = self.context.ancestors
        owner = ancestors[1] if len(ancestors) > 1 else None
        if type(owner) in (cst.FunctionDef, cst.ClassDef):
            function = self.context.enclosing(cst.FunctionDef)
            self.module_level_loads.append((node, owner, function))  # type: ignore[arg-type]

    def _other_branch_maps(self) -> bool:
        """`if args.gpu is None: torch.load(p) else: torch.load(p, map_location=loc)`:
        the author chose where each kind of run restores to. Not the CUDA branch of
        `if torch.cuda.is_available():` (the other maps to the CPU only for lack of a
        GPU): there the unmapped load is the one every GPU rank runs."""
        ancestors = self.context.ancestors
        for parent, child in zip(reversed(ancestors[:-1]), reversed(ancestors[1:])):
            if type(parent) in (cst.FunctionDef, cst.ClassDef):
                return False
            if type(parent) is cst.If and child is parent.body and self._tests_cuda(parent):
                return False
            if type(parent) is cst.If and child is not parent.test:
                other = parent.orelse if child is parent.body else parent.body
                if other is not None and self._maps_location(other):
                    return True
        return False

    def _tests_cuda(self, node: cst.If) -> bool:
        test = node.test
        return type(test) is cst.Call and self.context.qualify(test.func) == CUDA_AVAILABLE

    def _maps_location(self, branch: cst.CSTNode) -> bool:
        found: list[bool] = []

        def visit(node: cst.CSTNode) -> None:
            if type(node) is cst.Call and self.context.qualify(node.func) == TORCH_LOAD:
                found.append(find_arg(node, "map_location", 1) is not None)

        walk(branch, visit, lambda node: None)
        return any(found)

    def _feeds_load_state_dict(self) -> bool:
        """`x.load_state_dict(torch.load(p))`: copied onto x's own device anyway."""
        ancestors = self.context.ancestors
        if len(ancestors) < 3:
            return False
        arg, call = ancestors[-2], ancestors[-3]
        return (
            type(arg) is cst.Arg
            and type(call) is cst.Call
            and method_name(call) == "load_state_dict"
        )

    def leave_Module(self, node: cst.Module) -> None:
        framework = self.model.framework
        reported_here = bool(self.is_distributed() or framework) and self._uses_cuda()
        if not self.is_distributed() and framework is None and self.helper_loads:
            self._report_helper_loads()
        if not reported_here and framework is None and self.module_level_loads:
            # A helper module (perhaps with distributed helpers of its own, but no GPU
            # in sight): its callers decide.
            self._report_called_loads()
        if not reported_here:
            return
        for call, into_state_dict in self.loads:
            shown = self.context.code(call)
            if len(shown) > 50 or "\n" in shown:
                shown = "torch.load(...)"
            fix = NodeFix(
                'Add `map_location="cpu"`',
                ((call, _with_cpu_map_location(call)),),
                Applicability.SAFE if into_state_dict else Applicability.UNSAFE,
            )
            if self.is_distributed():
                self.report(
                    call,
                    f"`{shown}` has no `map_location`, so every rank restores the tensors onto "
                    'the GPU that saved them, usually GPU 0; pass `map_location="cpu"`',
                    fix=fix,
                )
                continue
            # A framework's launcher starts one process per GPU, but the script may as well
            # run as one process: the framework leaves `torch.load` as it is either way.
            self.report(
                call,
                f"`{shown}` has no `map_location`: when {framework} runs this script as one "
                "process per GPU, every process restores the tensors onto the GPU that saved "
                'them, usually GPU 0; pass `map_location="cpu"`',
                severity=Severity.INFO,
                fix=fix,
            )

    def _report_helper_loads(self) -> None:
        """In a helper module (not distributed itself) that a distributed module of the
        project imports: a load that drops the device its caller asked for runs on every
        rank that calls it, restoring onto the GPU that saved the checkpoint."""
        importers = self.context.distributed_importers()
        if not importers:
            return
        user = importers[0].name
        for call, function, parameter, dropped in self.helper_loads:
            name = function.name.value
            if dropped:
                message = (
                    f"`{name}()` takes `map_location` but its `torch.load` ignores it, so every "
                    f"rank that calls it ({user} runs distributed) restores the tensors onto "
                    "the GPU that saved them; pass `map_location=map_location`"
                )
            else:
                message = (
                    f"`torch.load` in `{name}()` has no `map_location`, so every rank that calls "
                    f"it ({user} runs distributed) first restores the tensors onto the GPU that "
                    f"saved them, then moves them to `{parameter}`; pass "
                    f"`map_location={parameter}`"
                )
            self.report(call, message)

    def _report_called_loads(self) -> None:
        """In a helper module (not distributed itself): a load in a function or class that
        a distributed module of the project calls runs on every rank that calls it. Info:
        the checkpoint may have been saved from the CPU, or only a single-process path of
        that module may reach the load."""
        importers = self.context.distributed_importers()
        helper = self.context.local.file
        if helper is None:
            return
        callers: dict[str, str | None] = {}  # a name -> who runs it distributed, in words
        for call, owner, function in self.module_level_loads:
            name = owner.name.value
            if name not in callers:
                callers[name] = _distributed_caller(name, helper, importers, self.context.local)
            if callers[name] is None:
                continue
            where = f"`{name}()`" if type(owner) is cst.FunctionDef else f"`{name}`"
            if type(owner) is cst.ClassDef and type(function) is cst.FunctionDef:
                where = f"`{name}.{function.name.value}()`"
            self.report(
                call,
                f"`torch.load` in {where} has no `map_location`, and {callers[name]}, so every "
                "rank restores the tensors onto the GPU that saved them, usually GPU 0; pass "
                '`map_location="cpu"`',
                severity=Severity.INFO,
            )

    def _uses_cuda(self) -> bool:
        model = self.model
        if (
            self.mentions_cuda
            or bool(model.method_calls.get("cuda"))
            or any(name.startswith("torch.cuda.") for name in model.calls)
        ):
            return True
        # `DDP(model, device_ids=[LOCAL_RANK])`, `.to(local_rank)`: on a GPU with no "cuda"
        # written (the device comes from another module).
        tree = self.context.tree
        return cuda_placement(tree.nodes, tree.qualify, tree.parent) is not None


# Parameter names that carry the device a caller wants the checkpoint on.
_DEVICE_PARAMETERS = frozenset({"device", "map_location", "target_device", "dev"})


def _moves_to(function: cst.FunctionDef, device: str) -> bool:
    """Whether `function` calls `.to(device)` or `.cuda(device)` on something."""
    found: list[bool] = []

    def visit(node: cst.CSTNode) -> None:
        if (
            type(node) is cst.Call
            and method_name(node) in {"to", "cuda"}
            and node.args
            and type(node.args[0].value) is cst.Name
            and node.args[0].value.value == device
        ):
            found.append(True)

    walk(function, visit, lambda node: None)
    return bool(found)


def _distributed_caller(
    name: str, helper: Path, importers: list[Path], local: LocalFunctions
) -> str | None:
    """Who runs `name` on every rank: a distributed module that calls it, or (two
    imports away) one that calls a function or class of another module that calls it
    (`trainer.Launcher(...)` in ddp_train.py, and `Launcher` makes a `CheckPoint`)."""
    found = calling_modules(name, helper, importers)
    if found:
        return f"{found[0].name} (distributed) uses `{name}`"
    for middle in local.importers_of(helper):
        for owner in owners_calling(name, helper, middle):
            outer = calling_modules(owner, middle, local.distributed_importers_of(middle))
            if outer:
                return (
                    f"{outer[0].name} (distributed) uses `{owner}` of {middle.name}, "
                    f"which uses `{name}`"
                )
    return None
