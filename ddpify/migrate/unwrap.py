"""Part of pass 4, wrap: what must see the model itself, not the DDP wrapper the wrap pass
put around it, read in the wrapped script (this pass runs after wrap.py).

- `copy.deepcopy(model)` made after the wrap (a "best model" snapshot or an EMA started
  in the training loop) would copy the wrapper: its `state_dict()` gains the `module.`
  prefix, and a `model.module.load_state_dict(best.state_dict())` that restores it fails.
  It copies `model.module` where every path to it wrapped `model`, else
  `getattr(model, "module", model)`.
- A network fetched by a computed name (`net = getattr(self, "net" + name)`, the model
  registries of image-to-image projects) whose checkpoint is written or read there:
  which network it is, and so whether it is wrapped on this path, is not known here
  (DataParallel applied on GPUs only becomes a DDP wrap on every path, CPU runs too).
  Its `state_dict` and `load_state_dict` go through `getattr(net, "module", net)`, so the
  keys are the plain module's on every path and the original's checkpoints still load.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.model import ScriptModel
from ddpify.analysis.named_wraps import fetched_from_self
from ddpify.analysis.names import ImportMap, dotted
from ddpify.analysis.roles import ddp_wrapper_names, mixed_receivers, wrapper_receivers
from ddpify.analysis.tree import Tree
from ddpify.analysis.wrappers import DDP, Place, WrapperFacts
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Plan
from ddpify.migrate.edits import Edits
from ddpify.walk import walk

NAME = "wrap"
CHECKPOINT_METHODS = ("state_dict", "load_state_dict")


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    if not plan.shape.converts or not tree.view.calls_to(DDP):
        return edits
    if tree.calls_to("copy.deepcopy"):
        _copies_of_wrappers(tree, plan, edits)
        _copies_in_receivers(tree, plan, edits)
    if "getattr" in tree.names():
        _networks_fetched_by_name(tree, plan, edits)
    return edits


# -- copies -----------------------------------------------------------------------------


def _copies_of_wrappers(tree: Tree, plan: Plan, edits: Edits) -> None:
    facts, copies = _wrapper_facts(tree.module)
    for call, place in copies:
        copied = call.args[0].value
        if facts.wrap_held(copied, place) is None:
            continue
        name = tree.code(copied)
        if facts.held_on_every_path(copied, place):
            plain = f"{name}.module"
        else:
            plain = f'getattr({name}, "module", {name})'
        edits.replace(copied, snippets.expression(plain))
        plan.change(
            NAME,
            f"the copy of {name} made after its DDP wrap copies the model, not the wrapper "
            "(its state_dict keys keep no `module.` prefix)",
            plain,
            "DDP051",
        )


def _copies_in_receivers(tree: Tree, plan: Plan, edits: Edits) -> None:
    """`copy.deepcopy(model)` in a helper that some call hands the wrapper (an EMA class
    of another module, `ModelEMA(model)`): the copy is of the model, like the state the
    wrap pass already reads through `.module` in such helpers, so the two keep the same
    keys (a copy of the wrapper has `module.` ones and is a DDP wrapper itself)."""
    names = ddp_wrapper_names(tree)
    receivers = wrapper_receivers(tree, names)
    if not receivers:
        return
    mixed = mixed_receivers(tree, names)
    for call in tree.calls_to("copy.deepcopy"):
        function = tree.function(call)
        copied = dotted(call.args[0].value) if call.args else None
        if function is None or copied not in receivers.get(function.name.value, ()):
            continue
        if copied not in [p.name.value for p in function.params.params]:
            continue
        if copied in mixed.get(function.name.value, ()):
            plain = f'getattr({copied}, "module", {copied})'
        else:
            plain = f"{copied}.module"
        edits.replace(call.args[0].value, snippets.expression(plain))
        plan.change(
            NAME,
            f"the copy of {copied}, which a caller hands the DDP wrapper, copies the model, "
            "not the wrapper (its state_dict keys keep no `module.` prefix)",
            plain,
            "DDP051",
        )


def _wrapper_facts(module: cst.Module) -> tuple[WrapperFacts, list[tuple[cst.Call, Place]]]:
    """The module's DDP wraps and bindings, and each `copy.deepcopy(x)` with its place,
    in one walk (places are comparable only within one walk's numbering)."""
    imports = ImportMap()
    facts = WrapperFacts(imports)
    model = ScriptModel(imports)  # keeps the import map current
    ancestors: list[cst.CSTNode] = []
    copies: list[tuple[cst.Call, Place]] = []

    def enter(node: cst.CSTNode) -> None:
        ancestors.append(node)
        model.visit(node)
        facts.visit(node, ancestors)
        if isinstance(node, cst.Call) and facts.callee == "copy.deepcopy" and node.args:
            copies.append((node, Place(tuple(ancestors), facts.seq)))

    walk(module, enter, lambda node: ancestors.pop())
    return facts, copies


# -- networks fetched by name -----------------------------------------------------------


def _networks_fetched_by_name(tree: Tree, plan: Plan, edits: Edits) -> None:
    for function in tree.find(cst.FunctionDef):
        fetched = _fetched_by_name(tree, function)
        if not fetched:
            continue
        for attr in tree.within(function, cst.Attribute):
            if attr.attr.value not in CHECKPOINT_METHODS:
                continue
            root = _chain_root(attr.value)
            if root is None or root.value not in fetched or tree.function(attr) is not function:
                continue
            plain = f'getattr({root.value}, "module", {root.value})'
            edits.replace(root, snippets.expression(plain))
            plan.change(
                NAME,
                f"`{root.value}` is one of the networks, fetched by name, and may be a DDP "
                f"wrapper: its checkpoint reads and writes go through {plain}, so the keys "
                "are the plain module's on every path (CPU runs too)",
                plain,
                "DDP051",
            )


def _fetched_by_name(tree: Tree, function: cst.FunctionDef) -> set[str]:
    """Names bound in `function` to `getattr(self, <a computed name>)`."""
    found = set()
    for assign in tree.within(function, cst.Assign):
        attribute = fetched_from_self(assign.value)
        if attribute is None or isinstance(attribute, cst.SimpleString):
            continue  # a literal attribute: the wrap pass traces it like `self.netG`
        for target in assign.targets:
            if isinstance(target.target, cst.Name):
                found.add(target.target.value)
    return found


def _chain_root(expr: cst.BaseExpression) -> cst.Name | None:
    """`net` in `net.cpu().state_dict`: the name a chain of calls and attributes starts
    from, unless the chain already goes through `.module`."""
    while True:
        if isinstance(expr, cst.Name):
            return expr
        if isinstance(expr, cst.Call):
            expr = expr.func
        elif isinstance(expr, cst.Attribute):
            if expr.attr.value == "module":
                return None
            expr = expr.value
        else:
            return None
