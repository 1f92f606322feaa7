"""How verify makes 1 and N processes comparable, piece by piece, without launching torchrun.

Random draws sliced per rank, BatchNorm statistics in Python, the original run with the
migration's number-changing fixes, and what a gradient difference is blamed on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpify.verify.original_fixes import fix_original
from ddpify.verify.report import VerifyResult
from tests.helpers import FIXTURES

torch = pytest.importorskip("torch")

from ddpify.verify import probe  # noqa: E402
from ddpify.verify.compare import compare_runs  # noqa: E402
from ddpify.verify.runner import conclude  # noqa: E402

AMP_CLIP = FIXTURES / "verify" / "amp_clip"
GRADS = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]


def record(grads, flags=None, data=(4.0, 1.0, 2.0), rank=0, draws=()):
    params = [torch.ones(2, 2), torch.zeros(2)]
    return {
        "rank": rank,
        "flags": flags or {},
        "optimizers": [{"class": "SGD", "lr_scale": 1.0}],
        "loaders": [{"batch_size": 2, "used_batch_size": 4, "policy": "per-rank"}],
        "steps": [
            {
                "optimizer": 0,
                "step": 1,
                "lrs": [0.1],
                "native_lrs": [0.1],
                "grads": grads,
                "loader": 0,
                "data": list(data),
            }
        ],
        "initial": {0: params},
        "final": {0: [p - 0.1 * g for p, g in zip(params, grads)]},
        "names": {0: ["fc.weight", "fc.bias"]},
        "draws": [list(d) for d in draws],
    }


def verdict(original, converted, nproc=2) -> VerifyResult:
    comparison = compare_runs(original, converted, nproc, "per-rank")
    return conclude(VerifyResult(2, "error", ""), comparison, 1)


def converted_pair(grads, flags=None, draws=()):
    return [record(grads, flags, (2.0, 0.5, 1.0), rank, draws) for rank in (0, 1)]


# -- what a difference is blamed on -------------------------------------------------------------


def test_a_factor_other_than_the_process_count_is_not_blamed_on_it():
    result = verdict(record(GRADS), converted_pair([g * 7.5 for g in GRADS]))
    assert result.exit_code == 1
    assert "7.5x the original's" in result.message
    assert "number of processes" not in result.message


def test_clipping_still_scaled_gradients_is_named_as_the_cause():
    original = record(GRADS, {"clip_scaled": "clip_grad_norm_"})
    result = verdict(original, converted_pair([g * 7576 for g in GRADS]))
    assert result.exit_code == 1
    assert "GradScaler still scales" in result.message and "DDP044" in result.message
    assert "number of processes" not in result.message


def test_per_rank_batch_norm_statistics_make_differing_gradients_inconclusive():
    # Per-process statistics are a valid DDP set-up that no single process computes.
    result = verdict(record(GRADS), converted_pair([g + 0.1 for g in GRADS], {"local_bn": True}))
    assert (result.exit_code, result.verdict) == (2, "inconclusive")
    assert "BatchNorm without SyncBatchNorm" in result.message
    assert any("DDP030" in reason for reason in result.inconclusive)


def test_per_rank_batch_norm_statistics_do_not_excuse_wrong_data():
    # Every rank trained on the whole batch (no sampler): a mismatch, BatchNorm or not.
    ranks = [record([g + 0.1 for g in GRADS], {"local_bn": True}, rank=r) for r in (0, 1)]
    result = verdict(record(GRADS), ranks)
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message


# -- random draws -------------------------------------------------------------------------------


def test_sliced_draws_the_original_made_whole_are_noted():
    whole = [("randn", [4, 6], None, "s1")]
    sliced = [("randn", [4, 6], 0, "s1")]
    result = verdict(record(GRADS, draws=whole), converted_pair(GRADS, draws=sliced))
    assert result.exit_code == 0, result.message
    assert any("1 random draw(s)" in note for note in result.notes)


@pytest.mark.parametrize(
    ("original_draw", "says"),
    [
        (("randn", [2, 12], None, "s1"), "(4, 6) in the converted run"),
        (("randn", [4, 6], None, "other"), "not in the original's state"),
    ],
)
def test_draws_that_do_not_line_up_make_it_inconclusive(original_draw, says):
    sliced = [("randn", [4, 6], 0, "s1")]
    original = record(GRADS, draws=[original_draw])
    result = verdict(original, converted_pair(GRADS, draws=sliced))
    assert (result.exit_code, result.verdict) == (2, "inconclusive")
    assert says in " ".join(result.inconclusive)


def test_a_draw_sliced_by_rank_that_the_original_made_at_one_ranks_shape_asks_to_follow():
    # `torch.randn(n_outs, 1, z)` with a per-process batch of 1: the literal 1 looked like
    # the batch, so the ranks sliced it; the original drew (3, 1, 8), one rank's own shape.
    sliced = [("randn", [3, 2, 8], 1, "s1", 0, [3, 1, 8])]
    original = record(GRADS, draws=[("randn", [3, 1, 8], None, "s1", 0, [3, 1, 8])])
    comparison = compare_runs(original, converted_pair(GRADS, draws=sliced), 2, "per-rank")
    assert comparison.unsliced_in_original
    assert "random draws could not be aligned" in " ".join(comparison.inconclusive)
    # a draw the original made at yet another size is no such case
    other = record(GRADS, draws=[("randn", [3, 5, 8], None, "s1", 0, [3, 5, 8])])
    assert not compare_runs(
        other, converted_pair(GRADS, draws=sliced), 2, "per-rank"
    ).unsliced_in_original


def test_following_the_originals_draws_makes_a_draw_of_its_shape_whole_on_every_rank():
    made = []
    for rank in (0, 1):
        stub = DrawingStub(rank, 2)
        stub.config = {"original_draws": [["randn", [2, 8]], ["randn", [3, 1, 8]]]}
        draws = probe.RandomDraws(stub)
        draws.rows = 1
        torch.manual_seed(0)
        codes = draws.draw(lambda full: torch.randn(full), (1, 8), "randn")
        shared = draws.draw(lambda full: torch.randn(full), (3, 1, 8), "randn")
        made.append((codes, shared))
        assert [d[2] for d in stub.record["draws"]] == [0, None]  # sliced, then whole
        assert stub.record["flags"]["followed_draws"] == 1
    torch.manual_seed(0)
    codes, shared = torch.randn(2, 8), torch.randn(3, 1, 8)
    assert torch.equal(made[0][0], codes[0:1]) and torch.equal(made[1][0], codes[1:2])
    assert torch.equal(made[0][1], shared) and torch.equal(made[1][1], shared)


def test_numpy_permutations_are_made_whole_and_recorded_never_sliced(monkeypatch):
    numpy = pytest.importorskip("numpy")
    for name in probe.NUMPY_WHOLE_DRAWS:
        monkeypatch.setattr(numpy.random, name, getattr(numpy.random, name))
    stub = DrawingStub(1, 2)
    draws = probe.RandomDraws(stub)
    draws.rows = 4  # a permutation of 4 items looks like the batch, and is none
    draws.patch_numpy()
    numpy.random.seed(3)
    drawn = numpy.random.permutation(4)
    items = numpy.arange(6)
    numpy.random.shuffle(items)
    numpy.random.seed(3)
    assert drawn.tolist() == numpy.random.RandomState(3).permutation(4).tolist()
    expected = numpy.arange(6)
    state = numpy.random.RandomState(3)
    state.permutation(4)
    state.shuffle(expected)
    assert items.tolist() == expected.tolist()
    assert [(d[0], d[1], d[2]) for d in stub.record["draws"]] == [
        ("permutation", [4], None),
        ("shuffle", [6], None),
    ]


class StubProbe:
    def __init__(self, rank: int, world: int) -> None:
        self.torch, self.rank, self.world, self.role = torch, rank, world, "converted"
        self.record = {"draws": [], "flags": {}}
        self.seeding_depth, self.optimizers = 0, []


@pytest.mark.parametrize("as_numpy", [False, True])
@pytest.mark.parametrize("shape", [(12, 5), (3, 12, 2), (24, 7, 7)])
def test_each_rank_gets_the_rows_of_its_samples(shape, as_numpy):
    """DistributedSampler deals sample j to rank j % N: rank r's rows of the whole draw are
    its samples' rows, heads kept together when the dim is batch * heads."""
    world, rows = 3, 4
    dim = next(d for d, size in enumerate(shape) if size % rows == 0)
    whole_shape = list(shape)
    whole_shape[dim] *= world
    whole = torch.arange(float(torch.Size(whole_shape).numel())).reshape(whole_shape)
    if as_numpy:
        whole = whole.numpy()
    parts = []
    for rank in range(world):
        draws = probe.RandomDraws(StubProbe(rank, world))
        draws.rows = rows
        parts.append(draws.rank_part(whole, dim, shape[dim]))
    per_sample = shape[dim] // rows
    for rank, part in enumerate(parts):
        for local in range(rows):
            sample = local * world + rank
            mine = torch.as_tensor(part).narrow(dim, local * per_sample, per_sample)
            expected = torch.as_tensor(whole).narrow(dim, sample * per_sample, per_sample)
            assert torch.equal(mine, expected)


def test_the_batch_dimension_of_a_draw():
    draws = probe.RandomDraws(StubProbe(0, 2))
    assert draws.batch_dim((8, 100), "randn") is None  # no batch seen yet
    draws.rows = 8
    assert draws.batch_dim((8, 100), "randn") == 0
    assert draws.batch_dim((12, 8, 32), "dropout") == 1  # sequence first
    assert draws.batch_dim((32, 12, 12), "dropout") == 0  # batch * heads
    assert draws.batch_dim((64, 100), "randn") is None  # not a per-sample draw


class DrawingStub(StubProbe):
    def check_rng(self) -> None:
        pass

    def rng_drawn(self) -> None:
        pass


@pytest.mark.parametrize(
    "args, kwargs",
    [((0, 10, (5,)), {}), ((10,), {"size": (5,)}), ((), {"low": 0, "high": 10, "size": (5,)})],
)
def test_randint_draws_what_torch_draws_however_its_arguments_are_spelled(args, kwargs):
    """`torch.randint(low=0, high=n, size=s)` (DDIM's timesteps) once raised a TypeError
    under the probe, and verify then saw no optimizer step."""
    randint = probe.RandomDraws(DrawingStub(0, 1)).randint(torch.randint)
    torch.manual_seed(0)
    got = randint(*args, **dict(kwargs))
    torch.manual_seed(0)
    assert torch.equal(got, torch.randint(*args, **kwargs))


# -- BatchNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5, 5)])
def test_python_batch_norm_computes_what_torch_does(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(3, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    stats = [torch.zeros(3), torch.ones(3)]
    ours_stats = [s.clone() for s in stats]
    theirs = torch.nn.functional.batch_norm(x, *stats, weight, bias, True, 0.1, 1e-5)
    ours = probe.python_batch_norm(torch, x, *ours_stats, weight, bias, 0.1, 1e-5, False)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_stats, stats)
    upstream = torch.randn(*shape)
    expected = torch.autograd.grad(theirs, [x, weight, bias], upstream)
    torch.testing.assert_close(torch.autograd.grad(ours, [x, weight, bias], upstream), expected)


def test_only_code_that_names_sync_batch_norm_counts(tmp_path: Path):
    mentioned = tmp_path / "mentioned.py"
    mentioned.write_text('"""No SyncBatchNorm here."""\n# convert_sync_batchnorm is missing\n')
    converts = tmp_path / "converts.py"
    converts.write_text("model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n")
    assert not probe.mentions_sync_batch_norm(str(mentioned))
    assert probe.mentions_sync_batch_norm(str(converts))


# -- the original with the migration's fixes ----------------------------------------------------


def test_the_original_gets_the_unscale_the_migration_inserted():
    original = (AMP_CLIP / "original.py").read_text()
    fixes = fix_original(original, (AMP_CLIP / "converted.py").read_text(), "original.py")
    assert fixes.applied == ["DDP044 at line 47: scaler.unscale_() before gradient clipping"]
    lines = fixes.text.splitlines()
    unscale = next(i for i, line in enumerate(lines) if "scaler.unscale_(optimizer)" in line)
    assert "clip_grad_norm_" in lines[unscale + 1]
    compile(fixes.text, "original.py", "exec")


def test_a_conversion_that_kept_the_bug_is_compared_with_the_original_as_it_is():
    original = (AMP_CLIP / "original.py").read_text()
    fixes = fix_original(original, original, "original.py")
    assert not fixes.changed and fixes.text == original


def test_no_record_of_fixes_means_no_fix():
    original = (AMP_CLIP / "original.py").read_text()
    converted = (AMP_CLIP / "converted.py").read_text()
    assert not fix_original(original, converted, "original.py", fixed_codes=()).changed


def test_the_original_gets_the_set_epoch_the_migration_inserted():
    """A torchrun script without set_epoch, run as one process, would repeat its first epoch's
    order where the conversion reshuffles: the original runs with the same fix."""
    case = FIXTURES / "migrate" / "torchrun_fixes"
    original = (case / "before.py").read_text()
    fixes = fix_original(original, (case / "after.py").read_text(), "before.py")
    assert [fix.split(" at ")[0] for fix in fixes.applied] == ["DDP022"]
    assert "sampler.set_epoch(epoch)" in fixes.text


@pytest.mark.parametrize(("bias_grad", "matches"), [(1e-12, True), (8e-6, False)])
def test_weights_moved_by_rounding_noise_are_not_compared(bias_grad, matches):
    """Adam turns a gradient that is zero up to rounding (a bias before BatchNorm) into a
    full-size step of either sign; a small but real gradient is still compared."""
    grads = [torch.full((2, 2), 0.25), torch.full((2,), bias_grad)]
    original = record(grads)
    converted = converted_pair(grads)
    for rank in converted:
        rank["final"][0][1] = original["final"][0][1] + 1e-3
    result = verdict(original, converted)
    assert result.exit_code == (0 if matches else 1), result.message
    assert any("fc.bias not compared" in note for note in result.notes) == matches


@pytest.mark.parametrize(
    ("name", "shape", "mask"),
    [
        ("dropout1d", (4, 3, 5), (4, 3, 1)),
        ("dropout1d", (3, 5), (3, 1)),
        ("dropout2d", (4, 3, 5, 5), (4, 3, 1, 1)),
        ("dropout2d", (6, 5), (6, 5)),  # torch takes it as batched: element-wise
        ("dropout3d", (2, 3, 4, 4, 4), (2, 3, 1, 1, 1)),
    ],
)
def test_channel_dropout_masks_have_torchs_shape(name, shape, mask):
    import warnings

    batched_dims = probe.FEATURE_DROPOUTS[name]
    assert probe.feature_mask_shape(torch.ones(shape), batched_dims) == mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dropped = getattr(torch.nn.functional, name)(torch.ones(shape), 0.5, True)
    for dim, size in enumerate(mask):
        if size == 1:  # torch's mask is constant along the dims ours broadcasts over
            low, high = dropped.amin(dim), dropped.amax(dim)
            assert torch.equal(low, high)


def test_sync_batch_norm_is_looked_for_in_the_modules_the_script_imports(tmp_path):
    """A migrated project converts where its model is wrapped (another module); a
    script beside it that imports nothing of it is judged by its own code."""
    (tmp_path / "wrap.py").write_text(
        "import torch\n\n\ndef wrap(m):\n"
        "    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(m)\n",
        encoding="utf-8",
    )
    (tmp_path / "train.py").write_text("import wrap\n", encoding="utf-8")
    (tmp_path / "alone.py").write_text("import torch\n", encoding="utf-8")
    assert probe.project_mentions_sync_batch_norm(str(tmp_path / "train.py"))
    assert not probe.project_mentions_sync_batch_norm(str(tmp_path / "alone.py"))


# -- random augmentation, hand-made batches, padding ---------------------------------------------


def test_a_sample_gets_one_seed_whoever_fetches_it():
    seed = probe.sample_seed(5, 1)
    assert seed == probe.sample_seed(torch.tensor(5), 1) == probe.sample_seed(5, 1)
    assert seed != probe.sample_seed(6, 1) and seed != probe.sample_seed(5, 2)
    assert 0 <= seed < 2**32  # numpy takes no larger seed


def test_only_datasets_fetched_one_sample_at_a_time_are_seeded_per_sample():
    from torch.utils.data import Subset, TensorDataset

    class Batched(TensorDataset):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    plain = TensorDataset(torch.arange(4.0))
    assert probe.fetches_per_sample(plain)
    assert probe.fetches_per_sample(Subset(plain, [0, 2]))  # torch's loop over plain[i]
    assert not probe.fetches_per_sample(Batched(torch.arange(4.0)))
    assert not probe.fetches_per_sample(Subset(Batched(torch.arange(4.0)), [1]))


@pytest.mark.parametrize(("rows", "world"), [(8, 2), (7, 2), (10, 3)])
def test_a_block_split_batch_gets_the_rows_of_its_block(rows, world):
    """A hand-made batch split as migrate splits it: rank r's draw rows are its block's."""
    whole = torch.arange(float(rows * 3)).reshape(rows, 3)
    for rank in range(world):
        start, stop = probe.block_bounds(rows, rank, world)
        draws = probe.RandomDraws(StubProbe(rank, world))
        draws.rows, draws.block = stop - start, (start, rows)
        assert draws.whole_size(stop - start) == rows
        assert torch.equal(draws.rank_part(whole, 0, stop - start), whole[start:stop])


def hand_made(grads, rank=0, split=(8.0, 1.0, 2.0)):
    made = record(grads, rank=rank)
    made["loaders"] = []
    made["steps"][0].update(loader=None, data=None)
    if split is not None:
        made["steps"][0]["split"] = {"rows": 8, "block": [0, 4], "data": list(split)}
    return made


def test_a_hand_made_batch_split_by_rank_is_compared_conclusively():
    original = hand_made(GRADS, split=None)
    matched = verdict(original, [hand_made(GRADS, rank) for rank in (0, 1)])
    assert matched.verdict == "match", matched.message
    assert any("each process took its block of the same batch" in n for n in matched.notes)
    halved = verdict(original, [hand_made([g / 2 for g in GRADS], rank) for rank in (0, 1)])
    assert (halved.exit_code, halved.verdict) == (1, "mismatch"), halved.message


def test_without_the_split_a_hand_made_batch_difference_stays_inconclusive():
    original = hand_made(GRADS, split=None)
    result = verdict(original, [hand_made([g / 2 for g in GRADS], r, None) for r in (0, 1)])
    assert (result.exit_code, result.verdict) == (2, "inconclusive")
    assert "no DataLoader feeds the training loop" in result.message


def test_ranks_that_split_different_batches_are_a_data_mismatch():
    original = hand_made(GRADS, split=None)
    converted = [hand_made(GRADS, 0), hand_made(GRADS, 1, split=(8.0, 3.0, 2.0))]
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (1, "mismatch")
    assert "the ranks split different batches" in result.message


def loaded_and_split(grads, rank=0, loaded=(8.0, 1.0, 2.0), batch_size=8):
    """A converted rank that loads the whole batch from its loader and keeps its block."""
    run = record(grads, rank=rank, data=loaded)
    run["loaders"] = [{"batch_size": batch_size, "used_batch_size": batch_size, "policy": None}]
    run["steps"][0]["split"] = {"rows": 8, "block": [4 * rank, 4 * rank + 4], "data": [8, 1, 2]}
    return run


def whole_batch_original():
    original = record(GRADS, data=(8.0, 1.0, 2.0))
    original["loaders"] = [{"batch_size": 8, "used_batch_size": 8, "policy": "global"}]
    return original


def test_a_loaders_batch_split_by_hand_is_compared_rank_by_rank_with_the_original():
    matched = verdict(whole_batch_original(), [loaded_and_split(GRADS, r) for r in (0, 1)])
    assert (matched.exit_code, matched.verdict) == (0, "match"), matched.message
    assert any(
        "every one of the 2 processes loads 8 and keeps its block" in n for n in matched.notes
    )
    halved = [loaded_and_split([g / 2 for g in GRADS], r) for r in (0, 1)]
    assert verdict(whole_batch_original(), halved).verdict == "mismatch"


def test_ranks_that_load_another_batch_than_the_original_before_splitting_it_mismatch():
    converted = [loaded_and_split(GRADS, r, loaded=(8.0, 5.0, 9.0)) for r in (0, 1)]
    result = verdict(whole_batch_original(), converted)
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    assert "did not load the original's batch" in result.message


def test_a_loader_batch_split_by_hand_must_be_the_originals_whole_batch():
    converted = [loaded_and_split(GRADS, r, batch_size=4) for r in (0, 1)]
    result = verdict(whole_batch_original(), converted)
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    assert "loads batch 4 on each process and splits it by rank" in result.message


def two_steps(grads_2, rank=0, padded=0):
    """A run of two steps; the second on a batch the DistributedSampler padded or not."""
    data = (2.0, 0.5, 1.0) if rank is not None else (4.0, 1.0, 2.0)  # each rank half the batch
    run = record(GRADS, rank=rank or 0, data=data)
    weights = [p - 0.1 * g for p, g in zip(run["initial"][0], GRADS)]
    second = {**run["steps"][0], "step": 2, "grads": grads_2, "weights": weights}
    run["steps"][0]["padded"], second["padded"] = 0, padded
    run["steps"].append(second)
    run["final"] = {0: [w - 0.1 * g for w, g in zip(weights, grads_2)]}
    run["draws"] = [["randn", [4, 6], 0, "s1", 0], ["randn", [6, 6], 0, "s2", 1]]
    if padded:
        run["flags"]["padded"] = [7, 2]
    return run


def test_steps_on_padded_batches_are_left_out_of_the_comparison():
    original = two_steps(GRADS, rank=None)
    original["draws"][1][1] = [5, 6]  # the original's last batch is smaller
    other = [g + 1 for g in GRADS]
    converted = [two_steps(other, rank, padded=1) for rank in (0, 1)]
    comparison = compare_runs(original, converted, 2, "per-rank")
    result = conclude(VerifyResult(2, "error", ""), comparison, 2)
    assert result.verdict == "match", result.message
    assert [r.step for r in result.steps if r.compared == "gradients"] == [1]
    assert any(r.compared == "weights after step 1" for r in result.steps)
    assert any("compared the steps before step 2 only" in n for n in result.notes), result.notes
    unpadded = verdict(original, [two_steps(other, rank) for rank in (0, 1)])
    assert unpadded.verdict != "match"


def test_generators_made_without_a_seed_get_the_same_one_in_every_run(monkeypatch):
    numpy = pytest.importorskip("numpy")
    native = numpy.random.default_rng
    draws = []
    for _ in range(2):  # two runs of the same script, each under its own probe
        monkeypatch.setattr(numpy.random, "default_rng", native)
        run = probe.Probe({"role": "original", "steps": 1})
        run.seed_fresh_numpy_generators()
        first, second = numpy.random.default_rng(), numpy.random.default_rng(seed=None)
        draws.append((first.random(3).tolist(), second.random(3).tolist()))
        assert run.record["flags"]["fresh_entropy"] == "numpy.random.default_rng()"
        assert numpy.random.default_rng(7).random() == native(7).random()  # the script's own
    assert draws[0] == draws[1] and draws[0][0] != draws[0][1]


def test_the_probe_recognises_the_note_migrate_writes_on_a_hand_split_batch():
    # verify finds migrate's split by this note's text: a rewording would silently turn
    # hand-made-batch comparisons inconclusive again.
    from ddpify.migrate.data import HAND_MADE_NOTE

    assert probe.HAND_SPLIT_MARKER in HAND_MADE_NOTE


# -- batches compared with themselves (contrastive losses) ------------------------------------


def test_a_contrastive_loss_makes_differing_gradients_inconclusive_naming_it():
    flags = {"batch_comparison": "torch.matmul(z, z.T) (losses.py:14)"}
    result = verdict(record(GRADS), converted_pair([g + 0.1 for g in GRADS], flags))
    assert (result.exit_code, result.verdict) == (2, "inconclusive"), result.message
    assert any("losses.py:14" in reason for reason in result.inconclusive)


def test_a_contrastive_loss_does_not_stop_agreeing_gradients_from_matching():
    flags = {"batch_comparison": "torch.matmul(z, z.T) (losses.py:14)"}
    result = verdict(record(GRADS), converted_pair(GRADS, flags))
    assert (result.exit_code, result.verdict) == (0, "match"), result.message


# The precision check's float64 reaches the float32 tensors a script makes itself. Run in a
# child process: the widening changes torch for the rest of the process.
WIDENED_SCRIPT = """
import numpy as np
import torch
from ddpify.verify import probe_float64

class Probe:
    torch = torch
    counts = 0
    def count(self, name):
        Probe.counts += 1

torch.set_default_dtype(torch.float64)
probe_float64.widen_script_floats(Probe())
FloatTensor = torch.cuda.FloatTensor if torch.cuda.is_available() else torch.FloatTensor
noise = FloatTensor(np.random.normal(0, 1, (4, 3)))
made = {
    "FloatTensor(numpy)": noise,
    "FloatTensor(n, m).fill_": FloatTensor(4, 1).fill_(1.0),
    ".float()": torch.arange(3).float(),
    ".to(float32)": torch.ones(2).to(torch.float32),
    ".to(dtype=float32)": torch.ones(2).to(dtype=torch.float32),
    ".type(FloatTensor)": torch.arange(3).type(FloatTensor),
    ".type('torch.FloatTensor')": torch.ones(2).type("torch.FloatTensor"),
    "zeros(dtype=float32)": torch.zeros(2, dtype=torch.float32),
    "tensor(numpy float32)": torch.tensor(np.ones(2, dtype=np.float32)),
    "as_tensor(numpy float32)": torch.as_tensor(np.ones(2, dtype=np.float32)),
    "from_numpy(numpy float32)": torch.from_numpy(np.ones(2, dtype=np.float32)),
    "Linear.float()": torch.nn.Linear(3, 2).float().weight,
}
for name, tensor in made.items():
    assert tensor.dtype == torch.float64, (name, tensor.dtype)
assert torch.nn.Linear(3, 2)(noise).dtype == torch.float64
precise = torch.tensor([1 + 2.0**-40]).float()
assert precise.item() == 1 + 2.0**-40, "rounded to float32 on the way"
assert torch.arange(3).dtype == torch.int64 and torch.ones(2, dtype=torch.half).dtype == torch.half
assert torch.cuda.FloatTensor is torch.cuda.DoubleTensor
assert Probe.counts >= 3
print("widened", len(made))
"""


def test_the_precision_check_makes_the_float32_tensors_a_script_makes_float64(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    done = subprocess.run(
        [sys.executable, "-c", WIDENED_SCRIPT],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "widened 12" in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "sums"),
    [
        ({"reduction": "sum"}, True),
        ({"size_average": False}, True),  # the legacy spelling (a VAE's reconstruction loss)
        ({"size_average": False, "reduce": True}, True),
        ({"size_average": False, "reduce": False}, False),  # one loss per sample
        ({"reduction": "mean"}, False),
        ({}, False),
    ],
)
def test_a_loss_summed_over_the_batch_is_recognised_in_either_spelling(kwargs, sums):
    assert probe.sums_over_batch(kwargs) is sums
