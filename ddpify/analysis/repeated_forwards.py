"""Modules whose forward runs several times, in different ways, before one backward.

A CUT/pix2pix generator runs `self.netG(real)` for the image and then
`self.netG(x, layers, encode_only=True)` twice for the encoder's features, all into one
loss. DDP with `find_unused_parameters=True` decides which parameters are unused from the
graph of the module's *last* forward before the backward: there the decoder looks unused,
is marked ready at once, and the backward then marks it again ("Expected to mark a
variable ready only once"). Such a module is wrapped without that flag (DDP's default
expects every parameter to get its gradient once, which several forwards into one loss
do). Calls of one shape (a discriminator on fake, then real, images) run the same layers
each time, so they are not counted."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.names import dotted


def forwards_of_several_shapes(view, model: str) -> list[cst.Call]:
    """The calls of `model` (`self.netG(...)`) anywhere in the project, when they are
    called with different arguments (positional counts or keyword names); else []."""
    calls = view.find(cst.Call, lambda call: dotted(call.func) == model)
    shapes = {_shape(call) for call in calls}
    return calls if len(shapes) > 1 else []


def _shape(call: cst.Call) -> tuple[int, frozenset[str]]:
    positional = sum(1 for arg in call.args if arg.keyword is None and not arg.star)
    keywords = frozenset(arg.keyword.value for arg in call.args if arg.keyword is not None)
    return positional, keywords
