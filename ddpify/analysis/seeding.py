"""Seeding: which calls seed the global random streams, which helper functions are seeding
helpers (and through which parameter), and whether the datasets of a project draw random
augmentations from those streams.

`set_random_seed(seed)` imported from `utils/` seeds random, NumPy and torch exactly as the
three calls in its body would at the call site; a dataset in the package the script imports
its loaders from (found by a registry or a folder scan, never imported by name) augments
from the streams that seed feeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from ddpify.analysis.names import ImportMap
from ddpify.analysis.names import dotted as dotted_name
from ddpify.analysis.project import LocalFunctions, common_root, local_imports, text_and_digest
from ddpify.files import SourceError, read_bounded
from ddpify.walk import children

# Calls that seed a global random stream with their first argument.
SEED_CALLS = frozenset(
    {
        "torch.manual_seed",
        "torch.random.manual_seed",
        "torch.cuda.manual_seed",
        "torch.cuda.manual_seed_all",
        "random.seed",
        "numpy.random.seed",
        "transformers.set_seed",
        "transformers.trainer_utils.set_seed",
    }
)
# Calls that seed torch's global stream (the CPU one, and every GPU's).
TORCH_SEEDS = ("torch.manual_seed", "torch.random.manual_seed")
# How a project seeds torch (`torch_seeding`).
ALIKE = "alike"  # a seed call runs on every path: every rank draws the same numbers
CONDITIONAL = "conditional"  # only under a condition (`if args.seed is not None:`)
UNSEEDED = "unseeded"
# Libraries whose `Random*` transforms draw from the global streams.
AUGMENTATION_PACKAGES = ("torchvision.transforms", "albumentations", "kornia.augmentation")
# Python, NumPy and torch draws from the global streams.
DRAW_PACKAGES = ("random.", "numpy.random.", "torch.rand", "torch.randint", "torch.randn")
# Where a dataset makes its per-sample draws.
DATA_METHODS = frozenset({"__getitem__", "__iter__", "__next__"})
# Bounds on the project scan for dataset evidence (it runs only for a candidate finding).
MAX_PACKAGES = 8
MAX_MODULES_PER_PACKAGE = 40


def is_draw(name: str) -> bool:
    """`random.random`, `np.random.randint`, `torch.rand_like`: a draw, not a seeding, nor
    a generator of its own (`np.random.RandomState(0)`, `np.random.default_rng()`)."""
    last = name.rsplit(".", 1)[-1]
    own_stream = last[:1].isupper() or last == "default_rng"
    return name.startswith(DRAW_PACKAGES) and "seed" not in last and not own_stream


def draws_from_global_stream(call: cst.Call, imports: ImportMap) -> bool:
    """A draw from the global streams: not one given its own `generator=`
    (`torch.randperm(n, generator=g)` in a sampler)."""
    name = imports.qualify(call.func)
    if name is None or not is_draw(name):
        return False
    return not any(
        arg.keyword is not None and arg.keyword.value == "generator" for arg in call.args
    )


def is_random_transform(name: str) -> bool:
    """`torchvision.transforms.RandomResizedCrop`, `albumentations.RandomCrop`."""
    return name.startswith(AUGMENTATION_PACKAGES) and name.rsplit(".", 1)[-1].startswith("Random")


def seed_parameter(function: cst.FunctionDef, imports: ImportMap) -> tuple[int, str] | None:
    """(position, name) of the parameter a seeding helper passes, unchanged, to the calls
    that seed the global streams: `def set_random_seed(seed): random.seed(seed); ...`.

    None when the function seeds nothing with a parameter, or changes it first (`seed +=
    get_rank()`): such a helper decides the per-rank seed itself."""
    params = list(function.params.posonly_params) + list(function.params.params)
    names = [param.name.value for param in params]
    seeded: set[str] = set()
    for node in _nodes(function.body):
        if isinstance(node, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
            targets = node.targets if isinstance(node, cst.Assign) else [node]
            for target in targets:
                if isinstance(target.target, cst.Name) and target.target.value in names:
                    return None  # the seed is rebuilt inside: its meaning is the body's
        if isinstance(node, cst.Call) and node.args and imports.qualify(node.func) in SEED_CALLS:
            value = node.args[0].value
            if isinstance(value, cst.Name) and value.value in names:
                seeded.add(value.value)
    for position, name in enumerate(names):
        if name in seeded:
            return position, name
    return None


def augmenting_modules(local: LocalFunctions) -> list[Path]:
    """The modules of the packages the checked file imports whose datasets draw random
    augmentations from the global streams. Every module read is recorded as used by the
    result, so a cached "no evidence" is re-checked when one of them changes.

    Read: the local modules the file imports, and every module of a package it imports
    (`from basicsr.data import create_dataset` -> all of basicsr/data/*.py: datasets that
    a registry or a folder scan loads are never imported by name). A dataset augments when
    its `__getitem__` (or `__iter__`) draws, directly or through a function it calls that
    its module defines or imports from the project, or when the module builds a torchvision
    `Random*` transform."""
    if local.file is None:
        return []
    found = []
    for path, text, digest in _package_modules(local.file):
        local.used[str(path)] = digest
        if not any(word in text for word in ("__getitem__", "__iter__", "Random")):
            continue  # a textual filter before any parse
        parsed = local.parse(path)
        if parsed is not None and _augments(parsed[0], parsed[1], path, local):
            found.append(path)
    return found


def _package_modules(file: Path) -> Iterator[tuple[Path, str, str]]:
    """(path, text, sha256) of the local modules `file` imports and of the other modules
    of the packages among them."""
    try:
        text = read_bounded(file).decode("utf-8", errors="replace")
    except SourceError:
        return
    root = common_root([file])
    imported = {path for path, _ in local_imports(file, text, [file], root)}
    packages = sorted({path.parent for path in imported if path.name == "__init__.py"})
    modules = set(imported)
    for package in packages[:MAX_PACKAGES]:
        modules.update(sorted(package.glob("*.py"))[:MAX_MODULES_PER_PACKAGE])
    for path in sorted(modules):
        read = text_and_digest(path) if path != file else None
        if read is not None:
            yield path, *read


def _augments(module: cst.Module, imports: ImportMap, path: Path, local: LocalFunctions) -> bool:
    for node in _nodes(module):
        if isinstance(node, cst.Call):
            name = imports.qualify(node.func)
            if name is not None and is_random_transform(name):
                return True
        if isinstance(node, cst.FunctionDef) and node.name.value in DATA_METHODS:
            if _draws(node, imports) or _calls_a_drawing_function(node, path, local):
                return True
    return False


def _draws(function: cst.FunctionDef, imports: ImportMap) -> bool:
    return any(
        isinstance(node, cst.Call) and draws_from_global_stream(node, imports)
        for node in _nodes(function.body)
    )


def _calls_a_drawing_function(method: cst.FunctionDef, path: Path, local: LocalFunctions) -> bool:
    """`augment(imgs)` in `__getitem__`, `augment` defined in the module or imported from
    a local one (`from basicsr.data.transforms import augment`) and drawing there."""
    for node in _nodes(method.body):
        if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Name):
            continue
        callee = local.function_in(path, node.func.value)
        if callee is not None and _draws(callee.node, callee.imports):
            return True
    return False


def _nodes(root: cst.CSTNode) -> Iterator[cst.CSTNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(children(node))


@dataclass(frozen=True)
class TorchSeeding:
    kind: str  # ALIKE, CONDITIONAL or UNSEEDED
    call: cst.Call | None = None  # the first seed call, None when UNSEEDED
    condition: str | None = None  # the first line of the condition, when CONDITIONAL


# The global streams a script draws its batches from: their seed calls, and how a draw
# from each is spelled (qualified names; `np.random.choice`, `random.sample`).
STREAM_SEEDS = {
    "torch": TORCH_SEEDS,
    "numpy": ("numpy.random.seed",),
    "random": ("random.seed",),
}
STREAM_ADVICE = {
    "torch": "torch.manual_seed(0)",
    "numpy": "np.random.seed(0)",
    "random": "random.seed(0)",
}
_STREAM_DRAWS = {
    "torch": ("torch.rand", "torch.multinomial", "torch.normal"),
    "numpy": ("numpy.random.",),
    "random": ("random.",),
}


def drawn_streams(view) -> list[str]:
    """The global random streams (torch, numpy, random) the project's code draws from
    by name (`np.random.choice(...)`, `random.sample(...)`, `torch.randint(...)`), in that
    order; draws a library makes on its own (dropout, a loader's shuffle) are not seen."""
    found = set()
    for tree in view.trees:
        for call in tree.find(cst.Call):
            name = tree.qualify(call.func) or ""
            if not is_draw(name):
                continue
            found |= {s for s, prefixes in _STREAM_DRAWS.items() if name.startswith(prefixes)}
    return [stream for stream in STREAM_SEEDS if stream in found]


def stream_seeding(view, stream: str) -> TorchSeeding:
    """`torch_seeding` for one global stream: "torch", "numpy" or "random"."""
    calls = view.calls_to(*STREAM_SEEDS[stream])
    if not calls:
        return TorchSeeding(UNSEEDED)
    conditions = [_seed_condition(view, call) for call in calls]
    for call, condition in zip(calls, conditions):
        if condition is None:
            return TorchSeeding(ALIKE, call)
    first = conditions[0]
    return TorchSeeding(CONDITIONAL, calls[0], first.strip().splitlines()[0] if first else None)


def torch_seeding(view) -> TorchSeeding:
    """Whether every rank seeds torch's global stream alike: ALIKE when some seed call
    (`torch.manual_seed(0)`) runs on every path, CONDITIONAL when each one runs under a
    condition (`if args.seed is not None:`, or a seeding helper only called under one),
    UNSEEDED when the project never seeds torch. Code that splits one drawn batch by rank,
    or replicates a step on every rank, is exact only when the ranks draw alike."""
    return stream_seeding(view, "torch")


def _seed_condition(view, call: cst.Call) -> str | None:
    """The code of the condition a seed call runs under (the `if` test), or None when it
    runs on every path. A call inside a function counts as conditional when every call of
    that function by name is (a `set_seed(args.seed)` helper under `if args.seed:`)."""
    tree = view.owner(call)
    own = _condition_above(tree, call)
    if own is not None:
        return own
    function = tree.function(call)
    if function is None:
        return None
    name = function.name.value
    callers = view.find(cst.Call, lambda c: (dotted_name(c.func) or "").split(".")[-1] == name)
    if not callers:
        return None
    outer = [_condition_above(view.owner(c), c) for c in callers]
    return None if any(o is None for o in outer) else outer[0]


def _condition_above(tree, node: cst.CSTNode) -> str | None:
    """The test of the innermost `if` (or conditional expression) around `node` within its
    function, not the `__main__` guard; None when there is none."""
    guard = tree.main_guard()
    for above in reversed(tree.ancestors(node)):
        if isinstance(above, (cst.FunctionDef, cst.ClassDef)):
            return None
        if isinstance(above, (cst.If, cst.IfExp)) and above is not guard:
            return tree.code(above.test)
    return None
