"""Where a script keeps its tensors: does anything in it go to a CUDA device?

The process group's backend, DDP's `device_ids` and autocast all depend on it: nccl
cannot carry CPU tensors, `device_ids` on a CPU module raises, and `autocast("cuda")`
does nothing to CPU work. A script with no sign of a CUDA device trains on the CPU even
on a GPU machine, so its conversion must too.

The evidence is textual and deliberately broad (any `.cuda()`, any `"cuda"` device
string, `.to(rank)`, DataParallel, `device_ids=`): calling a GPU script "CPU" would
only make it slower (gloo carries CUDA tensors), but calling a CPU script "GPU" makes
DDP raise on a GPU machine, so only a script without any of these counts as CPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import libcst as cst

from ddpify.analysis.names import dotted, find_arg, method_name

if TYPE_CHECKING:
    from ddpify.analysis.tree import Tree

# Calls whose "cuda" argument is a device *type*, which places nothing anywhere.
DEVICE_TYPE_CALLS = frozenset(
    {
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.GradScaler",
        "torch.cuda.amp.autocast",
        "torch.cuda.amp.GradScaler",
        "torch.get_autocast_dtype",
        "torch.amp.is_autocast_available",
    }
)
CUDA_CALLS = frozenset(
    {
        "torch.nn.parallel.DataParallel",  # DataParallel runs on GPUs or not at all
        "torch.cuda.current_device",
        "torch.accelerator.current_accelerator",  # the GPU when there is one
        "torch.accelerator.current_device_index",
    }
)
# `.to(rank)`, `torch.device(local_rank)`: an integer device is a CUDA device.
GPU_INDEX_NAME = re.compile(r"(^|_)(rank|gpu|gpu_id|gpu_index|device_id)$", re.IGNORECASE)
MOVES = ("to", "cuda")

Qualify = Callable[[cst.BaseExpression], "str | None"]


def cuda_placement(
    nodes: Iterable[cst.CSTNode], qualify: Qualify, parent: Mapping[cst.CSTNode, cst.CSTNode]
) -> cst.CSTNode | None:
    """The first node that puts a tensor or module on a CUDA device, or None."""
    for node in nodes:
        if isinstance(node, cst.Call) and _places_on_cuda(node, qualify):
            return node
        if _is_cuda_string(node) and _names_a_device(node, qualify, parent):
            return node
    return None


def _places_on_cuda(call: cst.Call, qualify: Qualify) -> bool:
    if method_name(call) == "cuda":
        return True
    name = qualify(call.func)
    if name in CUDA_CALLS:
        return True
    ids = find_arg(call, "device_ids")
    if ids is not None and not (isinstance(ids.value, cst.Name) and ids.value.value == "None"):
        return True
    if method_name(call) in MOVES or name == "torch.device":
        first = find_arg(call, "device", 0)
        return first is not None and _is_gpu_index(first.value)
    return False


def _is_gpu_index(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Integer):
        return True
    name = dotted(expr)
    return name is not None and GPU_INDEX_NAME.search(name.split(".")[-1]) is not None


def _is_cuda_string(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))
    if isinstance(node, cst.FormattedString) and node.parts:
        first = node.parts[0]
        return isinstance(first, cst.FormattedStringText) and first.value.startswith("cuda")
    return False


# str methods whose argument is text to look for, not a place for tensors:
# `args.device.startswith("cuda")` tests the option's spelling.
TEXT_METHODS = frozenset(
    {"startswith", "endswith", "find", "rfind", "index", "rindex", "count", "split"}
    | {"rsplit", "partition", "rpartition", "replace", "removeprefix", "removesuffix"}
)


def searched_text(node: cst.CSTNode, parent: Mapping) -> bool:
    """Whether `node` is an argument of a str method that searches text
    (`device.startswith("cuda")`): a spelling compared, not a device."""
    above = parent.get(node)
    call = parent.get(above) if isinstance(above, cst.Arg) else None
    return isinstance(call, cst.Call) and method_name(call) in TEXT_METHODS


def _names_a_device(node: cst.CSTNode, qualify: Qualify, parent: Mapping) -> bool:
    """Not `x.type == "cuda"`, `x.startswith("cuda")`, nor the device type of autocast or
    a GradScaler."""
    above = parent.get(node)
    if isinstance(above, (cst.Comparison, cst.ComparisonTarget)) or searched_text(node, parent):
        return False
    if isinstance(above, cst.Arg):
        if above.keyword is not None and above.keyword.value == "device_type":
            return False
        call = parent.get(above)
        if isinstance(call, cst.Call) and qualify(call.func) in DEVICE_TYPE_CALLS:
            return False
    return True


def option_spelling(node: cst.CSTNode, parent: Mapping) -> bool:
    """Whether `node` is one of the values an option accepts (`choices=["cpu", "cuda"]`
    of `add_argument`): text the user types, not a device this process uses."""
    element = parent.get(node)
    if not isinstance(element, cst.Element):
        return False
    arg = parent.get(parent.get(element))
    return isinstance(arg, cst.Arg) and arg.keyword is not None and arg.keyword.value == "choices"


PARSE_CALLS = ("parse_args", "parse_known_args")


def moved_by_option(tree: Tree, model: str) -> bool:
    """Whether the model named `model` goes to a device a command-line option names
    (`model.to(args.device)`, `device = torch.device(opt.device)`; `model.to(device)`).

    Such a model may stay on the CPU on a GPU machine (`--device cpu`, makemore's default),
    where DDP rejects `device_ids`; without them DDP takes the module's own device."""
    for call in tree.find(cst.Call, lambda c: method_name(c) == "to"):
        device = find_arg(call, "device", 0)
        if device is None or _moved_object(tree, call) != model:
            continue
        if _reads_option(tree, device.value, depth=3):
            return True
    return False


def _moved_object(tree: Tree, call: cst.Call) -> str | None:
    """`net` of `net.to(d)`, or of `net = Net().to(d)`."""
    receiver = dotted(call.func.value) if isinstance(call.func, cst.Attribute) else None
    above = tree.parent.get(call)
    if isinstance(above, cst.Assign) and len(above.targets) == 1:
        return dotted(above.targets[0].target)
    return receiver


def _reads_option(tree: Tree, expr: cst.BaseExpression, depth: int) -> bool:
    """`args.device`, `torch.device(args.device)`, or a name bound to one of them, where
    `args` holds what an argument parser parsed."""
    if depth == 0:
        return False
    if isinstance(expr, cst.Call) and tree.qualify(expr.func) == "torch.device" and expr.args:
        return _reads_option(tree, expr.args[0].value, depth - 1)
    if isinstance(expr, cst.Attribute):
        root = (dotted(expr) or "").split(".")[0]
        return bool(root) and root in _parsed_option_holders(tree)
    if isinstance(expr, cst.Name):
        return any(_reads_option(tree, value, depth - 1) for value in _values_of(tree, expr.value))
    return False


def _parsed_option_holders(tree: Tree) -> set[str]:
    """Names bound to `parser.parse_args()` (or the first of `parse_known_args()`)."""
    holders = set()
    for call in tree.find(cst.Call, lambda c: method_name(c) in PARSE_CALLS):
        above = tree.parent.get(call)
        if isinstance(above, cst.Subscript):
            above = tree.parent.get(above)
        if isinstance(above, cst.Assign):
            for target in above.targets:
                element = target.target
                if isinstance(element, cst.Tuple) and element.elements:
                    element = element.elements[0].value
                if isinstance(element, cst.Name):
                    holders.add(element.value)
    return holders


def _values_of(tree: Tree, name: str) -> list[cst.BaseExpression]:
    """The values plain assignments bind to `name`, in any scope."""
    return [
        assign.value
        for assign in tree.find(cst.Assign)
        if any(isinstance(t.target, cst.Name) and t.target.value == name for t in assign.targets)
    ]
