"""ddpify verify end to end: the scripts really run, one process against torchrun with two.

CPU and gloo by default; the `gpu` variants run the same fixtures on CUDA where there is a
GPU: with two, each rank has its own and the fixtures pick nccl; with one, the two ranks share
it and verify runs their collectives on gloo (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpify.verify import run_verify
from ddpify.verify.batch import VerifyJob, run_verify_many
from ddpify.verify.markers import read_markers
from ddpify.verify.report import render_text
from tests.helpers import FIXTURES, ROOT

torch = pytest.importorskip("torch")

VERIFY = FIXTURES / "verify"
MLP = VERIFY / "mlp"
BROKEN = VERIFY / "broken"
GPU = torch.cuda.is_available()

# The tests that read the batch run on one worker: the batch runs once per module and worker.
pytestmark = pytest.mark.torchrun
in_batch = pytest.mark.xdist_group("verify_runs_batch")

# (converted script, first step that goes wrong, first parameter that goes wrong, finding kind)
PLANTED_BUGS = [
    ("bug_no_sampler.py", 1, "encoder.0.weight", "data"),
    ("bug_loss_divided.py", 1, "encoder.0.weight", "gradients"),
    ("bug_rank_weights.py", 1, "head.weight", "ranks"),
    ("bug_no_grad_average.py", 1, "encoder.0.weight", "gradients"),
    ("bug_no_set_epoch.py", 3, "encoder.0.weight", "data"),
]


def marked_options(converted: Path, options: dict) -> dict:
    """run_verify's options, with the policy and LR scale the converted script's markers say."""
    markers = read_markers(converted.read_text())
    options.setdefault("batch_policy", markers.batch_policy or "auto")
    options.setdefault("lr_scale", markers.lr_scale(options.get("nproc", 2)))
    return options


def verify(converted: Path, tmp_path: Path, original: Path = MLP / "original.py", **options):
    return run_verify(original, converted, cwd=tmp_path, **marked_options(converted, options))


# (original, converted, options) of the pairs whose tests read only the verdict. They run in
# one batch per device (ddpify/verify/batch.py: one torchrun launch for every conversion, one
# process for every original) instead of four torch start-ups each; the tests about the runs
# themselves (a crash, a hang, Ctrl-C, the environment, the CLI) launch as `ddpify verify` does.
def batched_pairs() -> dict[str, tuple[Path, Path, dict]]:
    pairs = {
        "crash": (MLP / "original.py", BROKEN / "crash_converted.py", {}),
        "hang": (MLP / "original.py", BROKEN / "hang_converted.py", {"timeout": 5}),
        "mlp": (MLP / "original.py", MLP / "converted.py", {}),
    }
    for name, *_ in PLANTED_BUGS:
        pairs[name] = (MLP / "original.py", MLP / name, {})
    for case, _ in OWN_FIXTURES:
        pairs[case] = (VERIFY / case / "original.py", VERIFY / case / "converted.py", {})
    for case, name, _ in OWN_PLANTED_BUGS:
        pairs[f"{case}/{name}"] = (VERIFY / case / "original.py", VERIFY / case / name, {})
    for case, _ in MIGRATED_FIXTURES:
        migrated = FIXTURES / "migrate" / case
        pairs[f"migrate/{case}"] = (migrated / "before.py", migrated / "after.py", {})
    global_policy = {"batch_policy": "global", "lr_scale": None}  # the markers say per-rank
    pairs["global policy"] = (MLP / "original.py", MLP / "converted.py", global_policy)
    for case, converted, *_ in PER_RANK_MATCHES + PER_RANK_BUGS:
        folder = VERIFY / case
        pairs[f"{case}/{converted}"] = (folder / "original.py", folder / converted, {})
    points = VERIFY / "point_subsample"
    pairs["numpy seeded by rank"] = (
        points / "original.py",
        points / "bug_numpy_seed_per_rank.py",
        {},
    )
    stream = VERIFY / "token_stream"
    pairs["unsharded stream"] = (stream / "original.py", stream / "bug_stream_not_sharded.py", {})
    mixup = {"script_args": ["--mixup"]}
    augment = VERIFY / "augment"
    pairs["mixup"] = (augment / "original.py", augment / "converted.py", mixup)
    # 63 samples, 24 per process: step 2 trains on a sample the DistributedSampler repeated
    padded = {"script_args": ["--samples", "63", "--batch-size", "24"]}
    pairs["padded"] = (augment / "original.py", augment / "converted.py", padded)
    critic = VERIFY / "critic_gp"
    pairs["critic_gp"] = (critic / "original.py", critic / "converted.py", {})
    no_epochs = {"script_args": ["--epochs", "0"]}
    pairs["no epochs"] = (MLP / "original.py", MLP / "converted.py", no_epochs)
    return pairs


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """device -> {pair name: its VerifyResult}, every pair run once per device and module."""
    runs: dict[str, dict] = {}

    def results(device: str) -> dict:
        if device not in runs:
            names, jobs = [], []
            for name, (original, converted, options) in batched_pairs().items():
                cwd = tmp_path_factory.mktemp(f"{device}-{name.replace('/', '-')}")
                options = marked_options(converted, {**options, "cwd": cwd})
                names.append(name)
                jobs.append(VerifyJob(original, converted, options))
            with pytest.MonkeyPatch.context() as patch:
                if device == "cpu":
                    patch.setenv("CUDA_VISIBLE_DEVICES", "")
                runs[device] = dict(zip(names, run_verify_many(jobs)))
        return runs[device]

    return results


def cpu_and_gpu(test):
    """Run the test on CPU/gloo, and again on CUDA where a GPU is present."""
    gpu = pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA device")],
    )
    return pytest.mark.parametrize("device", ["cpu", gpu])(test)


@pytest.fixture
def device_env(device, monkeypatch):
    if device == "cpu":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return device


def known_gpu_gap(device: str, result, case: str = "mlp") -> None:
    """Gaps seen on an H100 (2026-11-23) and not closed yet: reported as xfail there."""
    if device != "cuda":
        return
    if result.verdict == "inconclusive" and "random draws could not be aligned" in result.message:
        pytest.xfail("CUDA dropout draws are not aligned between 1 and N processes yet")
    if case == "gan" and result.verdict == "mismatch":
        pytest.xfail("bf16 autocast against the fp32 original drifts past the AMP check by step 2")


@in_batch
@cpu_and_gpu
def test_correct_conversion_matches(device_env, tmp_path, batched):
    result = verify(MLP / "converted.py", tmp_path)
    known_gpu_gap(device_env, result)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    gradients = [row for row in result.steps if row.compared == "gradients"]
    assert [row.step for row in gradients] == [1, 2, 3]
    assert all(row.ok for row in result.steps)
    assert any("multiplied by 2" in note for note in result.notes)  # linear LR scaling
    assert not (tmp_path / "mlp.pt").exists()  # stopped after 3 steps, before the save
    # The batch the other tests read judges this pair as `ddpify verify` does, number for number.
    batch = batched(device_env)["mlp"]
    assert (batch.exit_code, batch.message, batch.notes) == (0, result.message, result.notes)
    assert (batch.steps, batch.settings) == (result.steps, result.settings)


@in_batch
@pytest.mark.parametrize("converted", [name for name, *_ in PLANTED_BUGS])
@cpu_and_gpu
def test_planted_bug_fails_at_its_step_and_parameter(converted, device_env, batched):
    _, step, parameter, kind = next(bug for bug in PLANTED_BUGS if bug[0] == converted)
    result = batched(device_env)[converted]
    known_gpu_gap(device_env, result)
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    first = result.first_mismatch
    assert (first.step, first.parameter) == (step, parameter)
    assert any(f.what == kind and f.step == step for f in result.findings)


# Our fixtures in the styles real projects use, each with the conversion `ddpify migrate`
# wrote (the GAN's generator wrapped by hand, which that migration missed); the note each
# run must carry says which mechanism made it comparable.
OWN_FIXTURES = [
    ("gan", "random draw(s) in the training loop"),
    ("transformer", "random draw(s) in the training loop"),
    ("cnn_bn", "BatchNorm statistics all-reduced across the processes by the probe"),
    ("amp_clip", "DDP044 at line 47: scaler.unscale_() before gradient clipping"),
    ("augment", "random augmentation drawn per sample from a seed of its index: aligned"),
    ("toy_stream", "each process took its block of the same batch"),
    # numpy's global permutation drawn inside the step (random point subsets): made whole
    ("point_subsample", "3 numpy permutation(s) or shuffle(s) made whole on every process"),
    # `torch.randn(num_outs, 1, z)` at a per-process batch of 1: the literal 1 is no batch
    ("style_codes", "made whole on every process, as the original drew them"),
    # BatchNorm over raw readings (~1e5): float32 rounding of the synced statistics differs
    # beyond the tolerance, float64 shows it is rounding (the precision check)
    ("sensor_bn", "precision check: in float32 the one-process run differed"),
    # Noise made as `FloatTensor(np.random.normal(...))`, labels as `FloatTensor(n, 1)`: the
    # precision check's float64 reaches the tensors the script makes itself
    ("numpy_noise_gan", "precision check: in float32 the one-process run differed"),
    # An endless loader drawing with replacement, each rank its block of the whole batch
    ("endless_sampler", "every one of the 2 processes loads 16 and keeps its block"),
]


@in_batch
@pytest.mark.parametrize(("case", "note"), OWN_FIXTURES)
@cpu_and_gpu
def test_own_fixture_conversion_verifies(case, note, device_env, batched):
    result = batched(device_env)[case]
    known_gpu_gap(device_env, result, case)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    if device_env == "cpu" or case != "cnn_bn":
        assert any(note in n for n in result.notes), result.notes
    if device_env == "cuda" and torch.cuda.device_count() < 2:
        assert any("ranks share the GPU" in n for n in result.notes), result.notes


# Migrate fixtures (fixtures/migrate/<case>/): the conversion `ddpify migrate` writes itself
# (tests/test_migrate.py keeps after.py equal to it), verified against before.py.
MIGRATED_FIXTURES = [
    ("model_list_batchnorm", "BatchNorm statistics all-reduced across the processes by the probe"),
]


@in_batch
@pytest.mark.parametrize(("case", "note"), MIGRATED_FIXTURES)
@cpu_and_gpu
def test_migrated_fixture_verifies(case, note, device_env, batched):
    result = batched(device_env)[f"migrate/{case}"]
    known_gpu_gap(device_env, result, case)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    if device_env == "cpu":
        assert any(note in n for n in result.notes), result.notes


# (fixture, planted bug, what the first mismatch must say)
OWN_PLANTED_BUGS = [
    ("gan", "bug_discriminator_not_wrapped.py", "gradients of rank 1 differ from rank 0's"),
    ("transformer", "bug_forward_bypasses_ddp.py", "gradients of rank 1 differ from rank 0's"),
    # Augmented per sample, the data are compared again: a missing sampler is named as such.
    ("augment", "bug_no_sampler.py", "every process saw the same batch"),
    # Hand-made batches: conclusive, so a wrong conversion is a mismatch, not inconclusive.
    ("toy_stream", "bug_loss_divided.py", "0.5x the original's"),
    ("toy_stream", "bug_seed_per_rank.py", "the ranks split different batches"),
    # A weighted draw shared out by rank (migrate/weighted.py), every rank keeping rank 0's
    # share: the probe aligns the draws, not the shares, so the data differ.
    ("weighted", "bug_same_share_on_every_rank.py", "every process saw the same batch"),
    # The discriminator's gradients twice the original's: neither the per-rank reference nor
    # the precision check (float64, which reaches its FloatTensor noise) takes the mismatch away.
    ("numpy_noise_gan", "bug_d_loss_not_halved.py", "gradients differ from the original's"),
    ("endless_sampler", "bug_loss_divided.py", "0.5x the original's"),
    # The sampler keeps its own draw (seeded per rank here): the batches are compared.
    ("endless_sampler", "bug_seed_per_rank.py", "the ranks split different batches"),
]


@in_batch
@pytest.mark.parametrize(("case", "converted", "says"), OWN_PLANTED_BUGS)
@cpu_and_gpu
def test_own_planted_bug_fails(case, converted, says, device_env, batched):
    result = batched(device_env)[f"{case}/{converted}"]
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    assert says in result.message


# Conversions that compute, by design, what no single process computes: compared with the
# one-process original they are inconclusive (the reason it names), so verify compares them
# with the original run as DDP (the per-rank reference), and says so.
# (case, converted script, the one-process reason, what differs by design, a note it carries)
PER_RANK_MATCHES = [
    (
        "cnn_bn",
        "converted_local_bn.py",
        "BatchNorm without SyncBatchNorm",
        "BatchNorm statistics are per process",
        "by design, as in the per-rank reference: BatchNorm statistics are per process",
    ),
    (
        "contrastive",
        "converted.py",
        "samples of a batch compared with each other",
        "each process compares only its own samples of the batch (`features @ features.T "
        "(converted.py:84)`)",
        # the conversion's SyncBatchNorm (emulated on CPU): the reference sums them too
        "the per-rank reference summed BatchNorm statistics over its processes",
    ),
    (
        "token_stream",
        "converted.py",
        "a loss averaged over the targets it does not ignore",
        "each process averages its loss over its own count of targets (cross_entropy(..., "
        "ignore_index=0))",
        # the stream's `random.randint` windows, isolated and seeded alike in all runs
        "random numbers drawn by a stream the conversion shards round-robin: aligned",
    ),
    (
        "patch_nce",
        "converted.py",
        "rows of the batch regrouped by a batch-size setting",
        "the loss groups the batch's rows by the configured batch size (`torch.bmm(feat_q, "
        "feat_k.transpose(2, 1)) (converted.py:113)`)",
        # the patch sampler's numpy permutation, drawn in the step, aligned in every run
        "numpy permutation(s) or shuffle(s) made whole on every process",
    ),
    (
        "antithetic",
        "converted.py",
        "random draws could not be aligned",
        "random draw 1 (randint) is sized by the per-process batch: (9,) on each process",
        "3 random draw(s) in the training loop",
    ),
]


@in_batch
@pytest.mark.parametrize(("case", "converted", "reason", "cause", "note"), PER_RANK_MATCHES)
def test_conversion_matches_the_original_run_as_ddp(case, converted, reason, cause, note, batched):
    result = batched("cpu")[f"{case}/{converted}"]
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert result.reference == "per-rank"
    assert result.message.startswith("against the original run as DDP (each process its share")
    assert "gradients match at all 3 steps" in result.message
    assert f"it differs from the one-process run by design: {cause}" in result.message
    assert result.as_dict()["reference"] == "per-rank"
    assert "compared with the original run as DDP on 2 processes" in render_text(result)
    one_process = next(n for n in result.notes if n.startswith("against the one-process run"))
    assert f"inconclusive: the runs differ, but the comparison cannot be trusted: {reason}" in (
        one_process
    )
    assert any("built the same initial weights" in n for n in result.notes)
    assert any(note in n for n in result.notes), result.notes


# Planted bugs in those conversions: still a mismatch. The one-process comparison names the
# data and rank ones itself (the reference never runs there: a mismatch is never rescued);
# only a wrong scale of the gradients needs the reference to be seen.
# (case, planted bug, judged against, what the message must say)
PER_RANK_BUGS = [
    ("cnn_bn", "bug_local_bn_loss_divided.py", "per-rank", "0.5x the original's"),
    ("cnn_bn", "bug_local_bn_not_wrapped.py", "one-process", "gradients of rank 1 differ"),
    ("cnn_bn", "bug_local_bn_no_sampler.py", "one-process", "every process saw the same batch"),
    ("contrastive", "bug_seed_per_rank.py", "one-process", "did not see the original's batch"),
    ("token_stream", "bug_loss_divided.py", "per-rank", "0.5x the original's"),
]


@in_batch
@pytest.mark.parametrize(("case", "converted", "against", "says"), PER_RANK_BUGS)
def test_planted_bug_in_a_per_rank_conversion_fails(case, converted, against, says, batched):
    result = batched("cpu")[f"{case}/{converted}"]
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    assert says in result.message
    assert result.reference == against
    assert ("reference" in result.seconds) == (against == "per-rank")
    if against == "per-rank":
        assert "(the conversion does not compute DDP of the original)" in result.message


@in_batch
def test_the_precision_check_runs_a_script_that_makes_float32_noise_and_keeps_its_bug(batched):
    # `FloatTensor(np.random.normal(...))` met the float64 model ("mat1 and mat2 must have
    # the same dtype") until float64 reached the tensors a script makes itself.
    result = batched("cpu")["numpy_noise_gan/bug_d_loss_not_halved.py"]
    assert (result.exit_code, result.verdict) == (1, "mismatch"), result.message
    precision = [n for n in result.notes if n.startswith("the precision check")]
    assert precision and "does not settle it" in precision[0], result.notes
    assert "2x the original's" in precision[0]


@in_batch
def test_a_stream_every_rank_reads_whole_is_never_a_match(batched):
    """Without the round-robin switch, the ranks read the same items: verify cannot align
    them with the single process's batch, and says so instead of comparing."""
    result = batched("cpu")["unsharded stream"]
    assert result.verdict != "match", result.message
    assert any("an IterableDataset decides its own order" in r for r in result.inconclusive)


@in_batch
def test_numpy_draws_from_a_generator_seeded_by_rank_are_never_a_match(batched):
    """Each rank seeds numpy with its rank: its permutations are other numbers than the
    original's, which the state check at each draw says instead of comparing."""
    result = batched("cpu")["numpy seeded by rank"]
    assert result.verdict == "inconclusive", result.message
    assert any("at draw 1 (permutation)" in reason for reason in result.inconclusive)


@in_batch
def test_random_numbers_drawn_outside_the_seeded_fetch_stay_inconclusive(batched):
    """Mixup in collate_fn draws for the whole batch, outside any one sample's fetch."""
    result = batched("cpu")["mixup"]
    assert (result.exit_code, result.verdict) == (2, "inconclusive"), result.message
    assert any("the data pipeline draws random numbers" in r for r in result.inconclusive)


@in_batch
def test_steps_after_the_sampler_pads_the_epoch_are_not_compared(batched):
    result = batched("cpu")["padded"]
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert [row.step for row in result.steps if row.compared == "gradients"] == [1]
    assert any("compared the steps before step 2 only" in n for n in result.notes), result.notes


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_fp16_migration_that_inserted_unscale_verifies_on_gpu(tmp_path):
    """The issue's case: fp16 + GradScaler, the migration inserted unscale_ before clipping.
    Compared with the unfixed original it was a MISMATCH blamed on the process count."""
    from ddpify.migrate.pipeline import migrate_source

    before = FIXTURES / "migrate" / "single_amp_legacy" / "before.py"
    migration = migrate_source(before.read_text(), str(before))
    assert "DDP044" in migration.fixed_codes
    result = run_verify(
        before,
        before.with_name("verify_gpu_after.py"),
        converted_source=migration.output,
        batch_policy=migration.batch_policy,
        lr_scale=migration.lr_scale_for(2),
        fixed_codes=sorted(migration.fixed_codes),
        cwd=tmp_path,
    )
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert any("DDP044" in note for note in result.notes)
    assert result.settings["device"] == "cuda"


def test_ranks_sharing_a_device_run_on_gloo(tmp_path, monkeypatch):
    """The one-GPU path, minus CUDA: LOCAL_RANK mapped onto 1 device, nccl asked -> gloo."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr("ddpify.verify.runner.visible_gpus", lambda: 1)
    result = verify(VERIFY / "bn" / "converted.py", tmp_path, VERIFY / "bn" / "original.py")
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert any("ranks share the GPU" in note and "gloo" in note for note in result.notes)


def test_cli_reads_global_policy_markers_and_prints_json(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpify",
            "verify",
            str(MLP / "original.py"),
            str(MLP / "converted_global.py"),
            "--output-format",
            "json",
            "--",
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0, report["message"]
    assert report["verdict"] == "match"
    assert report["settings"]["batch_policy"] == "global"
    assert any("original batch 8 run at 8, 4 per process" in note for note in report["notes"])


def test_crash_exits_2_with_the_scripts_output(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = verify(BROKEN / "crash_converted.py", tmp_path)
    assert (result.exit_code, result.verdict, result.failed_run) == (2, "error", "converted")
    assert "converted script crashed" in result.message
    assert "history" in result.message  # the script's own error, not ours
    assert "UnboundLocalError" in result.converted_output


@in_batch
def test_no_optimizer_step_exits_2(batched):
    result = batched("cpu")["no epochs"]
    assert result.exit_code == 2
    assert "without an optimizer step" in result.message


@in_batch
def test_a_batch_goes_on_after_a_crash_and_a_hang(batched):
    """In a batch, a pair that crashes or hangs fails alone: the pairs after it still run."""
    crash, hang = batched("cpu")["crash"], batched("cpu")["hang"]
    assert (crash.exit_code, crash.verdict, crash.failed_run) == (2, "error", "converted")
    assert "UnboundLocalError" in crash.converted_output
    assert (hang.exit_code, hang.failed_run) == (2, "converted")
    assert "timed out after 5 s" in hang.message
    assert batched("cpu")["mlp"].verdict == "match"


def probe_processes(script: Path) -> list[int]:
    """Live processes whose command line names `script` (the probe runs it by path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(script).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_timeout_exits_2_and_leaves_no_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hang = BROKEN / "hang_converted.py"
    result = verify(hang, tmp_path, timeout=25)
    assert (result.exit_code, result.failed_run) == (2, "converted")
    assert "timed out after 25 s" in result.message
    assert probe_processes(hang) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_process(tmp_path):
    # A copy of its own: processes are found by script path, and the timeout test may be
    # running the same hanging script at the same time in another worker.
    hang = tmp_path / "hang_converted_ctrl_c.py"
    shutil.copy(BROKEN / "hang_converted.py", hang)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    ddpify = subprocess.Popen(
        [sys.executable, "-m", "ddpify", "verify", str(MLP / "original.py"), str(hang)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # As from a terminal: a test worker may ignore SIGINT, and an ignored SIGINT is
        # inherited, so Python would never raise KeyboardInterrupt in the child.
        preexec_fn=_sigint_default,
    )
    deadline = time.monotonic() + 120
    while len(probe_processes(hang)) < 3 and time.monotonic() < deadline:  # agent + 2 workers
        time.sleep(0.5)
    assert len(probe_processes(hang)) >= 3, "the workers never started"
    ddpify.send_signal(signal.SIGINT)
    assert ddpify.wait(timeout=120) == 130
    assert probe_processes(hang) == []


@in_batch
def test_lr_scaling_is_a_mismatch_under_the_global_policy(batched):
    """The per-rank conversion scales the LR by N and keeps the batch: wrong for `global`."""
    result = batched("cpu")["global policy"]
    assert result.exit_code == 1
    assert {f.what for f in result.findings} >= {"batch size", "learning rate"}


def test_verify_needs_no_numpy(tmp_path, monkeypatch):
    # torch runs without numpy, and so do users' scripts; the probe once hashed the
    # generator's state with Tensor.numpy() and crashed every run in a fresh venv.
    hidden = tmp_path / "no_numpy"
    hidden.mkdir()
    (hidden / "numpy.py").write_text(
        'raise ModuleNotFoundError("No module named numpy", name="numpy")\n'
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hidden), str(ROOT)]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = verify(MLP / "converted.py", tmp_path)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message


@in_batch
def test_the_words_count_every_optimizers_steps(batched):
    """A critic stepped on every batch, the generator on every third (built first, so it is
    optimizer 0, whose steps `--steps` counts): the data runs out after two generator
    steps. The report says so, and that the match covers the critic's six steps too."""
    result = batched("cpu")["critic_gp"]
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert "gradients match at all 8 optimizer steps (optimizer 0: 2, optimizer 1: 6)" in (
        result.message
    )
    for role in ("original", "converted"):
        assert (
            f"the {role} script ended by itself after 2 of the 3 steps of optimizer 0 asked "
            "for (the run stops at optimizer 0's step 3); meanwhile the other optimizers "
            "stepped too (optimizer 1: 6)"
        ) in result.notes
    gradients = [(row.optimizer, row.step) for row in result.steps if row.compared == "gradients"]
    assert sorted(gradients) == [(0, 1), (0, 2)] + [(1, step) for step in range(1, 7)]
    assert (
        "3 steps of optimizer 0 (every optimizer's steps until then compared)"
        in (render_text(result).splitlines()[0])
    )
