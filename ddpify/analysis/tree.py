"""A parsed module with the lookups every pass needs: parents, order, imports, scopes.

Passes analyse one `Tree`, plan edits keyed by the nodes they found, and apply them with
a transformer that compares `original_node` by identity; the next pass builds a new Tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

import libcst as cst

from ddpify.analysis.names import CANONICAL, ImportMap, dotted
from ddpify.walk import children

if TYPE_CHECKING:
    from ddpify.analysis.project import ProjectView

BLOCKS = (cst.Module, cst.IndentedBlock)
_IMPORTS = (cst.Import, cst.ImportFrom)
SCOPES = (cst.Module, cst.FunctionDef, cst.ClassDef, cst.Lambda)


class Tree:
    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.parent: dict[cst.CSTNode, cst.CSTNode] = {}
        self.order: dict[cst.CSTNode, int] = {}
        self.nodes: list[cst.CSTNode] = []
        self._by_kind: dict[type, list[cst.CSTNode]] = {}
        self._types: set[type] | None = None
        self.imports = ImportMap()
        # What the roles analysis searches: this tree, or every module of its project.
        self.view: Tree | ProjectView = self
        self._collect(module)

    def _collect(self, module: cst.Module) -> None:
        """Pre-order walk over the syntax nodes (ddpify.walk skips formatting children)."""
        stack: list[tuple[cst.CSTNode, cst.CSTNode | None]] = [(module, None)]
        while stack:
            node, parent = stack.pop()
            if parent is not None:
                self.parent[node] = parent
            self.order[node] = len(self.nodes)
            self.nodes.append(node)
            if type(node) in _IMPORTS:  # not isinstance: ABCMeta's check is slow here
                self.imports.add(node)
            stack.extend((child, node) for child in reversed(list(children(node))))

    # -- structure -------------------------------------------------------------------

    def ancestors(self, node: cst.CSTNode) -> list[cst.CSTNode]:
        """From the module down to `node` itself."""
        chain = [node]
        while chain[-1] in self.parent:
            chain.append(self.parent[chain[-1]])
        return chain[::-1]

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement | None:
        """The statement in a block that contains `node` (itself, if it is one)."""
        current: cst.CSTNode | None = node
        while current is not None:
            parent = self.parent.get(current)
            if isinstance(current, cst.BaseStatement) and isinstance(parent, BLOCKS):
                return current
            current = parent
        return None

    def block(self, statement: cst.BaseStatement) -> cst.Module | cst.IndentedBlock:
        return self.parent[statement]  # type: ignore[return-value]

    def scope(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost function, class or module around `node`."""
        current = self.parent.get(node)
        while current is not None and not isinstance(current, SCOPES):
            current = self.parent.get(current)
        return current or self.module

    def function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        current = self.parent.get(node)
        while current is not None and not isinstance(current, cst.FunctionDef):
            current = self.parent.get(current)
        return current

    def inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        current: cst.CSTNode | None = node
        while current is not None:
            if current is container:
                return True
            current = self.parent.get(current)
        return False

    def owns(self, node: cst.CSTNode) -> bool:
        """Whether `node` belongs to this module (not to another module of the project)."""
        return node in self.order

    def after(self, node: cst.CSTNode, anchor: cst.CSTNode) -> bool:
        return self.order[node] > self.order[anchor]

    # -- queries ---------------------------------------------------------------------

    def qualify(self, expr: cst.BaseExpression) -> str | None:
        return self.imports.qualify(expr)

    def find(self, kind: type, where: Callable[[cst.CSTNode], bool] | None = None) -> list:
        """Nodes of `kind` (subclasses too) in source order, optionally filtered."""
        found = self._of_kind(kind)
        return list(found) if where is None else [n for n in found if where(n)]

    def _of_kind(self, kind: type) -> list:
        # Passes ask many times per tree; one scan per kind, kept for the tree's life.
        found = self._by_kind.get(kind)
        if found is None:
            # By exact type (a set lookup), not isinstance (ABCMeta's check, per node).
            if self._types is None:
                self._types = {type(n) for n in self.nodes}
            kinds = {t for t in self._types if issubclass(t, kind)}
            found = self._by_kind[kind] = [n for n in self.nodes if type(n) in kinds]
        return found

    def calls_to(self, *names: str) -> list[cst.Call]:
        return self.find(cst.Call, lambda c: self.qualify(c.func) in names)

    def within(self, container: cst.CSTNode, kind: type = cst.CSTNode) -> Iterator:
        """Nodes of `kind` inside `container`, in source order."""
        start = self.order[container]
        for node in self.nodes[start + 1 :]:
            if not self.inside(node, container):
                break
            if isinstance(node, kind):
                yield node

    def alias_for(self, qualified: str) -> str | None:
        """The local name an import binds to `qualified` (e.g. `dist`), if any."""
        for local, full in self.imports.aliases.items():
            if CANONICAL.get(full, full) == qualified:
                return local
        return None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def functions(self) -> dict[str, cst.FunctionDef]:
        found: dict[str, cst.FunctionDef] = {}
        for func in self.find(cst.FunctionDef):
            found.setdefault(func.name.value, func)
        return found

    def main_guard(self) -> cst.If | None:
        for stmt in self.module.body:
            if isinstance(stmt, cst.If) and is_main_test(stmt.test):
                return stmt
        return None


def is_main_test(test: cst.BaseExpression) -> bool:
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return False
    right = test.comparisons[0].comparator
    return (
        dotted(test.left) == "__name__"
        and isinstance(right, cst.SimpleString)
        and right.evaluated_value == "__main__"
    )


def names_in(node: cst.CSTNode) -> set[str]:
    """Every dotted Name/Attribute chain in `node` (`self.model`, `model`, `self`)."""
    found: set[str] = set()

    class _Visit(cst.CSTVisitor):
        def visit_Attribute(self, n: cst.Attribute) -> None:
            name = dotted(n)
            if name:
                found.add(name)

        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

    node.visit(_Visit())
    return found


def mentions(node: cst.CSTNode, name: str) -> bool:
    return name in names_in(node)


def parse_statements(code: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(code).body)


def indent_of(tree: Tree, statement: cst.BaseStatement) -> str:
    """The indentation (relative to the module) of a statement's block, for templates."""
    depth = sum(1 for a in tree.ancestors(statement) if isinstance(a, cst.IndentedBlock))
    return "    " * depth
