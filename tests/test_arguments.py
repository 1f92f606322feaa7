"""Argument edits never move another argument into a different parameter slot."""

from __future__ import annotations

import libcst as cst

from ddpify.arguments import drop_arg, insert_keyword_after, keyword_arg, replace_with_keyword
from tests.helpers import fix

LOADER = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers")

SCRIPT = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def main():
    dist.init_process_group("gloo")
    ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
    sampler = DistributedSampler(ds)
    loader = {loader}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            pass
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _call(code: str) -> cst.Call:
    return cst.parse_expression(code)


def _code(call: cst.Call | None) -> str | None:
    return None if call is None else cst.Module([]).code_for_node(call)


def test_dropping_a_positional_argument_names_the_ones_after_it():
    call = _call("DataLoader(ds, 8, True, sampler, None, 2)")
    assert _code(drop_arg(call, call.args[2], LOADER)) == (
        "DataLoader(ds, 8, sampler = sampler, batch_sampler = None, num_workers = 2)"
    ).replace(" = ", "=")


def test_dropping_refuses_when_later_slots_cannot_be_named():
    call = _call("f(a, b, c)")
    assert drop_arg(call, call.args[0]) is None
    starred = _call("DataLoader(ds, 8, True, *rest)")
    assert drop_arg(starred, starred.args[2], LOADER) is None


def test_dropping_the_last_positional_or_a_keyword_needs_no_names():
    call = _call("f(a, b, key=1)")
    assert _code(drop_arg(call, call.args[1])) == "f(a, key=1)"
    assert _code(drop_arg(call, call.args[2])) == "f(a, b)"


def test_a_keyword_in_a_positional_slot_names_the_positional_ones_after_it():
    call = _call("DataLoader(ds, 8, True, None, None, 4)")
    new = replace_with_keyword(call, call.args[2], keyword_arg("x", cst.Name("s")), LOADER)
    assert _code(new) == "DataLoader(ds, 8, x=s, sampler=None, batch_sampler=None, num_workers=4)"
    assert replace_with_keyword(call, call.args[2], keyword_arg("x", cst.Name("s"))) is None


def test_a_new_keyword_goes_after_the_positional_arguments():
    call = _call("DataLoader(ds, 64, drop_last=True)")
    new = insert_keyword_after(call, call.args[0], keyword_arg("sampler", cst.Name("s")))
    assert _code(new) == "DataLoader(ds, 64, sampler=s, drop_last=True)"


def test_ddp021_fix_keeps_a_positional_sampler_in_the_sampler_slot():
    source = SCRIPT.format(loader="DataLoader(ds, 8, True, sampler)")
    fixed = fix(source, ["DDP021"])
    assert "DataLoader(ds, 8, sampler=sampler)" in fixed


def test_ddp020_fix_never_puts_a_keyword_before_a_positional_argument():
    source = SCRIPT.replace("    sampler = DistributedSampler(ds)\n", "").replace(
        "        sampler.set_epoch(epoch)\n", ""
    )
    fixed = fix(source.format(loader="DataLoader(ds, 64)"), ["DDP020"], unsafe=True)
    compile(fixed, "fixed.py", "exec")
    assert "DataLoader(ds, 64, sampler=DistributedSampler(ds, shuffle=False))" in fixed
