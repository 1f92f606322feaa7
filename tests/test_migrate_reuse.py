"""What the migration pipeline reuses between passes gives the answers it gives without
reuse: a tree built from the one before a pass (reusing the walk of the statements the
pass left alone) answers as one built from scratch; the comments counted per statement
are the ones tokenize finds in the whole text; the compile gate that compiles only what
a pass wrote still names the pass whose output does not compile."""

from __future__ import annotations

from collections import Counter

import libcst as cst
import pytest

from ddpify.analysis.tree import Tree
from ddpify.codegen import ModuleText
from ddpify.gates import GateError, comments
from ddpify.migrate import migrate_source
from ddpify.migrate.edits import Edits
from ddpify.migrate.pipeline import PASSES
from ddpify.migrate.snippets import expression, nested_under, statement
from tests.helpers import FIXTURES

SCRIPT = (FIXTURES / "migrate" / "single_main_argparse" / "before.py").read_text()


def _edited(tree: Tree) -> cst.Module:
    """Guard every print, add an import, move `.cuda()` calls: edits at several depths."""
    edits = Edits()
    for call in tree.find(cst.Call):
        if isinstance(call.func, cst.Name) and call.func.value == "print":
            edits.replace(
                tree.statement(call), statement(f"if RANK == 0:\n    {tree.code(call)}\n")
            )
        elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "cuda":
            edits.replace(call, expression(f"{tree.code(call.func.value)}.to(device)"))
    edits.before[tree.module.body[0]].append(statement("import os\n"))
    return edits.apply(tree.module, tree.parent)


def _answers(tree: Tree) -> tuple:
    return (
        tree.nodes,
        tree.order,
        tree.parent,
        tree.imports.aliases,
        tree.imports.modules,
        tree.find(cst.Call),
        tree.find(cst.BaseStatement),
        tree.find(cst.Module),
        tree.calls_to("torch.save", "os.environ.get"),
        tree.functions(),
    )


def test_a_tree_reusing_the_previous_walk_answers_as_a_fresh_one():
    before = Tree(cst.parse_module(SCRIPT))
    before.find(cst.Call)  # per-kind lists made before the edit are reused too
    before.calls_to("torch.save")
    module = _edited(before)
    reused = Tree(module, previous=before)
    fresh = Tree(module)
    assert _answers(reused) == _answers(fresh)
    assert reused.text == fresh.text == module.code
    unchanged = [s for s in module.body if s in before.module.body]
    assert unchanged and len(unchanged) < len(module.body)  # the edit kept some, not all
    assert all(reused._segment_of[s] is before._segment_of[s] for s in unchanged)
    for container in [*fresh.find(cst.FunctionDef), *fresh.find(cst.For)]:
        assert list(reused.within(container)) == list(fresh.within(container))


def test_edits_applied_along_their_paths_give_libcsts_full_visit():
    """Edits of every kind, at several depths: rebuilding only the paths down to them
    gives the module that visiting every node gives, and leaves the rest as it was."""
    tree = Tree(cst.parse_module(SCRIPT))
    edits = Edits()
    calls = tree.find(cst.Call)
    prints = [c for c in calls if isinstance(c.func, cst.Name) and c.func.value == "print"]
    functions = tree.find(cst.FunctionDef)
    assert prints and len(functions) >= 2 and len(calls) > 4
    edits.group([tree.statement(prints[0])], nested_under(statement("if RANK == 0:\n    pass\n")))
    edits.removed.add(tree.statement(calls[len(calls) // 2]))
    edits.after[tree.statement(calls[0])].append(statement("log('after')\n"))
    edits.prepend[functions[1]].append(statement("begin()\n"))
    edits.replace(calls[-1].func, expression("replaced"))
    edits.before[tree.module.body[-1]].append(statement("import os\n"))
    along = edits.apply(tree.module, tree.parent)
    visited = edits.apply(tree.module)
    assert along.deep_equals(visited) and along.code == visited.code != tree.module.code
    kept = [s for s in along.body if any(s is old for old in tree.module.body)]
    assert kept and len(kept) < len(along.body)


def _copies_spied(monkeypatch) -> list:
    """The statements whose walk the trees made from now on copy (in order)."""
    from ddpify.analysis import tree as tree_module

    copied = []
    real = tree_module._Segment._copy

    def counting(self, node, *args):
        copied.append(node)
        return real(self, node, *args)

    monkeypatch.setattr(tree_module._Segment, "_copy", counting)
    return copied


def test_rebuilt_statements_copy_the_walks_of_the_statements_they_kept(monkeypatch):
    """A pass rebuilds the path to its edit: the statements beside it inside a function
    are the same objects, and the next tree copies their walk; two generations on, the
    trees still answer as fresh ones."""
    copied = _copies_spied(monkeypatch)
    first = Tree(cst.parse_module(SCRIPT))
    second = Tree(_edited(first), previous=first)
    assert copied  # the statements beside the guarded prints were not walked again
    assert _answers(second) == _answers(Tree(second.module))
    third_module = _edited(second)
    third = Tree(third_module, previous=second)
    assert _answers(third) == _answers(Tree(third_module))


def test_a_walk_made_trees_ago_is_copied_and_answers_as_a_fresh_walk(monkeypatch):
    """The walks a tree copies from are every walk of the run so far, not only the tree
    just before: a function's statements that the second tree dropped and the third put
    back in a new function are copied from the first tree's walk."""
    copied = _copies_spied(monkeypatch)
    first = Tree(cst.parse_module(SCRIPT))
    main = next(s for s in first.module.body if isinstance(s, cst.FunctionDef))
    dropped = first.module.with_changes(body=[s for s in first.module.body if s is not main])
    second = Tree(dropped, previous=first)
    assert not copied
    again = main.with_changes(name=cst.Name("again"))  # the same statements inside
    third_module = dropped.with_changes(body=[*dropped.body, again])
    third = Tree(third_module, previous=second)
    assert {id(n) for n in copied} == {id(n) for n in main.body.body}
    assert _answers(third) == _answers(Tree(third_module))


def test_imports_inside_a_copied_walk_are_the_trees_imports(monkeypatch):
    """An import inside a statement whose walk is copied (a function rebuilt around an
    untouched `if` that imports) is still one of the tree's imports, two trees on."""
    copied = _copies_spied(monkeypatch)
    first = Tree(
        cst.parse_module(
            "def setup(distributed):\n"
            "    print('setting up')\n"
            "    if distributed:\n"
            "        import torch.distributed as dist\n"
            "        from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "    return 1\n"
        )
    )
    trees = [first]
    for _ in range(2):
        module = _edited(trees[-1])
        trees.append(Tree(module, previous=trees[-1]))
        assert _answers(trees[-1]) == _answers(Tree(module))
    assert any(isinstance(node, cst.If) for node in copied)
    assert trees[-1].imports.aliases["dist"] == "torch.distributed"
    assert trees[-1].imports.aliases["DDP"].endswith("DistributedDataParallel")


def test_a_parent_map_edited_from_the_previous_tree_is_the_one_a_fresh_walk_makes(
    monkeypatch,
):
    """A tree's parent map is the previous tree's, less what a pass dropped, plus what
    it made; with one statement object in three places (a pass inserting one snippet
    in several, then removing them) it is what a fresh walk makes, in each tree."""
    edited = []
    real = Tree._parents_edited

    def spy(self, previous, made):
        found = real(self, previous, made)
        edited.append(found is not None)
        return found

    monkeypatch.setattr(Tree, "_parents_edited", spy)
    first = Tree(cst.parse_module(SCRIPT))
    main = next(s for s in first.module.body if isinstance(s, cst.FunctionDef))
    line = main.body.body[0]
    twice = main.with_changes(body=main.body.with_changes(body=[line, *main.body.body]))
    trees = [first]
    moved = main.body.body[1]
    without = main.with_changes(body=main.body.with_changes(body=[line, *main.body.body[2:]]))
    for body in (
        # `line` twice in main and once at the end of the module
        [*[twice if s is main else s for s in first.module.body], line],
        list(first.module.body),  # once again
        # a line moved out of main to the top, and the last statement dropped
        [moved, *[without if s is main else s for s in first.module.body[:-1]]],
    ):
        module = first.module.with_changes(body=body)
        reused = Tree(module, previous=trees[-1])
        fresh = Tree(module)
        assert reused.parent == fresh.parent
        assert [reused.parent[n] for n in fresh.nodes[1:]] == [
            fresh.parent[n] for n in fresh.nodes[1:]
        ]
        trees.append(reused)
    assert [tree._unique for tree in trees] == [True, False, True, True]
    # The map with a node twice and the one after it (its previous has a node twice) are
    # made by a fresh walk; the last one is edited.
    assert edited == [False, False, True]


def test_comments_counted_per_statement_are_the_whole_texts():
    text = (
        "#!/usr/bin/env python\n"
        "# header\n\n"
        "import torch  # trailing\n"
        's = "# not a comment"\n'
        "def f():\n"
        "    x = '''\n# inside a string\n'''\n"
        "    # at the end of the block\n"
        "    return x\n"
        "    # footer of the block\n"
        "# before g\n"
        "g = [\n    1,  # in brackets\n]\n"
        "# last line\n"
    )
    module = cst.parse_module(text)
    render = ModuleText()
    assert render.comments(module) == comments(text)
    edited = module.with_changes(body=[*module.body[:2], statement("y = 2  # new\n")])
    assert render.comments(edited) == comments(edited.code)


def test_lost_comments_count_only_the_statements_a_rewrite_changed():
    text = (
        "import torch  # trailing\n"
        "# above f\n"
        "def f():\n"
        "    return 1  # one\n"
        "    # footer of f\n"
        "x = f()  # twice\n"
        "y = f()  # twice\n"
    )
    module = cst.parse_module(text)
    render = ModuleText()
    # Drops `# one` and one `# twice`, keeps `# above f` on a new statement.
    dropped = module.with_changes(
        body=[module.body[0], statement("# above f\ndef f():\n    return 2\n"), module.body[2]]
    )
    # Moves `# trailing` onto a rewritten statement: nothing lost.
    moved = module.with_changes(
        body=[statement("import torch, os  # trailing\n"), *module.body[1:]]
    )
    for edited in (dropped, moved):
        expected = comments(text) - comments(edited.code)
        assert render.lost_comments(module, edited) == expected
    assert render.lost_comments(module, dropped) == Counter(
        {"# one": 1, "# footer of f": 1, "# twice": 1}
    )
    assert not render.lost_comments(module, moved)


def _insert_first(code: str):
    """A broken pass: puts `code` above the first statement, leaving that one as it was."""

    def run(tree, plan):
        edits = Edits()
        edits.before[tree.module.body[0]].append(cst.parse_statement(code))
        return edits

    return run


def test_a_pass_that_moves_the_future_import_off_the_top_is_named():
    # What the pass wrote (`x = 1`) compiles alone; the module around it does not.
    script = "from __future__ import annotations\n" + SCRIPT
    passes = [*PASSES[:2], ("broken", _insert_first("x = 1\n"))]
    with pytest.raises(GateError) as info:
        migrate_source(script, "t.py", passes=passes)
    assert info.value.pass_name == "broken"
    assert "does not compile" in info.value.reason
