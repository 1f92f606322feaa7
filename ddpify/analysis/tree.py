"""A parsed module with the lookups every pass needs: parents, order, imports, scopes.

Passes analyse one `Tree`, plan edits keyed by the nodes they found, and apply them with
a transformer that compares `original_node` by identity; the next pass builds a new Tree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Callable

import libcst as cst

from ddpify.analysis.names import CANONICAL, ImportMap, dotted
from ddpify.codegen import node_code
from ddpify.libcst_speed import parse_module
from ddpify.walk import child_list, children, walk

if TYPE_CHECKING:
    from ddpify.analysis.project import ProjectView

BLOCKS = (cst.Module, cst.IndentedBlock)
_IMPORTS = (cst.Import, cst.ImportFrom)
# The statements a segment records the walk of (by exact type, see _Segment).
_STATEMENTS = frozenset(
    {
        cst.SimpleStatementLine,
        cst.FunctionDef,
        cst.ClassDef,
        cst.If,
        cst.For,
        cst.While,
        cst.With,
        cst.Try,
        cst.TryStar,
        cst.Match,
    }
)
SCOPES = (cst.Module, cst.FunctionDef, cst.ClassDef, cst.Lambda)


class Tree:
    """One module's syntax nodes in source order, each node's parent, its imports.

    The walk is kept per top-level statement (a `_Segment`). Nodes are immutable, so a
    statement object that a pass left alone is the same subtree in the next tree: with
    `previous` (the tree before the pass) its segment is reused, not walked again, and
    a pass costs the statements it rebuilt, not the file. `text`, when known, is the
    module's code (saves rendering it for `Tree.text`); else `render` makes it when
    asked (migrate's renderer reuses the code of statements it rendered before)."""

    def __init__(
        self,
        module: cst.Module,
        text: str | None = None,
        previous: Tree | None = None,
        render: Callable[[cst.Module], str] | None = None,
    ) -> None:
        self.module = module
        self._text = text
        self._render = render
        self._by_kind: dict[type, list[cst.CSTNode]] = {}
        self._order: Mapping[cst.CSTNode, int] | None = None
        self._nodes: list[cst.CSTNode] | None = None
        self._parent_ids: list[int] | None = None
        self._call_names: list[tuple[cst.Call, str | None, str | None]] | None = None
        self._calls_by_name: dict[str | None, list[int]] | None = None
        self._names: frozenset[str] | None = None
        self._top_functions: dict[str, cst.FunctionDef] | None = None
        self.imports = ImportMap()
        self._view: ProjectView | None = None
        self._collect(module, previous)

    @classmethod
    def from_walk(cls, module: cst.Module, parents: dict[cst.CSTNode, cst.CSTNode]) -> Tree:
        """The Tree of a walk already made: `parents` holds each node below the module
        with its parent, in the pre-order of `ddpify.walk` (the lint engine's one
        traversal records it), so the rules' questions cost no second walk. Its nodes
        make one segment (such a tree is never the `previous` of another)."""
        tree = cls.__new__(cls)
        tree.module = module
        tree._text = None
        tree._render = None
        tree._by_kind = {}
        tree._order = None
        tree._nodes = None
        tree._parent_ids = None
        tree._call_names = None
        tree._calls_by_name = None
        tree._names = None
        tree._top_functions = None
        tree._view = None
        tree.parent = parents  # read only, like the engine's own use of it
        segment = _Segment.flat(list(parents))
        tree._segment_of = {}
        tree._segments = [segment]
        tree._walked = _Walked()
        tree._unique = False  # never asked: such a tree is never the `previous` of another
        tree.imports = ImportMap()
        for node in segment.of_kind(_IMPORTS):  # type: ignore[arg-type]
            tree.imports.add(node)
        return tree

    def _collect(self, module: cst.Module, previous: Tree | None) -> None:
        known = previous._segment_of if previous is not None else {}
        # Shared with the trees before and after this one (see _Walked).
        walked = previous._walked if previous is not None else _Walked()
        self._walked = walked
        self._segment_of: dict[cst.CSTNode, _Segment] = {}
        self._segments: list[_Segment] = []
        made: list[_Segment] = []
        for statement in children(module):
            segment = known.get(statement) or self._segment_of.get(statement)
            if segment is None:
                segment = _Segment(statement, walked)
                walked.add(segment)
                made.append(segment)
            self._segment_of[statement] = segment
            self._segments.append(segment)
            for node in segment.imports:
                self.imports.add(node)
        # Every node below the module, counting one that occurs twice twice.
        self._size = sum(len(segment.inner) + 1 for segment in self._segments)
        parent = self._parents_edited(previous, made) if previous is not None else None
        self.parent = parent if parent is not None else self._parents()
        # Whether no node occurs twice (the parent map then holds each node once).
        self._unique = len(self.parent) == self._size

    def _parents(self) -> dict[cst.CSTNode, cst.CSTNode]:
        parent: dict[cst.CSTNode, cst.CSTNode] = {}
        module = self.module
        for segment in self._segments:
            # In walk order, so a node that occurs twice keeps its last parent.
            parent[segment.statement] = module
            parent.update(zip(segment.inner, segment.parents))
        return parent

    def _parents_edited(
        self, previous: Tree, made: list[_Segment]
    ) -> dict[cst.CSTNode, cst.CSTNode] | None:
        """`_parents()`, made from the previous tree's map: a copy (no node hashed again),
        less the statements the pass dropped, plus the ones it made. None when a node
        occurs twice in either tree: its parent then depends on the order of the walk."""
        if not previous._unique:
            return None
        parent = previous.parent.copy()
        kept = self._segment_of
        for statement, segment in previous._segment_of.items():
            if statement not in kept:
                del parent[statement]
                for node in segment.inner:
                    del parent[node]
        module = self.module
        for statement in kept:
            parent[statement] = module
        for segment in made:
            parent.update(zip(segment.inner, segment.parents))
        # With no node twice here, the map holds this tree's nodes, each once, each with
        # its one parent; a node twice shows as fewer keys than nodes.
        return parent if len(parent) == self._size else None

    @property
    def view(self) -> Tree | ProjectView:
        """What the roles analysis searches: this tree, or every module of its project.
        (Not kept as a reference to itself: a tree with no project would be a cycle,
        freed only by the cyclic collector, which migrate turns off.)"""
        return self if self._view is None else self._view

    @view.setter
    def view(self, view: Tree | ProjectView) -> None:
        self._view = None if view is self else view  # type: ignore[assignment]

    @property
    def trees(self) -> list[Tree]:
        """The modules the view searches: its project's, or this tree alone."""
        return [self] if self._view is None else self._view.trees

    @property
    def nodes(self) -> list[cst.CSTNode]:
        """Every syntax node, pre-order (the module first)."""
        if self._nodes is None:
            nodes: list[cst.CSTNode] = [self.module]
            for segment in self._segments:
                if segment.statement is not None:  # None: a flat segment (`from_walk`)
                    nodes.append(segment.statement)
                nodes.extend(segment.inner)
            self._nodes = nodes
        return self._nodes

    @property
    def order(self) -> Mapping[cst.CSTNode, int]:
        """Each node's index in `nodes` (the last one, for a node that occurs twice)."""
        if self._order is None:
            if self._segment_of:
                self._order = _SegmentedOrder(self)
            else:  # one flat segment (`from_walk`)
                self._order = dict(zip(self.nodes, range(len(self.nodes))))
        return self._order

    @property
    def top_functions(self) -> dict[str, cst.FunctionDef]:
        """The functions defined at the module's top level, by name (the later def wins,
        as in Python). Read only: kept for the tree, since rules ask it per call."""
        if self._top_functions is None:
            body = self.module.body
            self._top_functions = {s.name.value: s for s in body if type(s) is cst.FunctionDef}
        return self._top_functions

    @property
    def text(self) -> str:
        """The module's code (rendered once per tree)."""
        if self._text is None:
            self._text = self.module.code if self._render is None else self._render(self.module)
        return self._text

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

    def owner(self, node: cst.CSTNode) -> Tree:
        """The module that holds `node`: for one module's tree, the tree itself (a
        `ProjectView` answers the same question with the module a node belongs to), so
        code that takes either asks `view.owner(node)` alike."""
        return self

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
        # Passes ask many times per tree; one list per kind, kept for the tree's life and
        # made of the segments' own lists (reused with the segment).
        found = self._by_kind.get(kind)
        if found is None:
            found = [self.module] if isinstance(self.module, kind) else []
            for segment in self._segments:
                found.extend(segment.of_kind(kind))
            self._by_kind[kind] = found
        return found

    def names(self) -> frozenset[str]:
        """Every identifier the module spells: variables, attributes (`nn.BatchNorm2d`
        gives `nn` and `BatchNorm2d`), keywords of calls. What passes ask before a search
        (not the module's text: rendering it costs more than the search it spares)."""
        if self._names is None:
            self._names = frozenset().union(*(segment.names() for segment in self._segments))
        return self._names

    def names_in(self, node: cst.CSTNode) -> frozenset[str]:
        """The identifiers inside `node`: for a top-level statement, its segment's (kept
        with the segment, so a definition a pass left alone costs nothing again)."""
        segment = self._segment_of.get(node)
        if segment is not None:
            return segment.names()
        return frozenset(name.value for name in self.within(node, cst.Name))

    def calls_where(self, test: Callable[[cst.Call], bool]) -> list[cst.Call]:
        """The calls `test` holds for, in source order. `test` reads the call's own syntax
        alone (no tree), so its answers are kept per segment and test."""
        return [call for segment in self._segments for call in segment.calls_where(test)]

    def calls_to(self, *names: str) -> list[cst.Call]:
        """The calls whose callee qualifies to one of `names`, in source order."""
        if self._calls_by_name is None:
            # Passes ask per name, many times per tree: index the calls once.
            by_name: dict[str | None, list[int]] = {}
            for index, (_, _, name) in enumerate(self.call_names()):
                by_name.setdefault(name, []).append(index)
            self._calls_by_name = by_name
        places = [i for name in dict.fromkeys(names) for i in self._calls_by_name.get(name, ())]
        if len(names) > 1:
            places.sort()
        triples = self.call_names()
        return [triples[i][0] for i in places]

    def qualified_calls(self) -> list[tuple[cst.Call, str | None]]:
        """Every call, in source order, with `qualify(call.func)`."""
        return [(call, qualified) for call, _, qualified in self.call_names()]

    def call_names(self) -> list[tuple[cst.Call, str | None, str | None]]:
        """Every call, in source order, with `dotted(call.func)` and `qualify(call.func)`."""
        if self._call_names is None:
            # Qualify each callee's dotted path once per tree (the imports may differ
            # between trees; the paths are the segments', reused with them).
            memo: dict[str | None, str | None] = {None: None}
            triples = []
            for segment in self._segments:
                for call, path in segment.call_paths():
                    if path not in memo:
                        memo[path] = self.imports.qualify(call.func)
                    triples.append((call, path, memo[path]))
            self._call_names = triples
        return self._call_names

    def within(self, container: cst.CSTNode, kind: type = cst.CSTNode) -> Iterator:
        """Nodes of `kind` inside `container`, in source order."""
        nodes = self.nodes
        start = self.order[container] + 1
        parent_ids = self._positional_parents()
        if parent_ids is None:  # a node occurs twice: ask `inside`, as the parent map says
            for index in range(start, len(nodes)):
                node = nodes[index]
                if not self.inside(node, container):
                    break
                if isinstance(node, kind):
                    yield node
            return
        # In pre-order the nodes inside `container` follow it, each after its parent: a
        # node is inside when its parent is the container or a node found inside (a set
        # lookup per node, not a walk up to the container per node).
        found = {id(container)}
        answers = _kind_answers(kind)
        for index in range(start, len(nodes)):
            if parent_ids[index] not in found:
                break
            node = nodes[index]
            found.add(id(node))
            matches = answers.get(type(node))
            if matches is None:
                matches = answers[type(node)] = issubclass(type(node), kind)
            if matches:
                yield node

    def _positional_parents(self) -> list[int] | None:
        """The id of each node's parent, aligned with `nodes` (0 for the module), or None
        when some node occurs twice (the parent map then keeps only its last parent)."""
        if self._parent_ids is None:
            nodes = self.nodes
            if len(self.order) != len(nodes):
                return None
            ids = [0]
            module_id = id(self.module)
            for segment in self._segments:
                if segment.statement is None:  # a flat segment: the parent map is in order
                    ids.extend(id(self.parent[node]) for node in segment.inner)
                else:
                    ids.append(module_id)
                    ids.extend(segment.parent_ids())
            self._parent_ids = ids
        return self._parent_ids

    def alias_for(self, qualified: str) -> str | None:
        """The local name an import binds to `qualified` (e.g. `dist`), if any."""
        for local, full in self.imports.aliases.items():
            if CANONICAL.get(full, full) == qualified:
                return local
        return None

    def code(self, node: cst.CSTNode) -> str:
        """`module.code_for_node(node)`, without the positions libcst records as it goes."""
        return node_code(node, self.module.default_indent, self.module.default_newline)

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


class _SegmentedOrder(Mapping):
    """`Tree.order` answered per top-level statement: a node's index is where its
    statement's segment begins in `nodes` plus its index in the segment. A segment keeps
    its own index (`_Segment.order`), reused by every tree that reuses the segment, so a
    tree a pass made costs the statements the pass rebuilt, not a map of every node."""

    __slots__ = ("_tree", "_starts")

    def __init__(self, tree: Tree) -> None:
        self._tree = tree
        starts: dict[int, int] = {}
        at = 1  # the module is node 0
        for segment in tree._segments:
            starts[id(segment)] = at  # a segment twice (one statement twice): its last place
            at += 1 + len(segment.inner)
        self._starts = starts

    def __getitem__(self, node: cst.CSTNode) -> int:
        tree = self._tree
        module, parent = tree.module, tree.parent
        if node is module:
            return 0
        top, above = node, parent[node]  # KeyError for a node of another tree
        while above is not module:
            top, above = above, parent[above]
        segment = tree._segment_of[top]
        start = self._starts[id(segment)]
        return start if top is node else start + 1 + segment.order()[node]

    def get(self, node: cst.CSTNode, default=None):
        try:
            return self[node]
        except KeyError:
            return default

    def __contains__(self, node: object) -> bool:
        return node is self._tree.module or node in self._tree.parent

    def __len__(self) -> int:
        return len(self._tree.parent) + 1

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(dict.fromkeys(self._tree.nodes))


class _Segment:
    """The walk of one top-level statement: its nodes below it in pre-order (ddpify.walk
    skips formatting children), the parent of each, its imports, and per-kind lists
    made on demand. A statement is immutable, so all of it stays true for the object."""

    __slots__ = (
        "statement",
        "inner",
        "parents",
        "imports",
        "import_places",
        "spans",
        "_by_type",
        "_kinds",
        "_calls",
        "_parent_ids",
        "_order",
        "_names",
        "_calls_where",
    )

    def __init__(self, statement: cst.CSTNode, walked: _Walked | None = None) -> None:
        self.statement = statement
        self.inner: list[cst.CSTNode] = []
        self.parents: list[cst.CSTNode] = []
        self.imports: list[cst.CSTNode] = []
        self.import_places: list[int] = []  # each import's index in `inner` (-1: the statement)
        # Each statement inside -> where its walk (itself, then its nodes) is in `inner`.
        self.spans: dict[cst.CSTNode, tuple[int, int]] = {}
        self._by_type: dict[type, list[int]] | None = None
        self._kinds: dict[type, list[cst.CSTNode]] = {}
        self._calls: list[tuple[cst.Call, str | None]] | None = None
        self._parent_ids: list[int] | None = None
        self._order: dict[cst.CSTNode, int] | None = None
        self._names: frozenset[str] | None = None
        self._calls_where: dict[Callable, list[cst.Call]] = {}
        if type(statement) in _IMPORTS:  # not isinstance: ABCMeta's check is slow here
            self.imports.append(statement)
            self.import_places.append(-1)
        self._walk(statement, walked)

    def _walk(self, statement: cst.CSTNode, walked: _Walked | None) -> None:
        """Pre-order below `statement`. An inner statement that a segment of the previous
        tree walked (the same object: a pass rebuilt only the path to its edit) is copied
        from that walk, not walked again."""
        inner, parents, spans = self.inner, self.parents, self.spans
        stack: list = [(child, statement) for child in reversed(child_list(statement))]
        while stack:
            node, parent = stack.pop()
            if node is None:  # the end of a statement's walk: `parent` is (it, start)
                spans[parent[0]] = (parent[1], len(inner))
                continue
            if type(node) in _STATEMENTS:
                found = walked.find(node) if walked is not None else None
                if found is not None:
                    self._copy(node, parent, *found)
                    continue
                stack.append((None, (node, len(inner))))
            inner.append(node)
            parents.append(parent)
            if type(node) in _IMPORTS:
                self.imports.append(node)
                self.import_places.append(len(inner) - 1)
            below = child_list(node)
            if below:
                below.reverse()
                stack.extend([(child, node) for child in below])

    def _copy(self, node, parent, segment: _Segment, start: int, stop: int) -> None:
        """The walk of `node`, copied from `segment`'s, where it is `start:stop`. Only
        `node`'s own span is recorded: the statements inside are found where they were
        first walked (_Walked keeps the first segment that walked each one)."""
        here = len(self.inner)
        self.inner.extend(segment.inner[start:stop])
        self.parents.append(parent)
        self.parents.extend(segment.parents[start + 1 : stop])
        self.spans[node] = (here, len(self.inner))
        shift = here - start
        for inside, place in zip(segment.imports, segment.import_places):
            if start <= place < stop:
                self.imports.append(inside)
                self.import_places.append(place + shift)

    @classmethod
    def flat(cls, nodes: list[cst.CSTNode]) -> _Segment:
        """Every node of a module below it, as one segment with no statement of its own
        (`Tree.from_walk`): the per-kind lists and call paths work as for a statement."""
        segment = cls.__new__(cls)
        segment.statement = None
        segment.inner, segment.parents, segment.imports = nodes, [], []
        segment.import_places = []
        segment.spans = {}
        segment._by_type, segment._kinds, segment._calls = None, {}, None
        segment._parent_ids = None
        segment._order = None
        segment._names = None
        segment._calls_where = {}
        return segment

    def order(self) -> dict[cst.CSTNode, int]:
        """Each node's index in `inner` (the last, for a node that occurs twice)."""
        if self._order is None:
            self._order = dict(zip(self.inner, range(len(self.inner))))
        return self._order

    def of_kind(self, kind: type) -> list:
        found = self._kinds.get(kind)
        if found is None:
            # By exact type (dict lookups), not isinstance (ABCMeta's check, per node);
            # one pass groups the nodes by type, so a kind costs its own nodes, not a
            # scan of the segment per kind asked.
            by_type = self._types_at()
            answers = _kind_answers(kind)
            places = [at for t, at in by_type.items() if _is_kind(answers, t, kind)]
            found = []
            if self.statement is not None and _is_kind(answers, type(self.statement), kind):
                found.append(self.statement)
            if len(places) == 1:
                inner = self.inner
                found.extend([inner[i] for i in places[0]])
            elif places:
                inner = self.inner
                found.extend([inner[i] for i in sorted(i for at in places for i in at)])
            self._kinds[kind] = found
        return found

    def _types_at(self) -> dict[type, list[int]]:
        """Each node type below the statement -> where its nodes are in `inner`."""
        if self._by_type is None:
            by_type: dict[type, list[int]] = {}
            for index, node in enumerate(self.inner):
                at = by_type.get(type(node))
                if at is None:
                    by_type[type(node)] = [index]
                else:
                    at.append(index)
            self._by_type = by_type
        return self._by_type

    def calls_where(self, test: Callable[[cst.Call], bool]) -> list[cst.Call]:
        found = self._calls_where.get(test)
        if found is None:
            found = self._calls_where[test] = [c for c in self.of_kind(cst.Call) if test(c)]
        return found

    def names(self) -> frozenset[str]:
        if self._names is None:
            self._names = frozenset(name.value for name in self.of_kind(cst.Name))
        return self._names

    def parent_ids(self) -> list[int]:
        """`id` of each parent in `parents` (kept with the segment, so reused with it)."""
        if self._parent_ids is None:
            self._parent_ids = list(map(id, self.parents))
        return self._parent_ids

    def call_paths(self) -> list[tuple[cst.Call, str | None]]:
        """Each call and its callee's dotted path (`dist.barrier`), in source order."""
        if self._calls is None:
            self._calls = [(call, dotted(call.func)) for call in self.of_kind(cst.Call)]
        return self._calls


_KIND_ANSWERS: dict[type, dict[type, bool]] = {}


def _kind_answers(kind: type) -> dict[type, bool]:
    """Node type -> `issubclass(type, kind)`, filled as types are met: `isinstance` on
    libcst's ABC-based classes costs a slow check per node."""
    answers = _KIND_ANSWERS.get(kind)
    if answers is None:
        answers = _KIND_ANSWERS[kind] = {}
    return answers


def _is_kind(answers: dict[type, bool], node_type: type, kind: type) -> bool:
    found = answers.get(node_type)
    if found is None:
        found = answers[node_type] = issubclass(node_type, kind)
    return found


class _Walked:
    """Where a statement's walk is, found by object: every segment made for a run's
    trees, from the first tree on (each tree hands it to the next it is `previous` of).
    A walk is true of its statement in any tree (nodes are immutable), so any segment
    that walked it will do, and a tree's build costs the segments it makes, not a scan
    of the previous tree's. Keyed by `id`: the segments it holds keep their nodes alive,
    so an id is never reused while it is here, and `find` checks the node is the one."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[_Segment, int, int]] = {}

    def add(self, segment: _Segment) -> None:
        where = self._where
        for node, (start, stop) in segment.spans.items():
            where.setdefault(id(node), (segment, start, stop))

    def find(self, statement: cst.CSTNode) -> tuple[_Segment, int, int] | None:
        found = self._where.get(id(statement))
        if found is None or found[0].inner[found[1]] is not statement:
            return None
        return found


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

    def enter(n: cst.CSTNode) -> None:
        kind = type(n)
        if kind is cst.Name:
            found.add(n.value)  # type: ignore[attr-defined]
        elif kind is cst.Attribute:
            name = dotted(n)  # type: ignore[arg-type]
            if name:
                found.add(name)

    # The read-only walk (libcst's visit rebuilds every node it passes).
    walk(node, enter, _nothing)
    return found


def _nothing(node: cst.CSTNode) -> None:
    pass


def mentions(node: cst.CSTNode, name: str) -> bool:
    return name in names_in(node)


def parse_statements(code: str) -> list[cst.BaseStatement]:
    return list(parse_module(code).body)


def indent_of(tree: Tree, statement: cst.BaseStatement) -> str:
    """The indentation (relative to the module) of a statement's block, for templates."""
    depth = sum(1 for a in tree.ancestors(statement) if isinstance(a, cst.IndentedBlock))
    return "    " * depth


def binds_on_every_branch(statement: cst.If, name: str) -> bool:
    """Whether every branch of `if ...: ... elif ...: ... else: ...` assigns `name` in its
    own block (`model = Net()` / `model = checkpoint["model"]`): after the `if`, `name`
    holds a value whichever way it went. No `else` leaves a path that binds nothing."""
    branch: cst.If | cst.Else | None = statement
    while isinstance(branch, cst.If):
        if not _block_assigns(branch.body, name):
            return False
        branch = branch.orelse
    return isinstance(branch, cst.Else) and _block_assigns(branch.body, name)


def rebound_between(tree: Tree, name: str, first: cst.CSTNode, second: cst.CSTNode) -> bool:
    """Whether `name` is bound anew after `first` and before `second`, in the scope of
    `second`, to a value that does not read it (`net = checkpoint["net"]`, `net, tag =
    build()`): what `first` did to the old value (a DDP wrap) does not reach `second`."""
    scope = tree.scope(second)
    for assign in tree.find(cst.Assign):
        if not (tree.after(assign, first) and tree.after(second, assign)):
            continue
        if tree.scope(assign) is not scope or tree.inside(second, assign):
            continue
        bound = set().union(*(names_in(target.target) for target in assign.targets))
        if name in bound and not mentions(assign.value, name):
            return True
    return False


def _block_assigns(block: cst.BaseSuite, name: str) -> bool:
    for line in getattr(block, "body", ()):
        for small in getattr(line, "body", ()) if isinstance(line, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Assign) and any(
                dotted(target.target) == name for target in small.targets
            ):
                return True
    return False
