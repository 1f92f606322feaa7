"""Pass 3, device: `.cuda()`, `"cuda"` and `"cuda:0"` become this process's GPU.

`init_distributed()` already made LOCAL_RANK the current device; the literals are
rewritten anyway so the script says which GPU it uses. Strings that name a device
*type* (autocast, GradScaler, `device.type == "cuda"`) stay as they are.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.devices import DEVICE_TYPE_CALLS, option_spelling, searched_text
from ddpify.analysis.named_wraps import data_parallel_by_name, trained_by_name
from ddpify.analysis.names import dotted, find_arg, method_name
from ddpify.analysis.reachability import never_run
from ddpify.analysis.roles import DATA_PARALLEL, data_parallel_of_trained
from ddpify.analysis.tree import Tree
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan
from ddpify.migrate.edits import Edits

NAME = "device"
CUDA_LITERALS = ("cuda", "cuda:0")
DEVICE_PARAM_METHODS = ("to", "cuda")


def _may_spell_cuda(string: cst.SimpleString) -> bool:
    """Whether the literal's value can be "cuda": a test of its text before evaluating it
    (`evaluated_value` costs a `literal_eval`, and a large file has many strings); only
    an escape could spell "cuda" without the word in the text."""
    return "cuda" in string.value or "\\" in string.value


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if not plan.shape.converts:
        return edits
    for string in tree.find(cst.SimpleString):
        if not _may_spell_cuda(string) or never_run(tree.view, string):
            continue  # never_run: an imported module's demo, the project's run never runs it
        if string.evaluated_value in CUDA_LITERALS and _names_a_device(tree, string):
            quote = string.quote
            edits.replace(string, snippets.expression(f"f{quote}cuda:{{LOCAL_RANK}}{quote}"))
            plan.change(
                NAME, f"{string.value} -> this process's GPU", "cuda:{LOCAL_RANK}", "DDP010"
            )
    for call in tree.find(cst.Call, lambda c: method_name(c) == "cuda"):
        if never_run(tree.view, call):
            continue
        if not call.args or _is_zero(call.args[0].value):
            edits.replace(call, call.with_changes(args=[cst.Arg(cst.Name("LOCAL_RANK"))]))
            plan.change(NAME, ".cuda() -> .cuda(LOCAL_RANK)", ".cuda(LOCAL_RANK)", "DDP010")
    for call in tree.calls_to("torch.device"):
        index = find_arg(call, "index", 1)
        if index is not None and _is_zero(index.value):
            edits.replace(index.value, cst.Name("LOCAL_RANK"))
            plan.change(NAME, 'torch.device("cuda", 0) -> LOCAL_RANK', "LOCAL_RANK", "DDP010")
    for first in tree.find(cst.Subscript, lambda node: _first_of_list(node)):
        if _formatted_into_cuda(tree, first) or _first_gpu_of_ids(tree, first):
            shown = tree.code(first)
            edits.replace(first, cst.Name("LOCAL_RANK"))
            plan.change(NAME, f"{shown} as a GPU index -> LOCAL_RANK", "LOCAL_RANK", "DDP010")
    if plan.spawn_function:
        _spawn_rank_as_device(tree, plan, edits)
    return edits


def _first_of_list(node: cst.Subscript) -> bool:
    """`gpu_ids[0]`, `self.opt.gpu_ids[0]`: the first GPU of a list of them, when it is used
    where a device goes (each process has its own GPU under torchrun: LOCAL_RANK)."""
    if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
        return False
    return _is_zero(node.slice[0].slice.value) and dotted(node.value) is not None


def _first_gpu_of_ids(tree: Tree, first: cst.Subscript) -> bool:
    """`net.to(gpu_ids[0])`, `net.cuda(gpu_ids[0])`: a device use of the first of a list
    that the project hands DataParallel as its device_ids (`DataParallel(net, gpu_ids)`),
    so a list of GPU indices, not of devices that may be the CPU."""
    if not _device_use(tree, first):
        return False
    listed = (dotted(first.value) or "").rsplit(".", 1)[-1]
    return listed in _device_id_lists(tree)


def _device_id_lists(tree: Tree) -> set[str]:
    """The names (last part: `gpu_ids` of `self.opt.gpu_ids`) the project passes as
    device_ids to a DataParallel of a trained model, which becomes DDP (a DataParallel of
    an evaluation network stays, and its module must stay on its first device)."""
    found = set()
    view = tree.view
    for call in view.calls_to(DATA_PARALLEL):
        owner = view.owner(call)
        if owner is None or not data_parallel_of_trained(owner, call, False):
            continue
        ids = find_arg(call, "device_ids", 1)
        name = dotted(ids.value) if ids is not None else None
        if name:
            found.add(name.rsplit(".", 1)[-1])
    return found | _ids_of_wraps_by_name(tree)


def _ids_of_wraps_by_name(tree: Tree) -> set[str]:
    """The device_ids of a DataParallel over a class's nets by name (`parallelize()`)
    that holds trained nets: the wrap pass drops it, the nets are DDP."""
    found = set()
    for module in tree.trees:
        for wrap in data_parallel_by_name(module):
            ids = find_arg(wrap.call, "device_ids", 1)
            name = dotted(ids.value) if ids is not None else None
            if name and trained_by_name(module, wrap):
                found.add(name.rsplit(".", 1)[-1])
    return found


def _formatted_into_cuda(tree: Tree, node: cst.CSTNode) -> bool:
    """`"cuda:{}".format(gpu_ids[0])`."""
    arg = tree.parent.get(node)
    call = tree.parent.get(arg) if isinstance(arg, cst.Arg) else None
    if not isinstance(call, cst.Call) or method_name(call) != "format":
        return False
    template = call.func.value if isinstance(call.func, cst.Attribute) else None
    return isinstance(template, cst.SimpleString) and str(template.evaluated_value).startswith(
        "cuda:"
    )


def _is_zero(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Integer) and expr.evaluated_value == 0


def _names_a_device(tree: Tree, string: cst.SimpleString) -> bool:
    parent = tree.parent.get(string)
    if isinstance(parent, (cst.ComparisonTarget, cst.Comparison, cst.DictElement)):
        return False
    if searched_text(string, tree.parent) or option_spelling(string, tree.parent):
        return False
    if isinstance(parent, cst.Arg):
        if parent.keyword is not None and parent.keyword.value == "device_type":
            return False
        call = tree.parent.get(parent)
        if isinstance(call, cst.Call):
            name = tree.qualify(call.func)
            if name in DEVICE_TYPE_CALLS:
                return False
            if name == "torch.device" and len(call.args) > 1:
                return False  # torch.device("cuda", index): the type, with its index
    return True


def _spawn_rank_as_device(tree: Tree, plan: Plan, edits: Edits) -> None:
    """In the spawned worker, its first parameter was the GPU index as well as the rank;
    under torchrun the rank is global, so device uses switch to LOCAL_RANK."""
    worker = tree.functions()[plan.spawn_function]  # type: ignore[index]
    param = plan.spawn_rank_param
    for name in tree.within(worker, cst.Name):
        if name.value != param or not _device_use(tree, name):
            continue
        edits.replace(name, cst.Name("LOCAL_RANK"))
        plan.change(NAME, f"{param} used as a GPU index -> LOCAL_RANK", "LOCAL_RANK", "DDP011")


def _device_use(tree: Tree, name: cst.Name) -> bool:
    parent = tree.parent.get(name)
    if isinstance(parent, cst.FormattedStringExpression):
        fstring = tree.parent.get(parent)
        first = fstring.parts[0] if isinstance(fstring, cst.FormattedString) else None
        return isinstance(first, cst.FormattedStringText) and first.value.startswith("cuda")
    if isinstance(parent, cst.Element):
        parent = tree.parent.get(tree.parent.get(parent))  # Element -> List -> Arg
    while isinstance(parent, cst.IfExp):  # `device_ids=[rank] if cuda else None`
        parent = tree.parent.get(parent)
    if not isinstance(parent, cst.Arg):
        return False
    if parent.keyword is not None:
        return parent.keyword.value in ("device_ids", "output_device", "device", "device_id")
    call = tree.parent.get(parent)
    if not isinstance(call, cst.Call):
        return False
    return method_name(call) in DEVICE_PARAM_METHODS or tree.qualify(call.func) in (
        "torch.device",
        "torch.cuda.set_device",
    )
