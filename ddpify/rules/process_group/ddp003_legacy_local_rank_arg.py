from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.names import find_arg, method_name
from ddpify.diagnostics import Applicability, FixAvailability, Severity
from ddpify.rules.base import NodeFix, Rule
from ddpify.rules.process_group._common import EnvReads, string_value

UNDERSCORE = "--local_rank"
HYPHEN = "--local-rank"


@dataclass
class _Argument:
    call: cst.Call
    options: list[str]
    dest: str


def _option_strings(call: cst.Call) -> list[str]:
    options = []
    for arg in call.args:
        if arg.keyword is not None or arg.star:
            break
        value = string_value(arg.value)
        if value is None:
            return []
        options.append(value)
    return options


def _dest(call: cst.Call, options: list[str]) -> str:
    dest = find_arg(call, "dest")
    if dest is not None and string_value(dest.value):
        return string_value(dest.value)
    long_options = [o for o in options if o.startswith("--")] or options
    return long_options[0].lstrip("-").replace("-", "_")


def _env_default(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """`int(os.environ.get("LOCAL_RANK", <old>))` where the old default's type allows it."""
    if type(value) is cst.Name and value.value == "None":
        text = 'int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None'
        return cst.parse_expression(text)
    number = value.expression if type(value) is cst.UnaryOperation else value
    if type(number) is cst.Integer:
        old = cst.Module([]).code_for_node(value)
        return cst.parse_expression(f'int(os.environ.get("LOCAL_RANK", {old}))')
    return None


class LegacyLocalRankArg(Rule):
    """`--local_rank` is how `torch.distributed.launch` passed the local rank; torchrun does not."""

    CODE = "DDP003"
    NAME = "legacy-local-rank-arg"
    SEVERITY = Severity.WARNING
    MESSAGE = (
        "`--local_rank` is the legacy `torch.distributed.launch` interface (torch 2.x passes "
        '`--local-rank`, torchrun neither); read `int(os.environ["LOCAL_RANK"])` instead'
    )
    FIX = FixAvailability.SOMETIMES

    def __init__(self, context) -> None:
        super().__init__(context)
        self.arguments: list[_Argument] = []
        self.env = EnvReads()

    def visit_Subscript(self, node: cst.Subscript) -> None:
        self.env.observe_subscript(node, self.context.ancestors, self.context.imports)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self.env.observe_comparison(node, self.context.imports)

    def visit_Call(self, node: cst.Call) -> None:
        self.env.observe_call(node, self.context.imports)
        if method_name(node) != "add_argument":
            return
        options = _option_strings(node)
        if UNDERSCORE in options or HYPHEN in options:
            self.arguments.append(_Argument(node, options, _dest(node, options)))

    def leave_Module(self, node: cst.Module) -> None:
        # The DeepSpeed launcher still passes `--local_rank`: those scripts need it.
        if self.context.model.framework:
            return
        reads_env = "LOCAL_RANK" in self.env.keys
        for argument in self.arguments:
            if HYPHEN in argument.options and reads_env:
                continue
            if HYPHEN in argument.options:
                message = (
                    f"torchrun passes no `{HYPHEN}` argument, so `args.{argument.dest}` keeps its "
                    'default; read `int(os.environ["LOCAL_RANK"])` instead'
                )
            elif reads_env:
                message = (
                    f"torch 2.x's `torch.distributed.launch` passes `{HYPHEN}`, which this "
                    f"`{UNDERSCORE}` argument rejects; accept both spellings"
                )
            else:
                message = None
            node = argument.call.args[argument.options.index(_spelled(argument.options))].value
            self.report(node, message, fix=self._fix(argument, reads_env))

    def _fix(self, argument: _Argument, reads_env: bool) -> NodeFix | None:
        """Accept both spellings and default to LOCAL_RANK: old launches and torchrun work."""
        call = argument.call
        args = list(call.args)
        applicability = Applicability.SAFE
        if not reads_env:
            if self.context.imports.aliases.get("os") != "os":
                return None
            if find_arg(call, "required") or find_arg(call, "action"):
                return None
            default = find_arg(call, "default")
            new_default = _env_default(default.value) if default else None
            if new_default is None:
                return None
            args[args.index(default)] = default.with_changes(value=new_default)
            applicability = Applicability.UNSAFE
        if HYPHEN not in argument.options:
            args = _with_hyphen_spelling(args, len(argument.options) - 1)
        if reads_env:
            message = f"also accept `{HYPHEN}`"
        else:
            message = 'default to `os.environ["LOCAL_RANK"]` and accept both spellings'
        return NodeFix(
            message,
            ((call, call.with_changes(args=args)),),
            applicability,
        )


def _spelled(options: list[str]) -> str:
    return UNDERSCORE if UNDERSCORE in options else HYPHEN


def _with_hyphen_spelling(args: list[cst.Arg], last_option: int) -> list[cst.Arg]:
    anchor = args[last_option]
    quote = anchor.value.quote if type(anchor.value) is cst.SimpleString else '"'
    spelling = cst.Arg(cst.SimpleString(f"{quote}{HYPHEN}{quote}"), comma=anchor.comma)
    anchor = anchor.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return [*args[:last_option], anchor, spelling, *args[last_option + 1 :]]
