"""Pass 4, wrap: DataParallel or the bare model becomes DistributedDataParallel.

The wrap goes after everything that prepares the model (moves, loads, freezing,
compile) and before it trains; SyncBatchNorm conversion, on CUDA only, comes right
before it. After the wrap, anything but the forward call and the nn.Module API goes
through `.module`, so attributes resolve and checkpoints keep the original's keys.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.batch_norm import may_hold_batch_norm
from ddpify.analysis.bundles import (
    TrainedBundle,
    data_parallel_feeding_bundles,
    trained_helper_bundles,
)
from ddpify.analysis.devices import moved_by_option
from ddpify.analysis.lazy_modules import lazy_wrap_points
from ddpify.analysis.module_globals import functions_run_after, reads_module_binding
from ddpify.analysis.named_wraps import data_parallel_by_name, trained_by_name
from ddpify.analysis.names import dotted, find_arg, method_name, root_name
from ddpify.analysis.repeated_forwards import forwards_of_several_shapes
from ddpify.analysis.roles import (
    class_of,
    data_parallel_subclasses,
    ddp_wrapper_names,
    keyed_collection_owners,
    keys_loop,
    mixed_receivers,
    project_optimizer_calls,
    ranged_collection,
    returned_into_trained,
    stored_models,
    trained_model_names,
    trained_owners,
    wrapper_receivers,
)
from ddpify.analysis.trained import collection_owners, parameter_owners
from ddpify.analysis.tree import Tree, binds_on_every_branch, mentions
from ddpify.analysis.values import only_value_in_function
from ddpify.analysis.wrappers import MODULE_HOUSEKEEPING, runs_model_outside_forward
from ddpify.migrate import snippets
from ddpify.migrate.analyze import (
    DATA_PARALLEL,
    DDP,
    NotMigrated,
    Plan,
    Shape,
    _first_line,
    bound_target,
    model_names,
    optimizer_calls,
)
from ddpify.migrate.edits import Edits
from ddpify.migrate.entrypoint import runs_on_cuda

NAME = "wrap"
PREPARES = {
    "to",
    "cuda",
    "cpu",
    "half",
    "float",
    "double",
    "bfloat16",
    "load_state_dict",
    "apply",
    "requires_grad_",
    "load",
    # a list of models being filled (or a Sequential, a ModuleList given more layers)
    "append",
    "extend",
    "insert",
}
# What a DDP wrapper answers itself, like the module it wraps.
MODULE_API = MODULE_HOUSEKEEPING | {
    "module",
    "training",
    "no_sync",
    "join",
    "forward",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_comm_hook",
    "type",
}
SYNC_BN = """\
if torch.cuda.is_available():  # SyncBatchNorm needs CUDA
    {model} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({model})
"""
# A list of models (`nets = [Net(bn=False), Net(bn=True)]`): each one is converted, as
# each one is wrapped.
SYNC_BN_EACH = """\
if torch.cuda.is_available():  # SyncBatchNorm needs CUDA
    {models} = {each}
"""


def run(tree: Tree, plan: Plan) -> Edits:
    edits = Edits()
    wrapped: list[tuple[str, cst.CSTNode]] = []  # (name, the statement that wraps it)
    # the lists and dicts whose models are wrapped one by one -> the class a dict is given
    # back to ("" for a list or a plain dict)
    lists: dict[str, str] = {}
    if plan.shape is Shape.SINGLE:
        _refuse_data_parallel_subclass(tree)
    if plan.shape in (Shape.SINGLE, Shape.DATA_PARALLEL):
        _pin_bundle_data_parallel(tree, plan, edits)
    if plan.shape is Shape.DATA_PARALLEL:
        wrapped += _replace_data_parallel(tree, plan, edits)
        # a bundle's DataParallel calls are left to the wrap where it is received
        received = _received_bundles(tree)
        lists.update({bundle.collection: bundle.bundle.container for bundle in received})
        unused = ", find_unused_parameters=True" if received else ""
        wrapped += [_wrap_received_bundle(tree, plan, edits, b, unused) for b in received]
    elif plan.shape is Shape.SINGLE:
        wrapped += _wrap_model(tree, plan, edits, lists)
        _drop_data_parallel_by_name(tree, plan, edits)
    for call in tree.calls_to(DDP):
        target = bound_target(tree, call)
        if target:
            wrapped.append((target, tree.statement(call)))
    if plan.shape is not Shape.FRAMEWORK:
        # A class handed the wrapped model (`Trainer(model)`) holds the wrapper too.
        wrapped += [pair for pair in stored_models(tree) if pair[0] not in dict(wrapped)]
    # Wraps the script already had stay where they are, perhaps on one branch only.
    in_place = {id(tree.statement(call)) for call in tree.calls_to(DDP)}
    # A list or dict of wrapped models has no module attributes (`nets.items()`); its
    # items do (`nets["g"].state_dict()`).
    modules = [pair for pair in wrapped if pair[0] not in lists]
    _through_module(tree, plan, edits, modules, in_place)
    _items_through_module(tree, plan, edits, [pair for pair in wrapped if pair[0] in lists], lists)
    if not wrapped and tree.view is not tree and plan.shape is not Shape.FRAMEWORK:
        _received_from_other_modules(tree, plan, edits)
    if wrapped and plan.shape in (Shape.SINGLE, Shape.DATA_PARALLEL):
        _note_batch_norm_on_cpu(tree, plan, [name for name, _ in wrapped])
    return edits


def _data_parallel_calls(tree: Tree) -> list[cst.Call]:
    """torch's DataParallel calls, and those of the project's DataParallel subclasses
    around a model (a sync-BatchNorm package's `DataParallelWithCallback` on one branch,
    torch's on the other): each becomes DDP alike (with one GPU per process there are no
    replicas for its callbacks)."""
    return sorted(
        tree.calls_to(DATA_PARALLEL) + _subclass_calls(tree), key=lambda call: tree.order[call]
    )


def _subclass_calls(tree: Tree) -> list[cst.Call]:
    """Calls of a DataParallel subclass of the project around one of the model names."""
    subclasses = data_parallel_subclasses(tree)
    if not subclasses:
        return []
    models = model_names(tree)
    return [
        call
        for call in tree.find(cst.Call)
        if (dotted(call.func) or "").rsplit(".", 1)[-1] in subclasses
        and call.args
        and (dotted(call.args[0].value) in models or bound_target(tree, call) in models)
    ]


def _refuse_data_parallel_subclass(tree: Tree) -> None:
    """A trained model wrapped in a DataParallel subclass of the project (a sync-BatchNorm
    package's `DataParallelWithCallback`), perhaps on one branch beside a plain
    DataParallel: DDP over it would still replicate the model over the machine's GPUs in
    every process, so the migration stops and names the wrap."""
    for call in _subclass_calls(tree):
        cls = (dotted(call.func) or "").rsplit(".", 1)[-1]
        line = _first_line(tree.code(tree.statement(call)))
        func, owner = tree.function(call), class_of(tree, call)
        where = f" (in `{func.name.value}`" if func is not None else ""
        where += f" of `{owner.name.value}`)" if owner is not None else ")" if where else ""
        raise NotMigrated(
            Shape.DATA_PARALLEL,
            f"`{(line or '').strip()}`{where} wraps the trained model in `{cls}`, a DataParallel "
            "subclass of the project, which ddpify does not replace (DDP around it would "
            "still replicate the model over the GPUs inside every process); wrap the model "
            "in DistributedDataParallel there instead (its replica callbacks are not needed "
            "with one GPU per process) and migrate again",
        )


def _note_batch_norm_on_cpu(tree: Tree, plan: Plan, wrapped: list[str]) -> None:
    """A script that stays on the CPU gets no SyncBatchNorm (it needs CUDA), so its
    BatchNorm layers now normalise with each rank's share of the batch: say so, naming
    the wrapped models that hold BatchNorm."""
    if not plan.options.sync_bn or runs_on_cuda(tree):
        return
    if "convert_sync_batchnorm" in tree.names():
        return
    models = sorted({name for name in wrapped if may_hold_batch_norm(tree, name)})
    if not models:
        return
    plan.needs_human(
        f"BatchNorm layers of {', '.join(f'`{m}`' for m in models)} now normalise with each "
        "rank's share of the batch, not the whole batch as before, so the numbers differ "
        "from the original's: SyncBatchNorm needs CUDA and this script keeps its tensors on "
        "the CPU; run on GPUs (migrate adds the conversion there) or accept per-rank "
        "statistics (DDP030)",
        None,
    )


def _wants_sync_bn(tree: Tree, plan: Plan, model: str | None) -> bool:
    """Whether `model` (the name the wrap rebinds) gets a SyncBatchNorm conversion."""
    if not plan.options.sync_bn or not plan.shape.converts or not runs_on_cuda(tree):
        return False
    if "convert_sync_batchnorm" in tree.names():
        return False
    return may_hold_batch_norm(tree, model)


def _sync_bn(
    plan: Plan, model: str, element: str | None = None, container: str = ""
) -> cst.BaseStatement:
    """The conversion of `model`, or of each `element` of the list (or dict) `model`."""
    if element is not None:
        each = _each(model, element, "torch.nn.SyncBatchNorm.convert_sync_batchnorm({})", container)
        statement = SYNC_BN_EACH.format(models=model, each=each)
    else:
        statement = SYNC_BN.format(model=model)
    # The report's line: the conversion itself, which names the model (the guard above it
    # is the same line for every model, so a GAN's two conversions would trade lines).
    plan.change(
        NAME,
        f"SyncBatchNorm conversion of {'each module of ' if element else ''}{model} before "
        "the wrap (CUDA only)",
        statement.splitlines()[1],
        "DDP030",
    )
    return snippets.statement(statement)


def _each(models: str, element: str, call: str, container: str = "") -> str:
    """`[call(net) for net in nets]`, or for a dict (`element` is `name, net`)
    `{name: call(net) for name, net in nets.items()}`, given back to its `container`
    class when it is one (`Munch({...})`, which keeps `nets.generator` working)."""
    if ", " in element:
        key, value = element.split(", ")
        each = f"{{{key}: {call.format(value)} for {element} in {models}.items()}}"
        return f"{container}({each})" if container else each
    return f"[{call.format(element)} for {element} in {models}]"


def _ddp_call(
    tree: Tree, plan: Plan, inner: str, extra: str = "", device_ids: str | None = None
) -> str:
    """`DDP(inner, device_ids=...)`; a script that keeps its model on the CPU gets no
    device_ids, which DDP rejects for a CPU module (even on a GPU machine), nor does a model
    whose device an option picks (it may be the CPU): DDP then takes the module's own device
    (`.to("cuda")` is this process's GPU: init_distributed() set it). `device_ids`
    overrides the default test when the model is on a GPU only under a condition."""
    plan.needs.add("ddp")
    if not runs_on_cuda(tree):
        return f"{plan.ddp}({inner}{extra})"
    if moved_by_option(tree, inner):
        plan.change(
            NAME,
            f"{inner}: DDP without device_ids, as an option picks its device (perhaps the CPU)",
            f"{plan.ddp}({inner}",
            "DDP011",
        )
        return f"{plan.ddp}({inner}{extra})"
    return f"{plan.ddp}({inner}, device_ids={device_ids or snippets.DEVICE_IDS}{extra})"


def _device_ids_when(tree: Tree, test: cst.BaseExpression, on_cuda: bool, moved: str) -> str | None:
    """`[LOCAL_RANK] if use_cuda else None` when the branch that holds under `test` (or
    fails it, on_cuda False) is the one that moves the model to the GPU."""
    if "cuda" not in moved:
        return None
    condition = tree.code(test).strip()
    first, second = ("[LOCAL_RANK]", "None") if on_cuda else ("None", "[LOCAL_RANK]")
    return f"{first} if {condition} else {second}"


# -- DataParallel -----------------------------------------------------------------------


def _replace_data_parallel(tree: Tree, plan: Plan, edits: Edits) -> list:
    wrapped = []
    pinned = {id(call) for call in data_parallel_feeding_bundles(tree)}
    for call in _data_parallel_calls(tree):
        if not call.args or id(call) in pinned:
            continue
        outer = _chain_top(tree, call)
        suffix = tree.code(outer)[len(tree.code(call)) :]
        inner = tree.code(call.args[0].value)
        statement = tree.statement(call)
        target = bound_target(tree, call)
        kept_as = returned_into_trained(tree, statement, {inner, target})
        # `self.model = self._build_model()`: this class's own uses of `self.model` now
        # reach the wrapper (the wrap is recorded where the builder wraps).
        wrapped += [(name, statement) for name in sorted(kept_as) if name.startswith("self.")]
        if not plan.entry and not ({inner, target} & trained_model_names(tree)) and not kept_as:
            # A helper module's copy (an EMA model): DDP is for the module that trains.
            plan.needs_human(
                f"DataParallel of `{inner}`, which no optimizer trains, is left as it is; "
                "under DDP, `isinstance(..., DataParallel)` tests on the trained model are "
                "false (it is a DistributedDataParallel now)",
                tree.code(statement),
            )
            continue
        owner = trained_owner_of_part(tree, inner) if inner == target and not suffix else None
        if owner is not None:
            wrapped.append(_wrap_owner_instead(tree, plan, edits, call, owner))
            continue
        plan.change(
            NAME,
            "DataParallel -> DistributedDataParallel (one process per GPU)",
            f"{plan.ddp}(",
            "DDP070",
        )
        ifexp = _one_branch_of(tree, outer)
        if ifexp is not None:
            # `DataParallel(m).cuda() if cuda else m`: the wrap must hold on both branches.
            branch = snippets.expression(inner + suffix)
            both = ifexp.with_changes(**{"body" if ifexp.body is outer else "orelse": branch})
            ids = _device_ids_when(tree, ifexp.test, ifexp.body is outer, suffix)
            ddp = _ddp_call(tree, plan, tree.module.code_for_node(both), device_ids=ids)
            edits.replace(ifexp, snippets.expression(ddp))
            target = target or _assigned_name(statement, ifexp)
            if target:
                wrapped.append((target, statement))
            continue
        owner = _device_count_if(tree, statement)
        if owner is not None and _conditional_owner(tree, owner) is not None:
            # `if cuda: if device_count() > 1: m.enc = DataParallel(m.enc)`: hoisted out of
            # the count test, DDP would still wrap on GPUs only, and CPU ranks would drift;
            # so it goes after the conditions.
            if target is not None and inner == target and not suffix:
                wrapped.append(_wrap_owner_instead(tree, plan, edits, call, target))
                continue
            raise NotMigrated(
                Shape.DATA_PARALLEL,
                f"`{(_first_line(tree.code(statement)) or '').strip()}` is applied only under "
                f"`{_first_line(tree.code(_conditional_owner(tree, owner)))}`; DDP must wrap the "
                "trained model on every path: move the wrap out of the condition and migrate "
                "again",
            )
        conditional = None if owner else _conditional_owner(tree, statement)
        if conditional is not None:
            wrapped.append(_wrap_after_condition(tree, plan, edits, call, conditional))
            continue
        anchor = owner or statement
        place = anchor
        built_inside = _builds_inside_wrap(statement, call, owner, target, inner)
        if target is not None and (inner == target or built_inside) and not suffix:
            place = _last_preparation(tree, target, anchor)
        if place is not anchor:
            # `model = DataParallel(model); model.to(device)`: DDP wants the module on its
            # device first, so the wrap moves after the preparation. `model =
            # DataParallel(Net()); model.cuda()`: the line keeps building the module.
            if built_inside:
                edits.replace(call, call.args[0].value)
            else:
                edits.removed.add(statement)
            if owner is not None and len(owner.body.body) == 1:
                edits.removed.add(owner)
            if _wants_sync_bn(tree, plan, target):
                edits.after[place].append(_sync_bn(plan, target))
            new = snippets.statement(f"{target} = {_ddp_call(tree, plan, target)}")
            edits.after[place].append(new)
            wrapped.append((target, place))
            continue
        edits.replace(outer, snippets.expression(_ddp_call(tree, plan, inner + suffix)))
        if isinstance(call.args[0].value, cst.Name) and _wants_sync_bn(tree, plan, inner):
            edits.before[statement].append(_sync_bn(plan, inner))
        if owner is not None:
            _hoist(edits, owner)
        if target:
            wrapped.append((target, statement))
    return wrapped


def trained_owner_of_part(tree: Tree, part: str) -> str | None:
    """`model` for `model.encoder` when an optimizer trains all of `model` and not
    `model.encoder` alone: DataParallel of the part splits its batch, but DDP of the part
    would average the gradients of the part only, and the rest (a projection head) would
    drift apart on every rank."""
    trained = trained_model_names(tree)
    if part in trained:
        return None
    parts = part.split(".")[:-1]
    while parts and parts != ["self"]:
        if ".".join(parts) in trained:
            return ".".join(parts)
        parts = parts[:-1]
    return None


def _wrap_owner_instead(
    tree: Tree, plan: Plan, edits: Edits, call: cst.Call, owner: str
) -> tuple[str, cst.BaseStatement]:
    """`if cuda: if device_count() > 1: model.encoder = DataParallel(model.encoder)`, with
    all of `model` trained: the DataParallel line goes, and DDP wraps the whole `model`
    (`owner`; the part itself where it alone is trained) on every path (CPU runs too) once
    it is on its device, after the conditions."""
    statement = tree.statement(call)
    part = tree.code(call.args[0].value)
    edits.removed.add(statement)
    holder = tree.parent.get(tree.block(statement))
    if isinstance(holder, cst.If) and holder.orelse is None and len(holder.body.body) == 1:
        edits.removed.add(holder)  # `if device_count() > 1:` held the wrap alone
    outermost = _climb_conditionals(tree, statement)
    place = _last_preparation(tree, owner, outermost)
    ids = None
    if isinstance(outermost, cst.If) and outermost is not statement:
        # `if use_cuda: ... model = model.cuda()`: on the GPU only where that test holds.
        moved = tree.code(outermost.body) if outermost.orelse is None else ""
        if "device_count" not in tree.code(outermost.test):
            ids = _device_ids_when(tree, outermost.test, True, moved)
    if _wants_sync_bn(tree, plan, owner):
        edits.after[place].append(_sync_bn(plan, owner))
    edits.after[place].append(
        snippets.statement(f"{owner} = {_ddp_call(tree, plan, owner, device_ids=ids)}")
    )
    if owner == part:
        plan.needs_human(
            f"DataParallel of `{part}` was applied only when conditions held; DDP now wraps it "
            "on every path (CPU runs too), after the conditions",
            f"{owner} = {plan.ddp}(",
        )
        return owner, place
    plan.change(
        NAME,
        f"DataParallel of `{part}` -> DistributedDataParallel of the whole `{owner}`",
        f"{owner} = {plan.ddp}(",
        "DDP070",
    )
    plan.needs_human(
        f"DataParallel wrapped only `{part}`, but the optimizer trains all of `{owner}`: DDP "
        f"now wraps the whole `{owner}` on every path (CPU runs too), so the gradients of its "
        f"other parts are averaged across ranks as well; `{part}` is reached as "
        f"`{owner}.module.{part[len(owner) + 1 :]}`, and checkpoints hold the model's own keys "
        f"(no `module.` inside `{part[len(owner) + 1 :]}`)",
        f"{owner} = {plan.ddp}(",
    )
    return owner, place


def _one_branch_of(tree: Tree, expr: cst.BaseExpression) -> cst.IfExp | None:
    parent = tree.parent.get(expr)
    if isinstance(parent, cst.IfExp) and expr in (parent.body, parent.orelse):
        return parent
    return None


def _builds_inside_wrap(
    statement: cst.BaseStatement,
    call: cst.Call,
    owner: cst.If | None,
    target: str | None,
    inner: str,
) -> bool:
    """`model = DataParallel(Net())`: the wrap's argument builds the module, and the
    statement binds the wrapper to a plain name (no device-count test around it)."""
    return (
        owner is None
        and target is not None
        and "." not in target
        and inner != target
        and call.args[0].keyword is None
        and not call.args[0].star
        and _assigned_name(statement, call) == target
    )


def _assigned_name(statement: cst.BaseStatement, value: cst.BaseExpression) -> str | None:
    """`model` of `model = <value>`."""
    small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
    if isinstance(small, cst.Assign) and small.value is value and len(small.targets) == 1:
        return dotted(small.targets[0].target)
    return None


def _conditional_owner(tree: Tree, statement: cst.BaseStatement) -> cst.If | None:
    """The `if use_cuda:` (or its else) whose block holds the DataParallel wrap, if any."""
    block = tree.block(statement)
    owner = tree.parent.get(block)
    if isinstance(owner, cst.Else):
        owner = tree.parent.get(owner)
    while isinstance(tree.parent.get(owner), cst.If) and tree.parent[owner].orelse is owner:
        owner = tree.parent[owner]  # an elif: the whole chain decides
    return owner if isinstance(owner, cst.If) else None


def _wrap_after_condition(tree: Tree, plan: Plan, edits: Edits, call: cst.Call, owner: cst.If):
    """`if use_cuda: model = DataParallel(model).cuda()`: the branch keeps the move, and the
    DDP wrap goes after the whole `if`, so CPU runs are distributed too and `model.module`
    means the same on every path."""
    statement = tree.statement(call)
    target = bound_target(tree, call)
    outer = _chain_top(tree, call)
    suffix = tree.code(outer)[len(tree.code(call)) :]
    if target is None or tree.code(call.args[0].value) != target:
        raise NotMigrated(
            Shape.DATA_PARALLEL,
            f"`{(_first_line(tree.code(statement)) or '').strip()}`: DataParallel is applied on "
            "one branch of an `if` to something other than the name it rebinds; wrap the model "
            "with "
            "DataParallel on every path (or not at all) and migrate again",
        )
    if suffix:
        edits.replace(outer, snippets.expression(target + suffix))
    else:
        edits.removed.add(statement)
        if len(owner.body.body) == 1 and owner.orelse is None:
            edits.removed.add(owner)
    place = _last_preparation(tree, target, owner)
    # DataParallel on both branches: one conversion and one wrap after the `if`.
    placed = [cst.Module([]).code_for_node(s) for s in edits.after[place]]
    sync = cst.Module([]).code_for_node(snippets.statement(SYNC_BN.format(model=target)))
    if _wants_sync_bn(tree, plan, target) and sync not in placed:
        edits.after[place].append(_sync_bn(plan, target))
    in_body = owner.orelse is None and tree.inside(statement, owner.body)
    ids = _device_ids_when(tree, owner.test, True, suffix) if in_body else None
    ddp = _ddp_call(tree, plan, target, device_ids=ids)
    wrap = snippets.statement(f"{target} = {ddp}")
    # DataParallel on both branches (`if a: ... DataParallel(m) else: ... DataParallel(m)`)
    # comes out as one wrap after the `if`.
    placed = [cst.Module([]).code_for_node(s) for s in edits.after[place]]
    if cst.Module([]).code_for_node(wrap) not in placed:
        edits.after[place].append(wrap)
    plan.needs_human(
        f"DataParallel was applied only when a condition held; DDP now wraps `{target}` on "
        "every path (CPU runs too), so `.module` and checkpoint keys are the same on all of them",
        f"{target} = {plan.ddp}(",
    )
    return target, place


def _chain_top(tree: Tree, call: cst.Call) -> cst.BaseExpression:
    """`DataParallel(m).to(dev).cuda()` for the DataParallel(m) inside it."""
    node: cst.BaseExpression = call
    while True:
        attr = tree.parent.get(node)
        outer = tree.parent.get(attr) if attr is not None else None
        if isinstance(attr, cst.Attribute) and isinstance(outer, cst.Call) and outer.func is attr:
            node = outer
            continue
        return node


def _device_count_if(tree: Tree, statement: cst.BaseStatement) -> cst.If | None:
    """The `if torch.cuda.device_count() > 1:` around a DataParallel wrap, if any."""
    owner = tree.parent.get(tree.block(statement))
    if (
        isinstance(owner, cst.If)
        and owner.orelse is None
        and "device_count" in tree.code(owner.test)
    ):
        return owner
    return None


def _hoist(edits: Edits, owner: cst.If) -> None:
    """The wrap must happen on every run, CPU included: the `if` goes, its body stays."""

    def hoist(members: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        body = list(members[0].body.body)  # type: ignore[attr-defined]
        body[0] = body[0].with_changes(leading_lines=members[0].leading_lines)
        return body

    edits.group([owner], hoist)


# -- the bare model ---------------------------------------------------------------------


def _wrap_model(tree: Tree, plan: Plan, edits: Edits, lists: dict[str, str]) -> list:
    """Wrap every module an optimizer trains (a GAN's generator and discriminator alike);
    `lists` gets the names of the lists and dicts whose models are wrapped one by one."""
    optimizers = optimizer_calls(tree)
    if not optimizers and project_optimizer_calls(tree):
        return []  # a module of a project: the model is wrapped where it is optimized
    if not optimizers:
        raise NotMigrated(Shape.UNKNOWN, "no torch.optim optimizer found; cannot tell the model")
    already = {bound_target(tree, call) for call in tree.calls_to(DDP)}
    # `nets` -> `net` for `[Adam(net.parameters()) for net in nets]`, `name, net` for
    # `{name: Adam(net.parameters()) for name, net in nets.items()}`
    collections: dict[str, str] = {}
    containers: dict[str, str] = {}  # `nets` -> `Munch` for `nets = Munch(g=G(), d=D())`
    trained = _trained_bindings(tree, optimizers, collections, containers)
    # Several trained modules (a GAN): a step often uses only part of one (the
    # discriminator's auxiliary heads in the generator step), which DDP must be told.
    # A list of modules is several too, built alike but perhaps configured apart
    # (`Net(batch_normalization=False)` leaves its input BatchNorm unused).
    received = _received_bundles(tree)
    several = len({name for name, _ in trained}) > 1 or bool(collections) or bool(received)
    unused = ", find_unused_parameters=True" if several else ""
    wrapped = [_wrap_received_bundle(tree, plan, edits, bundle, unused) for bundle in received]
    lists.update({bundle.collection: bundle.bundle.container for bundle in received})
    lazy = _lazy_wrap_points(tree)
    for target, binding in trained:
        if target in already or any(target == name for name, _ in wrapped):
            continue
        extra = _find_unused_for(tree, plan, target, several)
        if target in lazy and target not in collections:
            wrapped.append(_wrap_lazily_built(tree, plan, edits, target, lazy[target], extra))
            continue
        place = _last_preparation(tree, target, binding)
        inserted = []
        element = collections.get(target)
        container = containers.get(target, "")
        if _wants_sync_bn(tree, plan, target):
            inserted.append(_sync_bn(plan, target, element, container))
        if element is not None:
            value = element.split(", ")[-1]
            wrap = _ddp_call(tree, plan, value, extra).replace("{", "{{").replace("}", "}}")
            each = _each(target, element, wrap.replace(value, "{}", 1), container)
            inserted.append(snippets.statement(f"{target} = {each}"))
            edits.after[place].extend(inserted)
            anchor = f"{target} = {each[: each.index(plan.ddp) + len(plan.ddp) + 1]}"
            plan.change(NAME, f"wrap each module of {target} in DistributedDataParallel", anchor)
            _note_find_unused(plan, anchor)
            lists[target] = container
            wrapped.append((target, place))
            continue
        inserted.append(snippets.statement(f"{target} = {_ddp_call(tree, plan, target, extra)}"))
        edits.after[place].extend(inserted)
        plan.change(NAME, f"wrap {target} in DistributedDataParallel", f"{target} = {plan.ddp}(")
        if extra:
            _note_find_unused(plan, f"{target} = {plan.ddp}(")
        wrapped.append((target, place))
    return wrapped


def _drop_data_parallel_by_name(tree: Tree, plan: Plan, edits: Edits) -> None:
    """`setattr(self, "net" + name, DataParallel(net, gpu_ids))` over the class's nets
    (analysis/named_wraps.py): the trained ones are wrapped in DDP where they are built, so
    this wrapper goes (`net` stays); under DDP each process drives one GPU, and the nets no
    optimizer trains run as they are."""
    for wrap in data_parallel_by_name(tree):
        trained = trained_by_name(tree, wrap)
        if not trained:
            continue  # none of the nets it can name is wrapped in DDP: left to the shape
        edits.replace(wrap.call, snippets.expression(wrap.net))
        shown = ", ".join(f"`{name}`" for name in trained)
        plan.change(
            NAME,
            f"DataParallel over the nets by name removed: the trained ones ({shown}) are "
            "wrapped in DistributedDataParallel where they are built, one process per GPU",
            tree.code(tree.statement(wrap.call)),
            "DDP070",
        )


def _find_unused_for(tree: Tree, plan: Plan, target: str, several: bool) -> str:
    """`, find_unused_parameters=True` for a module among several trained ones, unless
    its forward runs in different ways before one backward (analysis/repeated_forwards.py):
    DDP would then judge unused parameters by the last forward alone and fail."""
    if not several:
        return ""
    calls = forwards_of_several_shapes(tree.view, target)
    if not calls:
        return ", find_unused_parameters=True"
    shown = ", ".join(f"`{tree.view.code(call)}`" for call in calls[:3])
    plan.needs_human(
        f"`{target}` runs its forward in different ways ({shown}), perhaps several times "
        "into one loss: it is wrapped without find_unused_parameters=True, with which DDP "
        "judges unused parameters by the last forward alone and fails ('marked ready "
        "twice'); if a backward leaves some of its parameters without a gradient, DDP "
        "stops with 'Expected to have finished reduction': give those parameters a zero "
        "gradient (`0 * p.sum()` in the loss) or use `static_graph=True` (DDP034)",
        f"{target} = {plan.ddp}(",
    )
    return ""


def _lazy_wrap_points(tree: Tree) -> dict[str, cst.SimpleStatementLine]:
    """Models whose first forward builds their layers -> the statement that builds their
    optimizer, which their wrap goes right before (analysis/lazy_modules.py); analyze
    refuses those without one."""
    return {
        lazy.model: point
        for lazy, point in lazy_wrap_points(tree)
        if point is not None and tree.owns(point)
    }


def _wrap_lazily_built(
    tree: Tree, plan: Plan, edits: Edits, target: str, place: cst.CSTNode, extra: str
) -> tuple[str, cst.CSTNode]:
    """Wrap `target` after the forward that builds its layers, just before its optimizer:
    DDP then registers every layer, and broadcasts rank 0's to the other ranks."""
    inserted = []
    if _wants_sync_bn(tree, plan, target):
        inserted.append(_sync_bn(plan, target, None, ""))
    inserted.append(snippets.statement(f"{target} = {_ddp_call(tree, plan, target, extra)}"))
    edits.before[place].extend(inserted)
    plan.change(
        NAME,
        f"wrap {target} in DistributedDataParallel after the forward that builds its layers, "
        "just before its optimizer (DDP sends rank 0's layers to every rank)",
        f"{target} = {plan.ddp}(",
    )
    if extra:
        _note_find_unused(plan, f"{target} = {plan.ddp}(")
    return target, place


def _note_find_unused(plan: Plan, anchor: str) -> None:
    plan.needs_human(
        "several trained modules are wrapped with find_unused_parameters=True, since a "
        "step may use only part of one; drop it where every parameter gets a gradient "
        "in every backward (it costs a graph traversal per step) (DDP034)",
        anchor,
    )


def _trained_bindings(
    tree: Tree, optimizers: list[cst.Call], collections: dict, containers: dict
) -> list:
    """(name, the statement that builds it) for each trained module; `model.fc` in a
    per-layer optimizer resolves to the `model` it belongs to; `net` in
    `[Adam(net.parameters()) for net in nets]` (or a `for net in nets:` loop that
    appends it) to the list `nets` (recorded in
    `collections` with its element name: each of its modules is wrapped), and in
    `{k: Adam(net.parameters()) for k, net in nets.items()}` to the dict `nets`; so do
    `nets["g"]` and, in a dict with attribute access (`Munch`), `nets.generator` (the
    class to rebuild recorded in `containers`)."""
    found = []
    for optimizer in optimizers:
        owners = trained_owners(tree.view, optimizer)
        if not owners:
            _refuse_untraced_parameters(tree, optimizer)
        for owner in owners:
            collection, element = ranged_collection(tree, optimizer, owner) or (None, None)
            if owner in collection_owners(optimizer):  # `Adam(nets["g"].parameters())`
                collection = owner
                element, containers[owner] = _item_names(tree, owner, optimizer)
            elif owner in keyed_collection_owners(tree.view, optimizer):  # `nets[k]`, by key
                if _received_bundle(tree, owner, optimizer) is not None:
                    continue  # wrapped where it is received: _wrap_received_bundles
                _refuse_items_out_of_reach(tree, owner, optimizer)
                collection = owner
                element, containers[owner] = _item_names(tree, owner, optimizer)
            mapping = _mapping_item(tree, owner, optimizer)
            if collection is None and mapping is not None:  # `nets.generator`
                collection, element = mapping[0], "name, net"
                containers[collection] = mapping[1]
            if collection is not None:
                binding = _binding(tree, collection, optimizer)
                if binding is not None and collection.isidentifier():
                    collections[collection] = element
                    found.append((collection, binding))
                    continue
            resolved = _resolve_owner(tree, owner, optimizer)
            if resolved is None:
                line = _first_line(tree.code(tree.statement(optimizer)))
                # `net` of `for net in nets` is not built anywhere: `nets` is.
                built = f"models of `{collection}`" if collection else f"model `{owner}`"
                raise NotMigrated(
                    Shape.UNKNOWN,
                    f"cannot find where the {built} trained by `{line}` "
                    f"{'are' if collection else 'is'} built in this file; wrap "
                    f"{'each' if collection else 'it'} in DistributedDataParallel where "
                    f"{'they are' if collection else 'it is'} built",
                )
            found.append(resolved)
    return found


def _refuse_items_out_of_reach(tree: Tree, collection: str, optimizer: cst.Call) -> None:
    """`optims[k] = Adam(nets[k].parameters())` over the keys of `nets`: each item is
    wrapped where the dict is built, so the dict must be built in this function (not
    returned by a helper that may also copy its models, for an EMA), and the loop must
    train every item (not skip some with `continue` or an `if`)."""
    line = _first_line(tree.code(tree.statement(optimizer)))
    binding = _binding(tree, collection, optimizer)
    elsewhere = binding is not None and tree.scope(binding) is not tree.scope(optimizer)
    if binding is None or (elsewhere and not collection.startswith("self.")):
        binding = _unpacked_binding(tree, collection, optimizer) or binding
    small = _small(binding) if binding is not None else None
    value = small.value if isinstance(small, cst.Assign) else None
    if isinstance(value, cst.Call) and _mapping_class(value) is None:
        made_by = _first_line(tree.code(value))
        raise NotMigrated(
            Shape.UNKNOWN,
            f"`{line}` trains the models of `{collection}` by key, and `{collection}` comes "
            f"from `{made_by}` (`{_first_line(tree.code(binding))}`), which builds them "
            "elsewhere, so ddpify cannot wrap them (each rank would train its own copy): it "
            "wraps the items of a dict only where the dict is built; wrap "
            "each trained module in DistributedDataParallel once it is on its device "
            f"({_where_to_wrap(tree) or 'where it is built'}), keep the copies made of it "
            "(an EMA's deepcopy) copies of the plain module, and migrate again",
        )
    loop = keys_loop(tree.view, optimizer, _key_of(optimizer, collection) or "", collection)
    skip = _skipping(tree, loop, optimizer) if loop is not None else None
    if skip is not None:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"`{line}` trains only the items of `{collection}` that "
            f"`{_first_line(tree.code(skip))}` lets through; ddpify wraps every item of a "
            "dict, and DDP over an item no optimizer trains fails (or trains it apart on "
            "each rank): wrap the trained ones in DistributedDataParallel by name",
        )


def _unpacked_binding(tree: Tree, name: str, near: cst.CSTNode) -> cst.BaseStatement | None:
    """`self.nets, self.nets_ema = build_model(args)`: the statement that unpacks `name`
    (in the function of `near` for a plain name)."""
    for assign in tree.find(cst.Assign):
        if not name.startswith("self.") and tree.scope(assign) is not tree.scope(near):
            continue
        for target in assign.targets:
            if isinstance(target.target, cst.Tuple) and any(
                dotted(e.value) == name for e in target.target.elements
            ):
                return tree.statement(assign)
    return None


def _key_of(optimizer: cst.Call, collection: str) -> str | None:
    """`k` in `Adam(nets[k].parameters())`."""
    for arg in optimizer.args:
        for sub in _subscripts(arg.value):
            key = sub.slice[0].slice if len(sub.slice) == 1 else None
            if dotted(sub.value) == collection and isinstance(key, cst.Index):
                return dotted(key.value)
    return None


def _subscripts(node: cst.CSTNode) -> list[cst.Subscript]:
    found = [node] if isinstance(node, cst.Subscript) else []
    for child in node.children:
        found += _subscripts(child)
    return found


def _skipping(tree: Tree, loop: cst.CSTNode, optimizer: cst.Call) -> cst.CSTNode | None:
    """What lets only some keys through to the optimizer: an `if` between the loop and
    it (a comprehension's `if` clause too), or a `continue` in the loop before it."""
    if isinstance(loop, cst.CompFor) and loop.ifs:
        return loop.ifs[0]
    current = tree.parent.get(optimizer)
    while current is not None and current is not loop:
        if isinstance(current, cst.If):
            return current
        current = tree.parent.get(current)
    if isinstance(loop, cst.For):
        statement = tree.statement(optimizer)
        for node in tree.within(loop, cst.Continue):
            if not tree.after(node, statement):
                return _enclosing_if(tree, node, loop) or tree.statement(node)
    return None


def _enclosing_if(tree: Tree, node: cst.CSTNode, loop: cst.CSTNode) -> cst.If | None:
    current = tree.parent.get(node)
    while current is not None and current is not loop:
        if isinstance(current, cst.If):
            return current
        current = tree.parent.get(current)
    return None


def _where_to_wrap(tree: Tree) -> str | None:
    """`in place of `nn.DataParallel(G(...))` in `build_model` and 4 more`: where the
    project's DataParallel wraps are, the places for DDP wraps; None without any."""
    view = tree.view
    parallel = view.calls_to(DATA_PARALLEL)
    if not parallel:
        return None
    first = parallel[0]
    func = view.function(first)
    inside = f" in `{func.name.value}`" if func is not None else ""
    more = f" and {len(parallel) - 1} more" if len(parallel) > 1 else ""
    return f"in place of `{_first_line(view.code(first))}`{inside}{more}"


def _refuse_untraced_parameters(tree: Tree, optimizer: cst.Call) -> None:
    """An optimizer whose parameters ddpify cannot trace to a module (`Adam(params=
    self.nets[net].parameters())` over the keys of a dict a helper returns): the modules
    it trains would stay unwrapped, each rank training its own copy. Name the optimizer
    and the DataParallel wraps of the project, where a DDP wrap would go."""
    line = _first_line(tree.code(tree.statement(optimizer)))
    params = optimizer.args[0].value if optimizer.args else None
    trains = f" `{tree.code(params)}`" if params is not None else ""
    where = _where_to_wrap(tree) or "where each trained module is built"
    raise NotMigrated(
        Shape.UNKNOWN,
        f"`{line}` trains{trains}, which ddpify cannot trace to the modules it builds, so "
        "it cannot wrap them in DistributedDataParallel (each rank would train its own "
        f"copy); wrap each trained module in DistributedDataParallel {where}",
    )


# Calls that build a dict a comprehension rebuilds alike: a plain one, or one given back
# to its class (attribute access kept: `nets.generator`). `nn.ModuleDict` is a module.
DICT_CALLS = frozenset({"dict"})
MAPPING_CLASSES = frozenset({"OrderedDict", "Munch", "EasyDict", "edict", "AttrDict"})
DICT_METHODS = frozenset(name for name in dir(dict) if not name.startswith("_"))


def _item_names(tree: Tree, collection: str, optimizer: cst.Call) -> tuple[str, str]:
    """The names a comprehension over `collection` binds, to wrap each of its models,
    and the class to give a dict back to: `name, net` (over `.items()`) for a dict, `net`
    for a list; refused for a container a comprehension would not rebuild."""
    value = _bound_value(tree, collection, optimizer)
    if isinstance(value, (cst.List, cst.ListComp)):
        return "net", ""
    container = _mapping_class(value)
    if container is not None:
        return "name, net", container
    line = _first_line(tree.code(tree.statement(optimizer)))
    binding = _binding(tree, collection, optimizer)
    built = f"`{_first_line(tree.code(binding))}`" if binding is not None else "no assignment"
    raise NotMigrated(
        Shape.UNKNOWN,
        f"the models trained by `{line}` are items of `{collection}` ({built} in this file), "
        "which ddpify wraps one by one only in a list or a dict; wrap each model in "
        "DistributedDataParallel where it is put in",
    )


def _mapping_item(tree: Tree, owner: str, near: cst.CSTNode) -> tuple[str, str] | None:
    """(`nets`, `Munch`) when `owner` is `nets.generator`, an item of a dict with attribute
    access bound to `nets`, which holds the models and is no model itself."""
    collection, _, item = owner.rpartition(".")
    if not collection.isidentifier() or item in ("module", "model"):
        return None
    container = _mapping_class(_bound_value(tree, collection, near))
    return (collection, container) if container else None


def _mapping_class(value: cst.BaseExpression | None) -> str | None:
    """ "" for a dict display or `dict(...)`, the class for `Munch(...)` and its kind,
    None for anything else."""
    if isinstance(value, (cst.Dict, cst.DictComp)):
        return ""
    callee = (dotted(value.func) or "") if isinstance(value, cst.Call) else ""
    short = callee.rsplit(".", 1)[-1]
    if short in DICT_CALLS:
        return ""
    return callee if short in MAPPING_CLASSES else None


def _bound_value(tree: Tree, name: str, near: cst.CSTNode) -> cst.BaseExpression | None:
    binding = _binding(tree, name, near)
    small = _small(binding) if binding is not None else None
    return small.value if isinstance(small, cst.Assign) else None


def _small(statement: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
        return statement.body[0]
    return None


def _resolve_owner(tree: Tree, owner: str, near: cst.CSTNode):
    parts = owner.split(".")
    while parts and parts != ["self"]:
        name = ".".join(parts)
        binding = _binding(tree, name, near)
        if binding is not None:
            return name, binding
        parts = parts[:-1]
    return None


def _binding(tree: Tree, target: str, near: cst.CSTNode) -> cst.BaseStatement | None:
    candidates = []
    for assign in tree.find(cst.Assign):
        if any(dotted(t.target) == target for t in assign.targets):
            candidates.append(tree.statement(assign))
    if not candidates:
        return None
    same_scope = [s for s in candidates if tree.scope(s) is tree.scope(near)]
    if target.startswith("self."):
        cls = class_of(tree, near)
        same_scope = [s for s in candidates if cls is not None and tree.inside(s, cls)]
    before = [s for s in same_scope if not tree.after(s, near)]
    chosen = (before or same_scope or candidates)[-1]
    return _climb_conditionals(tree, chosen, near, target)


def _climb_conditionals(
    tree: Tree,
    statement: cst.BaseStatement,
    near: cst.CSTNode | None = None,
    target: str | None = None,
) -> cst.BaseStatement:
    """A model built in `if arch == ...: ... else: ...` is wrapped after the whole `if`;
    not after an `if` that holds `near` (its optimizer) too: built and trained under one
    condition (`if self.isTrain:`), it exists only there, so it is wrapped there. Unless
    every branch binds `target` (a fresh model and its optimizer, or both restored from a
    checkpoint): the model exists after the `if` either way, and a wrap inside one branch
    would leave the other path unwrapped and come before the later `.to(device)`."""
    while True:
        owner = tree.parent.get(tree.block(statement))
        while isinstance(owner, (cst.Else, cst.If)) and tree.statement(owner) is not owner:
            owner = tree.parent.get(owner)
        if isinstance(owner, (cst.If, cst.Try)) and tree.statement(owner) is owner:
            # The __main__ guard and a try/finally (the one that destroys the process
            # group) hold the whole run: the wrap belongs inside them.
            if owner is tree.main_guard() or getattr(owner, "finalbody", None) is not None:
                return statement
            if near is not None and tree.owns(near) and tree.inside(near, owner):
                if target is None or not binds_on_every_branch(owner, target):
                    return statement
            statement = owner
            continue
        return statement


def _last_preparation(tree: Tree, target: str, binding: cst.BaseStatement) -> cst.BaseStatement:
    block = tree.block(binding)
    body = list(block.body)
    last = binding
    for stmt in body[body.index(binding) + 1 :]:
        if _prepares(tree, stmt, target):
            last = stmt
        elif _trains(tree, stmt, target):
            break
    return last


def _prepares(tree: Tree, stmt: cst.BaseStatement, target: str) -> bool:
    if isinstance(stmt, cst.If):
        inner = list(stmt.body.body)
        # `if cuda: model = model.cuda(); cudnn.benchmark = True`: the move makes the whole
        # `if` a preparation (the wrap goes after it), as long as nothing in it trains.
        return any(_prepares(tree, s, target) for s in inner) and not any(
            _trains(tree, s, target) for s in inner
        )
    if isinstance(stmt, cst.For):
        # `for m in model.children(): ...`, and `for w in widths: nets.append(Net(w))`
        # that fills a list of models (each one is wrapped once the list is complete).
        fills = any(_prepares(tree, s, target) for s in stmt.body.body)
        return (mentions(stmt.iter, target) or fills) and "backward" not in tree.code(stmt)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and any(dotted(t.target) == target for t in small.targets):
        return True
    if isinstance(small, cst.Assign) and any(_item_of(t.target, target) for t in small.targets):
        return True  # `nets["d"] = Discriminator()` fills the dict of models
    for call in tree.within(stmt, cst.Call):
        receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
        if (
            receiver is not None
            and _is_or_holds(dotted(receiver), target)
            and method_name(call) in PREPARES
        ):
            return True
    if _prepared_by_helper(tree, stmt, target):
        return True
    if any(_deep_copy_of(tree, call, target) for call in tree.within(stmt, cst.Call)):
        return True  # `ema = copy.deepcopy(model)`: an EMA copy of the plain module
    # `AdamW(model.get_parameters())`: a parameter-group method of the model's own class
    # is not an attribute of the DDP wrapper, so that optimizer is built before the wrap
    # (it sees the same parameters either way).
    return any(
        not parameter_owners(call) and target in trained_owners(tree.view, call)
        for call in tree.within(stmt, cst.Call)
    )


def _prepared_by_helper(tree: Tree, stmt: cst.SimpleStatementLine, target: str) -> bool:
    """`init_weights(net, gain)`: a function of the project that prepares the module it is
    given (`net.apply(init_func)`, `.to(...)`) changes its weights, so DDP, which
    broadcasts rank 0's weights when it wraps, wraps after it."""
    small = stmt.body[0]
    call = small.value if isinstance(small, cst.Expr) else None
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        return False
    function = tree.view.functions().get(call.func.value)
    if function is None:
        return False
    params = [param.name.value for param in function.params.params]
    for index, arg in enumerate(call.args):
        if arg.keyword is None and arg.star == "" and dotted(arg.value) == target:
            if index < len(params) and _prepares_parameter(tree, function, params[index]):
                return True
    return False


def _prepares_parameter(tree: Tree, function: cst.FunctionDef, param: str) -> bool:
    return any(
        isinstance(call.func, cst.Attribute)
        and dotted(call.func.value) == param
        and method_name(call) in PREPARES
        for call in tree.view.within(function, cst.Call)
    )


def _deep_copy_of(tree: Tree, call: cst.Call, target: str) -> bool:
    """`copy.deepcopy(model)`, `deepcopy(nets["g"])`: a copy (an EMA's) of the target or
    one of its items, which must be made before the wrap to stay a plain module."""
    if tree.qualify(call.func) != "copy.deepcopy" or not call.args:
        return False
    copied = call.args[0].value
    return dotted(copied) == target or _item_of(copied, target)


def _item_of(expr: cst.BaseExpression, target: str) -> bool:
    return isinstance(expr, cst.Subscript) and dotted(expr.value) == target


def _is_or_holds(name: str | None, target: str) -> bool:
    """`model` for `model.encoder` too: moving the model moves its parts."""
    if name is None or name == "self":
        return False
    return name == target or target.startswith(name + ".")


def _trains(tree: Tree, stmt: cst.BaseStatement, target: str) -> bool:
    if isinstance(stmt, (cst.For, cst.While, cst.With, cst.Try)):
        return mentions(stmt, target) or "backward" in tree.code(stmt)
    if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Return):
        return True
    for call in tree.within(stmt, cst.Call):
        if any(dotted(arg.value) == target for arg in call.args):
            name = tree.qualify(call.func) or ""
            if not name.startswith("torch.optim") and name != "torch.compile":
                return True
    return False


# -- a bundle of models a helper returns --------------------------------------------------
# `self.nets, self.nets_ema = build_model(args)`, the helper (in any module) returning
# `Munch(generator=G, ...)`, and `optims[k] = Adam(self.nets[k].parameters())` over its
# keys. DDP wraps each trained model where the bundle is RECEIVED, not in the helper: the
# helper also makes the EMA copies (`deepcopy(generator)`), which must stay plain modules
# (a deep copy of a DDP wrapper is a second DDP with its own reducer, and an EMA model is
# never trained), and the receiver is where the keys the optimizers train are known.


def _received_bundle(tree: Tree, collection: str, optimizer: cst.Call) -> TrainedBundle | None:
    for bundle in trained_helper_bundles(tree):
        if bundle.collection == collection and bundle.optimizer is optimizer:
            return bundle
    return None


def _received_bundles(tree: Tree) -> list[TrainedBundle]:
    """The trained bundles received in this module, one per collection."""
    found: dict[str, TrainedBundle] = {}
    for bundle in trained_helper_bundles(tree):
        if tree.owns(bundle.receiving) and bundle.collection not in found:
            found[bundle.collection] = bundle
    return list(found.values())


def _wrap_received_bundle(
    tree: Tree, plan: Plan, edits: Edits, trained: TrainedBundle, extra: str
) -> tuple[str, cst.BaseStatement]:
    """`for k in self.nets.keys(): self.nets[k] = DDP(self.nets[k].module, ...)`, over the
    keys the optimizers' loop trains (its `if ...: continue` skips copied), after the code
    that prepares the models; `.module` unwraps the helper's DataParallel (DDP replaces it:
    not both)."""
    collection, optimizer, bundle = trained.collection, trained.optimizer, trained.bundle
    line = _first_line(tree.code(tree.statement(optimizer)))
    key = _key_of(optimizer, collection) or ""
    loop = keys_loop(tree.view, optimizer, key, collection)
    skips = _copyable_skips(tree, loop, optimizer) if loop is not None else None
    if loop is None or skips is None:
        raise NotMigrated(
            Shape.UNKNOWN,
            f"`{line}` trains the models of `{collection}` (built by "
            f"`{bundle.helper.name.value}`) under a condition ddpify cannot repeat where it "
            "wraps them: wrap each trained model in DistributedDataParallel by name",
        )
    parallel = set(bundle.entries) & bundle.data_parallel
    if parallel and parallel != set(bundle.entries):
        raise NotMigrated(
            Shape.UNKNOWN,
            f"`{bundle.helper.name.value}` wraps only some models of the bundle it returns "
            f"in DataParallel ({', '.join(sorted(parallel))}); ddpify replaces DataParallel by "
            "DDP only where every model of the bundle has it: wrap the trained ones in "
            "DistributedDataParallel by name",
        )
    item = f"{collection}[{key}]"
    inner = f"{item}.module" if parallel else item
    skipped = "".join(f"    if {tree.code(skip.test)}:\n        continue\n" for skip in skips)
    code = (
        f"for {key} in {tree.code(loop.iter)}:\n{skipped}"
        f"    {item} = {_ddp_call(tree, plan, inner, extra)}\n"
    )
    comment = (
        f"# ddpify: DDP wraps the trained models of `{collection}` (from "
        f"`{bundle.helper.name.value}`) here, where they are received and prepared"
    )
    place = _bundle_wrap_place(tree, collection, trained.receiving)
    edits.after[place].extend(snippets.statements(code, comment))
    anchor = f"{item} = {plan.ddp}("
    helper = bundle.helper.name.value
    plan.change(
        NAME,
        f"wrap each model of {collection} that `{line}` trains in DistributedDataParallel, "
        f"where `{helper}` returns it to (its other models, EMA copies, stay plain)",
        anchor,
    )
    if parallel:
        plan.change(
            NAME,
            f"DataParallel of the trained models of `{helper}` -> DistributedDataParallel "
            f"of their `.module` (the checkpoints keep their keys)",
            anchor,
            "DDP070",
        )
    else:
        # A DataParallel item was reached through `.module` already, and DDP answers that
        # too; a plain one read by attribute elsewhere (`nets.generator.mapping`) is not
        # followed through the aliases and helpers the bundle is handed to.
        plan.needs_human(
            f"each trained model of `{collection}` is a DDP wrapper now: code that reads one "
            f"of their own attributes or methods (anything but the forward call and the "
            f"nn.Module API) must go through `.module` (DDP032)",
            anchor,
        )
    if extra:
        _note_find_unused(plan, anchor)
    return collection, place


def _copyable_skips(tree: Tree, loop: cst.CSTNode, optimizer: cst.Call) -> list | None:
    """The `if <test>: continue` statements of the optimizers' `for` loop before the
    optimizer, which the wrap loop repeats; None when the loop lets keys through some
    other way (an `if` around the optimizer, a comprehension's `if` clause)."""
    if isinstance(loop, cst.CompFor):
        return None if loop.ifs else []
    if not isinstance(loop, cst.For) or not isinstance(loop.body, cst.IndentedBlock):
        return None
    statement = tree.statement(optimizer)
    current = tree.parent.get(optimizer)
    while current is not None and current is not loop:
        if isinstance(current, cst.If):
            return None
        current = tree.parent.get(current)
    skips = []
    for stmt in loop.body.body:
        if stmt is statement or tree.inside(statement, stmt):
            break
        if _is_skip(stmt):
            skips.append(stmt)
        elif any(True for _ in tree.within(stmt, cst.Continue)):
            return None
    return skips


def _is_skip(stmt: cst.BaseStatement) -> bool:
    if not isinstance(stmt, cst.If) or stmt.orelse is not None:
        return False
    body = stmt.body.body
    if isinstance(stmt.body, cst.SimpleStatementSuite):
        return len(body) == 1 and isinstance(body[0], cst.Continue)
    return (
        len(body) == 1
        and isinstance(body[0], cst.SimpleStatementLine)
        and len(body[0].body) == 1
        and isinstance(body[0].body[0], cst.Continue)
    )


def _bundle_wrap_place(
    tree: Tree, collection: str, receiving: cst.BaseStatement
) -> cst.BaseStatement:
    """Received in a constructor: after its last statement, since the constructor goes on
    preparing the models through the object (`setattr(self, name, net)` makes them its
    children; `self.to(device)` moves them, `self.apply(init)` initialises them), and DDP
    must wrap them on their device with the weights it broadcasts from rank 0. Elsewhere:
    after the last statement that prepares the bundle itself."""
    function = tree.function(receiving)
    if function is not None and function.name.value == "__init__":
        body = function.body.body
        last = body[-1]
        if not (isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[0], cst.Return)):
            return last
    return _last_preparation(tree, collection, _climb_conditionals(tree, receiving))


def _pin_bundle_data_parallel(tree: Tree, plan: Plan, edits: Edits) -> None:
    """The helper's DataParallel wraps of a trained bundle's models and their EMA copies
    stay (the trained ones are unwrapped to DDP where received; code reads `.module` of
    both, as a checkpoint helper with `data_parallel=True` does) but on this process's
    one device, where DataParallel only calls its module: the default, every visible GPU,
    would replicate each forward across the GPUs of the other ranks."""
    calls = [
        call
        for call in data_parallel_feeding_bundles(tree)
        if call.args and not any(a.keyword and a.keyword.value == "device_ids" for a in call.args)
    ]
    torch = tree.alias_for("torch")
    if torch is None and calls:
        plan.needs.add("torch")
    device_ids = snippets.DEVICE_IDS.replace("torch.", f"{torch or 'torch'}.")
    for call in calls:
        last = call.args[-1].with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        )
        pinned = cst.Arg(
            keyword=cst.Name("device_ids"),
            value=snippets.expression(device_ids),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""),
                whitespace_after=cst.SimpleWhitespace(""),
            ),
        )
        edits.replace(call, call.with_changes(args=[*call.args[:-1], last, pinned]))
    if calls:
        plan.change(
            NAME,
            f"DataParallel of the models a trained bundle holds, and of their copies, kept on "
            f"this process's device ({len(calls)} call{'s' if len(calls) > 1 else ''})",
            "device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None",
        )


# -- through .module --------------------------------------------------------------------


def _through_module(
    tree: Tree, plan: Plan, edits: Edits, wrapped: list, in_place: set[int]
) -> None:
    for name, statement in wrapped:
        branch = _branch_of(tree, statement) if id(statement) in in_place else None
        for attr in _uses_after(tree, name, statement):
            if attr.attr.value in MODULE_API:
                continue
            if branch is not None and not tree.inside(attr, branch):
                _note_wrapped_on_some_paths(tree, plan, name, statement, attr)
                continue
            code = _read_through_module(tree, plan, edits, attr, name)
            call = tree.parent.get(attr)
            if isinstance(call, cst.Call) and runs_model_outside_forward(tree, call, name):
                plan.needs_human(
                    f"`{name}.module.{attr.attr.value}(...)` runs part of the model outside "
                    "DDP's forward in a training step, so the gradients it produces are never "
                    "averaged across ranks and the replicas drift apart; route it through "
                    f"`{name}(...)` (a forward that takes a mode argument) (DDP033)",
                    f".module.{attr.attr.value}(",
                )
            if plan.shape is Shape.DATA_PARALLEL and code == "DDP051":
                plan.needs_human(
                    "checkpoints now hold the model's own keys, without DataParallel's `module.` "
                    "prefix; strip the prefix when loading old checkpoints",
                    f".module.{attr.attr.value}",
                )
        for saved in _saved_whole_after(tree, name, statement):
            if branch is None or tree.inside(saved, branch):
                _save_the_module(tree, plan, edits, saved)


def _save_the_module(tree: Tree, plan: Plan, edits: Edits, saved: cst.BaseExpression) -> None:
    """`torch.save({"model": model})` of the DDP wrapper -> `model.module`: the checkpoint
    holds the model as the original's did (a pickled wrapper needs its process group)."""
    shown = tree.code(saved)
    edits.replace(saved, snippets.expression(f"{shown}.module"))
    plan.change(
        NAME,
        f"the saved {shown} -> {shown}.module: the checkpoint holds the model, not the wrapper",
        f"{shown}.module",
        "DDP051",
    )


def _items_through_module(
    tree: Tree, plan: Plan, edits: Edits, collections: list, classes: dict[str, str]
) -> None:
    """`nets["g"].state_dict()` after each model of `nets` was wrapped: the item is a DDP
    wrapper now, so its own attributes are read through `.module` (a checkpoint keeps the
    model's keys, without the `module.` prefix); `nets.g.state_dict()` too in a dict with
    attribute access (`Munch`)."""
    for name, statement in collections:
        container = tree.scope(statement)
        attribute_items = classes.get(name, "") not in ("", "OrderedDict")

        def item(node: cst.Attribute, name=name, attribute_items=attribute_items) -> bool:
            value = node.value
            if attribute_items and isinstance(value, cst.Attribute):
                return dotted(value.value) == name and value.attr.value not in DICT_METHODS
            return _item_of(value, name)

        for attr in tree.find(cst.Attribute, item):
            later = tree.after(attr, statement) and not tree.inside(attr, statement)
            if not later or tree.scope(attr) is not container or attr.attr.value in MODULE_API:
                continue
            _read_through_module(tree, plan, edits, attr, tree.code(attr.value))


def _branch_of(tree: Tree, statement: cst.BaseStatement) -> cst.CSTNode | None:
    """The block of an `if` (not the `__main__` guard) that holds the wrap `statement`:
    `if use_cuda: model = DDP(model.cuda(), ...)` leaves a plain `model` on the other path."""
    block = tree.block(statement)
    owner = tree.parent.get(block)
    if isinstance(owner, cst.Else):
        owner = tree.parent.get(owner)
    if isinstance(owner, cst.If) and owner is not tree.main_guard():
        return block
    return None


def _note_wrapped_on_some_paths(
    tree: Tree, plan: Plan, name: str, statement: cst.BaseStatement, attr: cst.Attribute
) -> None:
    """`.module` would raise AttributeError where the wrap did not run: left as it is."""
    owner = tree.parent[tree.block(statement)]
    if isinstance(owner, cst.Else):
        owner = tree.parent[owner]
    condition = _first_line(tree.code(owner))
    plan.needs_human(
        f"`{name}` is wrapped in DDP on one branch of `{condition}` only, so "
        f"`{name}.{attr.attr.value}` "
        f"is left as it is (`{name}.module` would fail on the other path); wrap `{name}` on "
        f"every path, then reach it through `{name}.module` (DDP032, DDP051)",
        tree.code(tree.statement(attr)),
    )


def _read_through_module(
    tree: Tree,
    plan: Plan,
    edits: Edits,
    attr: cst.Attribute,
    shown: str,
    maybe_wrapped: bool = False,
) -> str:
    """`x.state_dict` -> `x.module.state_dict` on a DDP wrapper `x` (`getattr(x, "module",
    x).state_dict` where `x` is a wrapper on some calls only), and the report line; the
    code of the pitfall it avoids."""
    value = tree.code(attr.value)
    through = f'getattr({value}, "module", {value})' if maybe_wrapped else f"{value}.module"
    edits.replace(attr.value, snippets.expression(through))
    code = "DDP051" if attr.attr.value in ("state_dict", "load_state_dict") else "DDP032"
    plan.change(
        NAME,
        f"{shown}.{attr.attr.value} -> {through.replace(value, shown)}.{attr.attr.value}",
        f"{through}.{attr.attr.value}",
        code,
    )
    return code


def _received_from_other_modules(tree: Tree, plan: Plan, edits: Edits) -> None:
    """A helper module's functions handed the wrapped model (`save(model, path)` called
    from the entry script) reach its attributes through `.module` too."""
    names = _wrapper_names(tree, plan)
    helpers = wrapper_receivers(tree, names)
    # A parameter other calls fill with a plain model (`save(ema.model, path)`) has no
    # `.module` there: it is reached as `getattr(p, "module", p)`.
    mixed = mixed_receivers(tree, names) if helpers else {}
    for attr in tree.find(cst.Attribute):
        receiver = dotted(attr.value)
        func = tree.function(attr)
        if func is None or attr.attr.value in MODULE_API:
            continue
        if receiver not in helpers.get(func.name.value, ()):
            continue
        if receiver not in [p.name.value for p in func.params.params]:
            continue
        if _is_call_target_of_wrapper(tree, attr):
            continue
        plain = receiver in mixed.get(func.name.value, ())
        _read_through_module(tree, plan, edits, attr, receiver, maybe_wrapped=plain)


def _wrapper_names(tree: Tree, plan: Plan) -> set[str]:
    """The names that hold a DDP wrapper once the project is migrated: the targets of its
    DDP calls, of the DataParallel calls this pass replaces (the trained owner where only
    a part was wrapped) and, for a bare model, the modules the optimizers train. Not
    `model` for `model.encoder = DDP(model.encoder)`: `model` keeps its own `state_dict`."""
    if plan.shape is Shape.SINGLE:
        return trained_model_names(tree)
    names: set[str | None] = set(ddp_wrapper_names(tree))
    if plan.shape is Shape.DATA_PARALLEL:
        for call in tree.view.calls_to(DATA_PARALLEL):
            target = bound_target(tree, call)
            names.add(target and (trained_owner_of_part(tree, target) or target))
    names.discard(None)
    return names  # type: ignore[return-value]


def _uses_after(tree: Tree, name: str, statement: cst.CSTNode) -> list[cst.Attribute]:
    """`name.attr` nodes that run after `statement` wrapped `name`."""
    sees = _wrapper_reader(tree, name, statement)
    # Only a path that starts from a name `sees` can accept is worth building (the file's
    # every attribute is asked).
    roots = sees.roots  # type: ignore[attr-defined]
    found = [
        attr
        for attr in tree.find(cst.Attribute)
        if root_name(attr.value) in roots and sees(attr, dotted(attr.value))
    ]
    return [a for a in found if not _is_call_target_of_wrapper(tree, a)]


def _saved_whole_after(tree: Tree, name: str, statement: cst.CSTNode) -> list:
    """`name` itself saved after `statement` wrapped it: `torch.save(model, path)`, or a
    value of the dict (an item of the list) saved (`{"model": model, "epoch": epoch}`),
    which would pickle the DDP wrapper."""
    sees = _wrapper_reader(tree, name, statement)
    return [
        saved
        for call in tree.calls_to("torch.save")
        for saved in _saved_objects(tree, call)
        if sees(saved, dotted(saved))
    ]


def _saved_objects(tree: Tree, call: cst.Call) -> list[cst.BaseExpression]:
    arg = find_arg(call, "obj", 0)
    if arg is None:
        return []
    value = arg.value
    if isinstance(value, cst.Name):  # `state = {"net": net, ...}; torch.save(state, path)`
        bound = only_value_in_function(tree, call, value.value)
        if isinstance(bound, (cst.Dict, cst.List, cst.Tuple)):
            value = bound
    if isinstance(value, cst.Dict):
        return [e.value for e in value.elements if isinstance(e, cst.DictElement)]
    if isinstance(value, (cst.List, cst.Tuple)):
        return [e.value for e in value.elements if isinstance(e, cst.Element)]
    return [value]


def _wrapper_reader(tree: Tree, name: str, statement: cst.CSTNode):
    """A test of (node, the dotted name it reads): whether it reads `name` holding the
    DDP wrapper `statement` made, in the wrap's scope after it, in a flat script's
    function that runs after a top-level wrap, or as the parameter of a helper the
    wrapper is handed to."""
    if name.startswith("self."):
        container = class_of(tree, statement) or tree.module
        helpers: dict[str, set[str]] = {}
    else:
        container = tree.scope(statement)
        helpers = wrapper_receivers(tree, {name})
    # A flat script's functions that run after a top-level wrap read the global wrapper.
    at_top = tree.scope(statement) is tree.module and statement in tree.module.body
    run_after = functions_run_after(tree, statement) if at_top else set()

    def sees(node: cst.CSTNode, receiver: str | None) -> bool:
        if receiver is None:
            return False
        later = tree.after(node, statement) and not tree.inside(node, statement)
        if receiver == name and tree.inside(node, container) and later:
            if tree.scope(node) is container or name.startswith("self."):
                return True
        if receiver == name and _reads_global_wrapper(tree, node, name, run_after):
            return True
        # Not the global: a helper's parameter of the same name the wrapper is handed to,
        # wherever the helper is defined (a notebook's `def translate(model, ...)` after
        # the wrap reads its own `model`).
        func = tree.function(node)
        if func is None or receiver not in helpers.get(func.name.value, ()):
            return False
        return receiver in [p.name.value for p in func.params.params]

    # The first name of every path `sees` can accept.
    sees.roots = {name.split(".")[0]}.union(*helpers.values())  # type: ignore[attr-defined]
    return sees


def _reads_global_wrapper(tree: Tree, node: cst.CSTNode, name: str, run_after: set) -> bool:
    """`net.state_dict()` in a top-level function that runs only after `net` was wrapped
    at the top level, and binds no `net` of its own."""
    function = tree.function(node)
    return (
        function is not None
        and function.name.value in run_after
        and reads_module_binding(tree, node, name)
    )


def _is_call_target_of_wrapper(tree: Tree, attr: cst.Attribute) -> bool:
    """The `model` in `model.module.x` is seen as `model.module`: already through .module."""
    return isinstance(attr.value, cst.Attribute) and attr.value.attr.value == "module"
