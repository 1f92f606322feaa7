"""A module's code, rendered once per top-level statement.

Migrate passes rebuild only the statements they edit (ddpify/migrate/edits.py): every
other top-level statement of the new module is the same object as before. `ModuleText`
remembers the code of each statement it rendered, so rendering the module after a pass
costs what the pass changed, not the file (libcst's `Module.code` renders every node).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import libcst as cst
from libcst._nodes.internal import CodegenState

from ddpify.gates import comments
from ddpify.guarded import Beside

T = TypeVar("T")


class ModuleText:
    """Renders modules like `Module.code`, reusing the code of statements already seen.

    Holds the statements it rendered (their identity is the key), so keep one per run,
    not for the life of the process."""

    def __init__(self, *, inner: bool = False) -> None:
        self._seen: dict[int, tuple[cst.CSTNode, tuple[str, str], str]] = {}
        self._comments: dict[int, tuple[cst.CSTNode, str, Counter[str]]] = {}
        # `inner`: remember the statements inside blocks too (see StatementCodes); for a
        # run that renders each module a few times (migrate), not for a long session.
        self._inner: StatementCodes | None = StatementCodes() if inner else None

    def code_beside(
        self, module: cst.Module, also: Callable[[], T] | None = None
    ) -> Callable[[], tuple[str, T | None]]:
        """Start rendering `module` beside this process (a forked child, for a large
        module), after `also()` there when given (more work on the same input: one child
        for both). The function returned waits for the child and returns the code and
        what `also` returned; from then on this renderer knows the code of each of the
        module's statements as if it had rendered them."""
        rendering = Beside(_rendered_after, module, also)

        def code() -> tuple[str, T | None]:
            also_gave, (text, top, inner) = rendering.result()
            nodes = (*module.header, *module.body, *module.footer)
            style = (module.default_indent, module.default_newline)
            for node, node_code_ in zip(nodes, top):
                self._seen[id(node)] = (node, style, node_code_)
            if self._inner is not None:
                self._inner.adopt(module, inner)
            return text, also_gave

        return code

    def code(self, module: cst.Module) -> str:
        if not module.has_trailing_newline or not (module.header or module.body or module.footer):
            return module.code  # libcst trims or adds the last newline: let it
        style = (module.default_indent, module.default_newline)
        parts = [self._node(module, node, style) for node in module.header]
        parts += [self._node(module, node, style) for node in module.body]
        parts += [self._node(module, node, style) for node in module.footer]
        return "".join(parts)

    def comments(self, module: cst.Module) -> Counter[str]:
        """`gates.comments(self.code(module))`, counted per top-level node: each begins a
        line and ends one with no string or bracket open across it, so tokenizing it
        alone finds the comments the whole text has there, and a node already counted
        (an input statement a pass left alone) is not tokenized again."""
        if not module.has_trailing_newline or not (module.header or module.body or module.footer):
            return comments(self.code(module))
        found: Counter[str] = Counter()
        for node in (*module.header, *module.body, *module.footer):
            found.update(self._node_comments(module, node))
        return found

    def _node_comments(self, module: cst.Module, node: cst.CSTNode) -> Counter[str]:
        code = self.code_of(module, node)
        known = self._comments.get(id(node))
        if known is None or known[0] is not node or known[1] != code:
            # Every comment token begins with `#`: code without one has none to count.
            known = (node, code, comments(code) if "#" in code else Counter())
            self._comments[id(node)] = known
        return known[2]

    def lost_comments(self, before: cst.Module, after: cst.Module) -> Counter[str]:
        """`self.comments(before) - self.comments(after)`, counting only the top-level
        nodes that are not in both: a node both modules hold renders alike in both (same
        indentation and newline), so its comments cancel out, and a pass that left most
        statements alone costs what it rewrote."""
        style = (before.default_indent, before.default_newline)
        if style != (after.default_indent, after.default_newline) or not all(
            m.has_trailing_newline and (m.header or m.body or m.footer) for m in (before, after)
        ):
            return self.comments(before) - self.comments(after)
        nodes_before = (*before.header, *before.body, *before.footer)
        nodes_after = (*after.header, *after.body, *after.footer)
        shared = {id(node) for node in nodes_before} & {id(node) for node in nodes_after}
        lost: Counter[str] = Counter()
        for node in nodes_before:
            if id(node) not in shared:
                lost.update(self._node_comments(before, node))
        for node in nodes_after:
            if id(node) not in shared:
                lost.subtract(self._node_comments(after, node))
        return +lost  # the comments `before` has more of

    def code_of(self, module: cst.Module, node: cst.CSTNode) -> str:
        """The code of one top-level node (statement, header or footer line) of `module`."""
        return self._node(module, node, (module.default_indent, module.default_newline))

    def keep_only(self, module: cst.Module) -> None:
        """Forget every node but `module`'s own top-level ones (a long editing session
        would otherwise keep every statement it ever rendered)."""
        if len(self._seen) > 2 * (len(module.body) + len(module.header) + len(module.footer)) + 64:
            current = {id(node) for node in (*module.header, *module.body, *module.footer)}
            self._seen = {key: value for key, value in self._seen.items() if key in current}
            self._comments = {k: v for k, v in self._comments.items() if k in current}

    def _node(self, module: cst.Module, node: cst.CSTNode, style: tuple[str, str]) -> str:
        seen = self._seen.get(id(node))
        if seen is not None and seen[0] is node and seen[1] == style:
            return seen[2]
        # A top-level node renders at indentation zero: its code does not depend on what
        # comes before it, only on the module's indentation and newline.
        if self._inner is None:
            code = node_code(node, *style)
        else:
            code = self._inner.code(node, *style)
        self._seen[id(node)] = (node, style, code)
        return code


_NO_POSITION = contextlib.nullcontext()


class _Codegen(CodegenState):
    """libcst's codegen state without the positions it records for its metadata: a
    generator-based context manager per node is a quarter of the rendering time."""

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        return _NO_POSITION


def node_code(node: cst.CSTNode, indent: str, newline: str, indents: Sequence[str] = ()) -> str:
    """`module.code_for_node(node)` for a module with that default indentation and
    newline, rendered inside blocks whose indentation is `indents` (outermost first)."""
    state = _Codegen(default_indent=indent, default_newline=newline)
    state.indent_tokens = list(indents)
    node._codegen(state)
    return "".join(state.tokens)


def _rendered_after(module: cst.Module, also: Callable[[], T] | None) -> tuple:
    return (None if also is None else also()), _rendered_statements(module)


def _rendered_statements(module: cst.Module) -> tuple[str, list[str], dict]:
    """`module`'s code, the code of each of its top-level nodes, and what a StatementCodes
    learnt rendering them (see `ModuleText.code_beside`)."""
    render = ModuleText(inner=True)
    text = render.code(module)
    nodes = (*module.header, *module.body, *module.footer)
    style = (module.default_indent, module.default_newline)
    return text, [render._node(module, node, style) for node in nodes], render._inner.exported()


class StatementCodes:
    """Renders nodes like `node_code`, reusing the code of every statement inside a block
    that it rendered before in the same context.

    A pass rebuilds a function to change one statement in it; the other statements of
    its body are the objects they were. A statement's code depends on nothing but the
    statement, the module's indentation and newline, and the indentation of the blocks
    around it (a statement renders its own leading lines, indentation and line end), so
    the code of one already rendered with all three the same is its code again. Holds
    the statements it rendered (an id is never reused while the object lives)."""

    def __init__(self) -> None:
        self._codes: dict[int, tuple[cst.CSTNode, tuple[str, ...], str]] = {}
        # Codes another process rendered for the statements of `_adopted_modules`, by id
        # (see `adopt`).
        self._adopted: dict[int, tuple[tuple[str, ...], str]] = {}
        self._adopted_modules: list[cst.Module] = []

    def exported(self) -> dict[int, tuple[tuple[str, ...], str]]:
        """What this has rendered, by statement id, for `adopt` in a process forked from
        the one whose statements they are."""
        return {key: (context, code) for key, (_, context, code) in self._codes.items()}

    def adopt(self, module: cst.Module, codes: dict[int, tuple[tuple[str, ...], str]]) -> None:
        """Reuse `codes`, exported by a process forked from this one after `module` was
        made: its statements are the objects here at the same addresses (fork copies the
        memory), and holding `module` keeps each of them alive, so no id in `codes`
        can come to name another object while this lives."""
        self._adopted_modules.append(module)
        self._adopted.update(codes)

    def code(self, node: cst.CSTNode, indent: str, newline: str) -> str:
        """`node_code(node, indent, newline)` for a node at the module's top level."""
        state = _CachingCodegen(default_indent=indent, default_newline=newline)
        state.codes = self._codes
        state.adopted = self._adopted
        if isinstance(node, cst.BaseStatement):
            state.statement(node)
        else:
            node._codegen(state)
        return "".join(state.tokens)


class _CachingCodegen(_Codegen):
    codes: dict[int, tuple[cst.CSTNode, tuple[str, ...], str]]
    adopted: dict[int, tuple[tuple[str, ...], str]]

    def statement(self, node: cst.BaseStatement) -> None:
        """Add a statement of a block (or of the module) as `node._codegen` adds it."""
        context = (self.default_indent, self.default_newline, *self.indent_tokens)
        known = self.codes.get(id(node))
        if known is not None and known[0] is node and known[1] == context:
            self.tokens.append(known[2])
            return
        adopted = self.adopted.get(id(node)) if self.adopted else None
        if adopted is not None and adopted[0] == context:
            self.tokens.append(adopted[1])
            return
        tokens = self.tokens
        start = len(tokens)
        _through_codes(node)._codegen(self)
        code = "".join(tokens[start:])
        tokens[start:] = [code]  # one token: the blocks around it join it, not its parts
        self.codes[id(node)] = (node, context, code)


class _CachingBlock(cst.IndentedBlock):
    """An IndentedBlock that adds its statements through `_CachingCodegen.statement`;
    otherwise `IndentedBlock._codegen_impl` (without the positions it records)."""

    def _codegen_impl(self, state: _CachingCodegen) -> None:  # type: ignore[override]
        self.header._codegen(state)
        state.increase_indent(state.default_indent if self.indent is None else self.indent)
        if self.body:
            for statement in self.body:
                state.statement(statement)
        else:
            state.add_indent_tokens()
            state.add_token("pass")
            state.add_token(state.default_newline)
        for line in self.footer:
            line._codegen(state)
        state.decrease_indent()


# Parts of a compound statement that hold a block but are no statement of one (an `elif`
# is an If, rendered by the If above it: it is looked into, never cached as a statement).
_CLAUSES = frozenset(
    {cst.Else, cst.Finally, cst.ExceptHandler, cst.ExceptStarHandler, cst.If, cst.MatchCase}
)
# By exact type: isinstance on libcst's ABC-based classes is a slow check.
_WITH_BLOCKS = _CLAUSES | {
    cst.FunctionDef,
    cst.ClassDef,
    cst.For,
    cst.While,
    cst.With,
    cst.Try,
    cst.TryStar,
    cst.Match,
}


def _through_codes(node: cst.CSTNode) -> cst.CSTNode:
    """`node` with each block of it (its body, else, except and finally clauses, match
    cases) a `_CachingBlock` holding the same statements: the same code, rendered
    through the codes. A simple statement line holds no block: itself."""
    if type(node) not in _WITH_BLOCKS:
        return node
    changes = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if type(value) is cst.IndentedBlock:
            changes[field.name] = _CachingBlock(
                header=value.header, indent=value.indent, body=value.body, footer=value.footer
            )
        elif type(value) in _CLAUSES:
            changes[field.name] = _through_codes(value)
        elif type(value) in (tuple, list) and value and type(value[0]) in _CLAUSES:
            changes[field.name] = [_through_codes(part) for part in value]
    return node.with_changes(**changes) if changes else node
