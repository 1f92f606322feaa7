"""Part of pass 5, data: shard a training loader that draws with a WeightedRandomSampler
(class-balanced sampling) while keeping its distribution.

A DistributedSampler would replace the weighted draw with a uniform one. Instead the
sampler call becomes `DistributedWeightedSampler(...)`, a small class the migration
writes once into the module (snippets.WEIGHTED_SAMPLER): every rank draws the same
`num_samples` indices with a generator seeded alike (seed + epoch), drops the remainder
to a multiple of WORLD_SIZE and keeps `indices[RANK::WORLD_SIZE]`. Each rank keeps the
per-process batch, so the global batch is WORLD_SIZE times the original's, drawn from
the original's distribution; per step it is not the original's exact draw (the original
draws from the global RNG).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.tree import Tree
from ddpify.analysis.unsplittable import DrawingLoader, drawing_loaders
from ddpify.migrate import snippets
from ddpify.migrate.analyze import Loader, Plan
from ddpify.migrate.edits import Edits

NAME = "data"
WEIGHTED = "WeightedRandomSampler"
POLICY = (
    "the training loader's WeightedRandomSampler is shared out by rank "
    f"(`{snippets.WEIGHTED_SAMPLER_CLASS}`): every rank draws the same num_samples indices "
    "with a generator seeded alike (seed 0 + the epoch, which moves on with each pass or "
    "with set_epoch), drops the last num_samples % WORLD_SIZE and keeps every "
    "WORLD_SIZE-th from RANK; the per-process batch is the original's, so the global batch "
    "is WORLD_SIZE times larger and is drawn from the original's weights (not the "
    "original's exact draw, which came from the global RNG)"
)


def weighted_loader(tree: Tree, loader: Loader) -> DrawingLoader | None:
    """The weighted draw behind `loader`'s `sampler=`, if it is a WeightedRandomSampler."""
    for drawing in drawing_loaders(tree):
        if drawing.call is loader.call and drawing.kind == WEIGHTED:
            return drawing
    return None


def converted_sampler(tree: Tree, value: cst.BaseExpression) -> bool:
    """Whether `sampler=value` is (bound from) the class this pass writes: a second
    migration leaves it be."""
    name = snippets.WEIGHTED_SAMPLER_CLASS
    func = tree.function(value)
    if isinstance(value, cst.Call):
        return _calls(value, name) or _returns_class(tree, value, name)
    target = value.value if isinstance(value, cst.Name) else None
    scope = func if func is not None else tree.module
    for assign in tree.within(scope, cst.Assign):
        if any(isinstance(t.target, cst.Name) and t.target.value == target for t in assign.targets):
            if isinstance(assign.value, cst.Call) and converted_sampler(tree, assign.value):
                return True
    return False


def _calls(call: cst.Call, name: str) -> bool:
    return isinstance(call.func, cst.Name) and call.func.value == name


def _returns_class(tree: Tree, call: cst.Call, name: str) -> bool:
    """`_make_balanced_sampler(labels)` whose function returns `name(...)`."""
    if not isinstance(call.func, cst.Name):
        return False
    func = tree.view.functions().get(call.func.value)
    if func is None:
        return False
    returns = tree.view.within(func, cst.Return)
    return any(isinstance(r.value, cst.Call) and _calls(r.value, name) for r in returns)


def shard_weighted(tree: Tree, plan: Plan, edits: Edits, drawing: DrawingLoader) -> None:
    """Replace the weighted sampler call by the distributed one, where this module holds
    it (else the migration of the module that does replaces it)."""
    sampler = drawing.sampler
    if not tree.owns(sampler):
        return
    torch = tree.alias_for("torch")
    name = snippets.WEIGHTED_SAMPLER_CLASS
    if isinstance(sampler.func, cst.Name):
        plan.replaced_names.add(sampler.func.value)
    edits.replace(sampler, lambda updated: updated.with_changes(func=cst.Name(name)))
    if name not in {c.name.value for c in tree.find(cst.ClassDef)}:
        code = snippets.WEIGHTED_SAMPLER.format(name=name, torch=torch or "torch")
        if torch is None:
            code = "import torch\n" + code
        anchor = _top_level(tree, tree.statement(sampler))
        edits.before[anchor].extend(snippets.statements(code))
    plan.change(NAME, POLICY, f"{name}(")


def _top_level(tree: Tree, node: cst.CSTNode) -> cst.CSTNode:
    """The module-level statement that holds `node`."""
    for ancestor in reversed(tree.ancestors(node)):
        if ancestor in tree.module.body:
            return ancestor
    return node
