"""Training loops that are not `for batch in loader`: `while` step loops, iterators pulled
with next() (directly, through the walrus form, or through a fetcher object), loops in a
method. The fixture pairs step_loop_fetcher and walrus_next_loop run in the batched runner;
these check what a user reads in the converted script and its report."""

from __future__ import annotations

from ddpify.migrate import migrate_source
from tests.helpers import FIXTURES

HEADER = (
    "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
    "model = torch.nn.Linear(2, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "loader = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=8,"
    " shuffle=True)\n"
)


def migrate(source: str):
    result = migrate_source(source, "t.py")
    assert result.migrated, result.reason
    return result


def test_a_fetcher_object_in_a_while_loop_of_a_method_feeds_the_step():
    before = (FIXTURES / "migrate" / "step_loop_fetcher" / "before.py").read_text()
    result = migrate(before)
    assert "sampler=DistributedSampler(train_dataset, shuffle=True)" in result.output
    assert "self.model.module.state_dict()" in result.output
    # No epoch loop: the fetcher's restart of its iterator starts each new pass, and the
    # sampler's epoch moves on there, so each pass reshuffles as the original's did.
    out = result.output
    restart = out.index("            self.iter = iter(self.loader)")
    moved = out.index("self.loader.sampler.set_epoch(self.loader.sampler.epoch + 1)")
    assert out.rindex("except (TypeError, StopIteration):", 0, restart) < moved < restart
    assert not any("set_epoch" in item.why for item in result.needs_human)


def test_the_walrus_form_draws_from_the_loader_and_each_epoch_reshuffles():
    before = (FIXTURES / "migrate" / "walrus_next_loop" / "before.py").read_text()
    out = migrate(before).output
    assert "sampler=DistributedSampler(train_dataset, shuffle=True)" in out
    loop = out.index("for epoch in range(EPOCHS):")
    assert out.index("train_loader.sampler.set_epoch(epoch)", loop) < out.index("while (", loop)
    assert "x[RANK" not in out  # the sampler shards it: the batch is not split again


def test_a_while_step_loop_over_an_iterator_restarted_on_stop_iteration():
    source = HEADER + (
        "batches = iter(loader)\nstep = 0\n"
        "while step < 20:\n"
        "    try:\n        x, y = next(batches)\n"
        "    except StopIteration:\n        batches = iter(loader)\n        x, y = next(batches)\n"
        "    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n    step += 1\n"
    )
    result = migrate(source)
    assert "sampler=DistributedSampler(" in result.output
    assert any("set_epoch" in item.why for item in result.needs_human)


def test_a_while_loop_inside_a_loop_over_the_loader_trains_on_that_loader():
    source = HEADER + (
        "for epoch in range(2):\n    for x, y in loader:\n        tries = 0\n"
        "        while tries < 2:\n            ((model(x) - y) ** 2).mean().backward()\n"
        "            opt.step()\n            tries += 1\n"
    )
    result = migrate(source)
    assert "loader.sampler.set_epoch(epoch)" in result.output
    assert not any("set_epoch" in item.why for item in result.needs_human)


def test_hand_made_batches_of_a_while_step_loop_are_split_by_rank():
    source = (
        "import torch\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "data = torch.randn(512, 4)\n"
        "def get_batch():\n    ix = torch.randint(len(data) - 1, (16,))\n"
        "    return data[ix], data[ix + 1, :1]\n"
        "it = 0\nwhile it < 50:\n    xb, yb = get_batch()\n"
        "    loss = ((model(xb) - yb) ** 2).mean()\n    opt.zero_grad()\n    loss.backward()\n"
        "    opt.step()\n    it += 1\n"
    )
    out = migrate(source).output
    assert "xb = xb[RANK * len(xb) // WORLD_SIZE : (RANK + 1) * len(xb) // WORLD_SIZE]" in out


def test_a_loop_that_only_measures_the_loader_is_not_fed_by_it():
    """`n = len(loader)` reads the loader; the batches still come from slicing tensors."""
    source = HEADER + (
        "X, Y = torch.randn(64, 2), torch.randn(64, 1)\nn = len(loader)\nstep = 0\n"
        "while step < 8:\n    i = (step % n) * 8\n    xb, yb = X[i:i + 8], Y[i:i + 8]\n"
        "    ((model(xb) - yb) ** 2).mean().backward()\n    opt.step()\n    step += 1\n"
    )
    result = migrate_source(source, "t.py")
    assert "sampler=DistributedSampler(" not in result.output


# -- models in a list, built at module level ---------------------------------------------


def test_each_model_of_a_list_trained_by_a_list_of_optimizers_is_wrapped():
    before = (FIXTURES / "migrate" / "model_list_zip" / "before.py").read_text()
    result = migrate(before)
    out = result.output
    wrap = out.index("nets = [DDP(net, find_unused_parameters=True) for net in nets]")
    assert out.index("nets = [Net(") < wrap < out.index("opts = [torch.optim.Adam(")
    assert any("find_unused_parameters" in item.why for item in result.needs_human)


def test_optimizers_appended_in_a_loop_over_the_models_train_each_wrapped_model():
    """`for net in nets: opts.append(SGD(net.parameters()))`: `net` ranges over the list
    `nets` (filled by `nets.append(...)`), so each of its models is wrapped, once the
    list is complete and before the step loop zips the models with their optimizers."""
    before = (FIXTURES / "migrate" / "model_list_loop_optimizers" / "before.py").read_text()
    out = migrate(before).output
    wrap = out.index("    nets = [DDP(net, find_unused_parameters=True) for net in nets]\n")
    assert out.index("nets.append(Regressor(width))") < wrap
    assert out.index("opts.append(torch.optim.SGD(") < wrap < out.index("for epoch in range(3):")


def test_a_loop_over_models_built_elsewhere_is_refused_naming_the_collection():
    source = HEADER + (
        "def train(nets):\n    opts = []\n    for net in nets:\n"
        "        opts.append(torch.optim.SGD(net.parameters(), lr=0.1))\n"
        "    for x, y in loader:\n        for net, opt in zip(nets, opts):\n"
        "            ((net(x) - y) ** 2).mean().backward()\n            opt.step()\n"
    )
    result = migrate_source(source, "train.py")
    assert not result.migrated
    assert "cannot find where the models of `nets` trained by `opts.append(" in result.reason


def test_the_group_is_joined_before_module_level_code_builds_the_sampler_and_wrap():
    """With a __main__ guard, a loader and model built at import still need the group."""
    before = (FIXTURES / "migrate" / "model_list_zip" / "before.py").read_text()
    out = migrate(before).output
    init = out.index("\ninit_distributed()\n")
    assert init < out.index("DistributedSampler(train_dataset") and init < out.index("DDP(net")
    guard = out[out.index('if __name__ == "__main__":') :]
    assert "init_distributed()" not in guard and "dist.destroy_process_group()" in guard


def test_a_print_that_runs_a_model_with_buffers_stays_on_every_rank():
    source = HEADER.replace("torch.nn.Linear(2, 1)", "torch.nn.Sequential(torch.nn.BatchNorm1d(2))")
    source += (
        "for epoch in range(2):\n    for x, y in loader:\n"
        "        ((model(x) - y) ** 2).mean().backward()\n        opt.step()\n"
        "    print(model(x).mean().item())\n"
    )
    result = migrate(source)
    assert "    print(model(x).mean().item())\n" in result.output
    assert "RANK == 0" not in result.output
    assert any("DDP053" in item.why for item in result.needs_human)


def test_a_print_that_calls_a_function_running_a_model_with_buffers_stays_on_every_rank():
    """`print(evaluate())` runs the model's forward inside `evaluate`: the same hang."""
    source = HEADER.replace("torch.nn.Linear(2, 1)", "torch.nn.Sequential(torch.nn.BatchNorm1d(2))")
    source += (
        "def evaluate():\n    with torch.no_grad():\n        return model(x).mean().item()\n\n\n"
        "for epoch in range(2):\n    for x, y in loader:\n"
        "        ((model(x) - y) ** 2).mean().backward()\n        opt.step()\n"
        "    print(evaluate())\n"
    )
    result = migrate(source)
    assert "    print(evaluate())\n" in result.output and "RANK == 0" not in result.output
    assert any("DDP053" in item.why for item in result.needs_human)


# -- the empty sampler slot --------------------------------------------------------------


def test_an_empty_sampler_slot_gets_the_distributed_sampler():
    before = (FIXTURES / "migrate" / "none_sampler_slot" / "before.py").read_text()
    out = migrate(before).output
    assert "    train_sampler = DistributedSampler(train_dataset, shuffle=True)\n" in out
    assert "shuffle=(train_sampler is None)," in out  # now False: the sampler shuffles


def test_a_shuffle_flag_given_by_position_is_no_sampler():
    """`DataLoader(dataset, 16, True)`: position 2 is `shuffle`; `sampler` is position 3.
    Reading the flag as the sampler wrote `True.set_epoch(epoch)`, which crashes."""
    before = (FIXTURES / "migrate" / "positional_loader_args" / "before.py").read_text()
    out = migrate(before).output
    loader = "DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, shuffle=True))"
    assert loader in out
    assert "    train_loader.sampler.set_epoch(epoch)\n" in out
    assert "True.set_epoch" not in out


def test_a_none_sampler_next_to_a_literal_shuffle_is_not_filled():
    """`shuffle=True` beside a sampler raises in DataLoader: not a slot to fill."""
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ds = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))\n"
        "sampler = None\n"
        "loader = DataLoader(ds, batch_size=8, shuffle=True, sampler=sampler)\n"
        "for x, y in loader:\n    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated and "own sampler `sampler`" in result.reason


def test_an_adaptive_ode_solver_is_named_in_the_report():
    source = HEADER.replace("import torch\n", "import torch\nfrom torchdiffeq import odeint\n")
    source += (
        "t = torch.tensor([0.0, 1.0])\n"
        "for epoch in range(2):\n    for x, y in loader:\n"
        "        out = odeint(lambda s, h: model(h).expand_as(h), x, t, rtol=1e-3)[-1]\n"
        "        ((model(out) - y) ** 2).mean().backward()\n        opt.step()\n"
    )
    result = migrate(source)
    notes = [item for item in result.needs_human if "adaptive-step ODE solver" in item.why]
    assert notes, result.needs_human
    assert "odeint(" in result.output.splitlines()[notes[0].line - 1]
    fixed = source.replace("rtol=1e-3", "method='rk4'")
    assert not any("ODE" in item.why for item in migrate(fixed).needs_human)


def test_dataparallel_nested_under_a_cuda_test_wraps_on_every_path_after_the_move():
    """Hoisted out of the device-count test alone it would still leave CPU ranks unwrapped:
    the wrap goes after the whole `if`, once the model is on its GPU."""
    source = HEADER + (
        "if torch.cuda.is_available():\n"
        "    if torch.cuda.device_count() > 1:\n"
        "        model = torch.nn.DataParallel(model)\n"
        "    model = model.cuda()\n"
        "for x, y in loader:\n    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert result.migrated, result.reason
    assert "DataParallel(" not in result.output
    assert (
        "if torch.cuda.is_available():\n    model = model.cuda(LOCAL_RANK)\n"
        "model = DDP(model, device_ids=[LOCAL_RANK] if torch.cuda.is_available() else None)\n"
    ) in result.output
    notes = [h for h in result.needs_human if "applied only when conditions held" in h.why]
    assert notes and "model = DDP(" in result.output.splitlines()[notes[0].line - 1]


def test_dataparallel_nested_under_a_cuda_test_into_another_name_is_refused_with_the_line():
    source = HEADER + (
        "net = model\n"
        "if torch.cuda.is_available():\n"
        "    if torch.cuda.device_count() > 1:\n"
        "        net = torch.nn.DataParallel(model)\n"
        "    net = net.cuda()\n"
        "for x, y in loader:\n    ((net(x) - y) ** 2).mean().backward()\n    opt.step()\n"
    )
    result = migrate_source(source, "t.py")
    assert not result.migrated
    assert "net = torch.nn.DataParallel(model)" in result.reason
    assert "if torch.cuda.is_available():" in result.reason


def _unseeded_items(result) -> list:
    return [item for item in result.needs_human if "draws the same one" in item.why]


def test_a_batch_split_by_rank_without_a_seed_on_every_path_is_reported():
    """handmade_conditional_seed seeds torch only under `if args.seed is not None`: with
    the default, each rank draws its own batch and keeps a block of it, so the report must
    say the step is no longer the original's, on the line that splits the batch."""
    case = FIXTURES / "migrate" / "handmade_conditional_seed" / "before.py"
    result = migrate_source(case.read_text(), "before.py")
    (item,) = _unseeded_items(result)
    assert "`args.seed is not None`" in item.why
    assert result.output.splitlines()[item.line - 1].strip().startswith("xb = xb[RANK")


def test_a_batch_split_by_rank_with_torch_seeded_alike_is_not_reported():
    case = FIXTURES / "migrate" / "handmade_conditional_seed" / "before.py"
    seeded = case.read_text().replace(
        "    if args.seed is not None:\n        torch.manual_seed(args.seed)\n",
        "    torch.manual_seed(0 if args.seed is None else args.seed)\n",
    )
    result = migrate_source(seeded, "before.py")
    assert "xb = xb[RANK" in result.output and not _unseeded_items(result)
