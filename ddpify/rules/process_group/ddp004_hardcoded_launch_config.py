from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import dotted, find_arg
from ddpify.diagnostics import Severity
from ddpify.rules.base import Rule
from ddpify.rules.process_group._common import (
    INIT_PROCESS_GROUP,
    MASTER_ENV,
    MP_SPAWN,
    TORCHRUN_ENV,
    EnvReads,
    callee_name,
    contains,
    environ_call_key,
    environ_subscript_key,
    is_assign_target,
    string_prefix,
    string_value,
)

DEVICE_COUNT = "torch.cuda.device_count"
_INTERESTING_CALLEES = {"spawn", "start_processes", "update", "putenv", "init_process_group"}
_TORCHRUN_FLAG = {"MASTER_ADDR": "--master-addr", "MASTER_PORT": "--master-port"}


@dataclass
class _Finding:
    node: cst.CSTNode
    warning: str  # the message when the script is also launched by torchrun
    info: str | None  # the message for a self-contained launcher (None: stay silent)
    conditional: bool = False  # under a test of the environment: a deliberate fallback
    literal: bool = True  # a constant, not a value computed at run time


class HardcodedLaunchConfig(Rule):
    """Launch settings written into the script fight the ones torchrun provides."""

    CODE = "DDP004"
    NAME = "hardcoded-launch-config"
    SEVERITY = Severity.WARNING
    MESSAGE = "launch configuration is hard-coded; let torchrun provide it through env://"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.env = EnvReads()
        self.findings: list[_Finding] = []
        self.spawns: list[tuple[cst.Call, bool]] = []
        # init_process_group calls in the branch taken when torchrun's variables are absent
        self.fallback_inits: set[int] = set()

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self.env.observe_comparison(node, self.context.imports)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        ancestors = self.context.ancestors
        self.env.observe_subscript(node, ancestors, self.context.imports)
        key = environ_subscript_key(node, self.context.imports)
        if key in MASTER_ENV and is_assign_target(node, ancestors):
            assign = ancestors[-3] if len(ancestors) > 2 else None
            value = assign.value if type(assign) is cst.Assign else None
            if value is None or not self._reads_key(value, key):
                self._master_write(node, key)

    def visit_Call(self, node: cst.Call) -> None:
        self.env.observe_call(node, self.context.imports)
        callee = callee_name(node.func)
        if callee not in _INTERESTING_CALLEES:
            return
        name = self.context.qualify(node.func)
        if name in MP_SPAWN:
            self.spawns.append((node, self._under_env_test()))
        elif name == INIT_PROCESS_GROUP and self._under_env_test():
            self.fallback_inits.add(id(node))
        elif name == "os.environ.update":
            self._environ_update(node)
        elif name == "os.putenv" and node.args:
            key = string_value(node.args[0].value)
            if key in MASTER_ENV:
                self._master_write(node, key)

    def _environ_update(self, call: cst.Call) -> None:
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in MASTER_ENV:
                self._master_write(arg, arg.keyword.value)
            elif type(arg.value) is cst.Dict:
                for element in arg.value.elements:
                    if type(element) is not cst.DictElement:
                        continue
                    key = string_value(element.key)
                    if key in MASTER_ENV:
                        self._master_write(element, key)

    def _master_write(self, node: cst.CSTNode, key: str) -> None:
        warning = (
            f"writing `{key}` into `os.environ` overrides the one torchrun sets; remove it and "
            f"pass `{_TORCHRUN_FLAG[key]}` to torchrun instead"
        )
        info = (
            f"`{key}` is hard-coded into `os.environ`, which clashes with torchrun; "
            f'`os.environ.setdefault("{key}", ...)` keeps both launchers working'
        )
        self.findings.append(_Finding(node, warning, info, self._under_env_test()))

    def _under_env_test(self) -> bool:
        """Inside `if "RANK" not in os.environ:` and the like: a deliberate fallback."""
        ancestors = self.context.ancestors
        for parent, child in zip(ancestors, ancestors[1:]):
            if type(parent) in (cst.If, cst.IfExp) and child is not parent.test:
                if self._reads_env(parent.test):
                    return True
        return False

    def _reads_key(self, expr: cst.CSTNode, key: str) -> bool:
        """`os.environ.get(KEY, default)`: writing it back changes nothing torchrun set."""
        imports = self.context.imports

        def reads(node: cst.CSTNode) -> bool:
            if type(node) is cst.Call:
                found = environ_call_key(node, imports)
                return found is not None and found[1] == key
            return type(node) is cst.Subscript and environ_subscript_key(node, imports) == key

        return contains(expr, reads)

    def _reads_env(self, expr: cst.CSTNode) -> bool:
        return contains(expr, lambda n: id(n) in self.env.nodes)

    def leave_Module(self, node: cst.Module) -> None:
        if self.context.model.framework:
            return
        for call in self.context.model.calls_to(INIT_PROCESS_GROUP):
            self._check_init(call)
        torchrun = self.env.torchrun
        dual_launcher = any(conditional for _, conditional in self.spawns)
        mixed = not torchrun or dual_launcher or self.env.other_launcher
        for finding in self.findings:
            if finding.conditional:  # `if "MASTER_ADDR" not in os.environ:`: a fallback
                continue
            if not mixed and finding.literal:
                self.report(finding.node, finding.warning)
            elif finding.info is not None:
                self.report(finding.node, finding.info, severity=Severity.INFO)
        if torchrun and not self.env.other_launcher:
            self._check_spawns()

    def _check_init(self, call: cst.Call) -> None:
        method = find_arg(call, "init_method", 1)
        prefix = string_prefix(method.value) if method else None
        if method is not None and prefix is not None and prefix.startswith("tcp://"):
            self.findings.append(
                _Finding(
                    method,
                    "a `tcp://` init_method overrides the rendezvous torchrun sets up; remove it "
                    "so the default env:// reads MASTER_ADDR and MASTER_PORT",
                    "a `tcp://` init_method hard-codes the rendezvous address; fine for a "
                    "manual launcher, but remove it when launching with torchrun",
                )
            )
        explicit = [
            arg
            for arg in (find_arg(call, "rank"), find_arg(call, "world_size"))
            if arg is not None and not self._derived_from_env(arg.value)
        ]
        if explicit:
            self.findings.extend(self._explicit(call, explicit))

    def _explicit(self, call: cst.Call, args: list[cst.Arg]) -> list[_Finding]:
        found = []
        for arg in args:
            value = arg.value
            if type(value) is cst.Call and self.context.qualify(value.func) == DEVICE_COUNT:
                args = [a for a in args if a is not arg]
                warning = (
                    "`world_size=torch.cuda.device_count()` counts this node's GPUs, not the "
                    "job's processes; drop it and let torchrun's WORLD_SIZE decide"
                )
                found.append(_Finding(arg, warning, warning))
        if args:
            written = ", ".join(self.context.code(arg).strip().rstrip(",") for arg in args)
            warning = (
                f"`{written}` overrides what torchrun provides; drop it so env:// reads RANK "
                "and WORLD_SIZE"
            )
            if self.spawns:
                info = (
                    f"`{written}` is passed explicitly: right for an mp.spawn launcher, but "
                    "drop it when launching with torchrun"
                )
            else:
                info = (
                    f"`{written}` is passed explicitly; if torchrun launches this script, drop "
                    "it so env:// reads RANK and WORLD_SIZE"
                )
            literal = any(_is_int(arg.value) for arg in args)
            if _one_process(call):
                info = None  # `rank=0, world_size=1`: a one-process group, e.g. for tests
            conditional = id(call) in self.fallback_inits
            found.append(_Finding(args[0], warning, info, conditional, literal))
        return found

    def _derived_from_env(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """`rank=int(os.environ["RANK"])`, or a name assigned from the environment."""
        if self._reads_env(expr):
            return True
        name = dotted(expr)
        if name is None or depth > 3:
            return False
        values = self.context.model.bindings.get(name, ())
        return any(self._derived_from_env(value, depth + 1) for value in values)

    def _check_spawns(self) -> None:
        key = sorted(self.env.keys & TORCHRUN_ENV)[0]
        for call, conditional in self.spawns:
            if conditional:
                continue
            callee = self.context.code(call.func)
            self.report(
                call.func,
                f"`{callee}(...)` starts its own workers, but this script also reads torchrun's "
                f"`{key}`; under torchrun every rank would spawn again, so launch with torchrun "
                "only",
            )


def _is_int(expr: cst.BaseExpression) -> bool:
    if type(expr) is cst.UnaryOperation:
        expr = expr.expression
    return type(expr) is cst.Integer


def _one_process(call: cst.Call) -> bool:
    world_size = find_arg(call, "world_size")
    value = world_size.value if world_size else None
    return type(value) is cst.Integer and value.evaluated_value == 1
