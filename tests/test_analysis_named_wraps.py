"""The one reading of `getattr(self, <name>)` that migrate's unwrap pass and the named
DataParallel analysis share."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.named_wraps import fetched_from_self


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ('getattr(self, "net" + name)', '"net" + name'),
        ('getattr(self, "netG")', '"netG"'),
        ("getattr(self, attr)", "attr"),
        ('getattr(model, "net" + name)', None),  # not read from self
        ('getattr(self, "net" + name, None)', None),  # a default: may not be a net
        ('setattr(self, "net" + name, net)', None),
        ("self.netG", None),
    ],
)
def test_fetched_from_self(code, expected):
    found = fetched_from_self(cst.parse_expression(code))
    assert (None if found is None else cst.Module([]).code_for_node(found)) == expected


def test_nothing_is_fetched_from_no_value():
    assert fetched_from_self(None) is None
