"""Where a module whose layers its first forward builds can be wrapped in DDP.

`roles.lazily_built_models` finds the models an optimizer trains only after a forward, in
a method of their class's owner (a data-dependent initialisation: pix2pix's
`data_dependent_initialize`, a patch-sampling head that makes its MLPs on its first call,
`nn.Lazy*` layers). DDP registers the parameters the module has when it is wrapped, so
the wrap must come after that forward and no later than the optimizer: right before the
statement that builds the optimizer, in the same block. DDP broadcasts rank 0's
parameters as it is built, so every rank starts from the layers rank 0 made."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.roles import LazilyBuilt, lazily_built_models


def lazy_wrap_points(tree) -> list[tuple[LazilyBuilt, cst.SimpleStatementLine | None]]:
    """Each lazily built model, with the statement to wrap it before (the one that builds
    its optimizer), or None where no such statement can take a wrap before it."""
    view = tree.view
    return [(lazy, _wrap_point(view, lazy)) for lazy in lazily_built_models(tree)]


def _wrap_point(view, lazy: LazilyBuilt) -> cst.SimpleStatementLine | None:
    statement = view.statement(lazy.optimizer)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None  # `for p in ...:` or `with ...:` headers: no line of its own
    if len(statement.body) != 1:
        return None  # `a = 1; opt = Adam(...)`: the wrap would split the line
    small = statement.body[0]
    if isinstance(small, (cst.Assign, cst.Expr, cst.AugAssign, cst.AnnAssign)):
        return statement
    return None
