"""Every fixtures/migrate case that trains must verify: 1 process against 2, both batch policies.

The migration runs in memory (`migrate_source` with the policy) and verify runs its output in
place of the file, as `ddpify migrate --verify` does, all pairs in one batch of runs. Cases
that are not migrated, or whose original does not train on its own without arguments, are
skipped with the reason.
"""

from __future__ import annotations

import pytest

from ddpify.verify.batch import VerifyJob, run_verify_many
from ddpify.verify.markers import read_markers
from tests.helpers import FIXTURES

pytest.importorskip("torch")
pipeline = pytest.importorskip("ddpify.migrate.pipeline")
analyze = pytest.importorskip("ddpify.migrate.analyze")

LAUNCHES_ITSELF = {analyze.Shape.SPAWN.value, analyze.Shape.LAUNCH.value}
CASES = sorted(path.parent.name for path in (FIXTURES / "migrate").glob("*/before.py"))
# Cases verify cannot judge yet, decided before running (each run costs torch start-ups):
# they draw random numbers between optimizer steps (GAN noise, get_batch() windows), and
# verify calls any such comparison inconclusive, even when the runs agree (handmade_get_batch
# agrees at every step).
DRAWS_RANDOM_EACH_STEP = {
    "gan_main_inline",
    "gan_r1_penalty",
    "handmade_get_batch",
    "handmade_conditional_seed",
    "hand_batch_converted",  # numpy draws each step's batch (runs in test_migrate_run)
}
# Cases whose step calls a part of the model outside DDP's forward (`model.encoder(x)`): the
# migration reports it as needing a human (DDP033, tests/test_migrate.py), and verify finds
# the ranks' gradients differ, as it should (checked by hand: it costs a minute of torch runs).
BYPASSES_THE_WRAPPER = {"submodule_call", "seq2seq_module_methods"}
# Cases that train on an IterableDataset: the stream decides its own order, which verify
# does not align between 1 and N processes (inconclusive; the case runs in test_migrate_run).
READS_A_STREAM = {"text_stream"}
POLICIES = ["per-rank", "global"]
# One worker runs them all: the module's pairs share one batch of verify runs.
pytestmark = [pytest.mark.torchrun, pytest.mark.xdist_group("verify_migrate")]


def migrate_case(case: str, policy: str):
    """The migration of `case` under `policy`, and why it is not verified (None: it is)."""
    before = FIXTURES / "migrate" / case / "before.py"
    options = analyze.Options(batch_policy=policy)
    migration = pipeline.migrate_source(before.read_text(), str(before), options)
    if not migration.migrated or migration.output == migration.original:
        return migration, f"not migrated: {migration.reason or 'nothing to change'}"
    # Decided before running anything: each verify run costs several torch start-ups.
    if migration.shape in LAUNCHES_ITSELF:
        return migration, "the original launches its own processes: it cannot run as one process"
    if case in DRAWS_RANDOM_EACH_STEP:
        return migration, "random numbers drawn between optimizer steps: verify is inconclusive"
    if case in BYPASSES_THE_WRAPPER:
        return migration, "the step bypasses DDP's forward: reported as needing a human"
    if case in READS_A_STREAM:
        return migration, "an IterableDataset orders its own items: verify is inconclusive"
    return migration, None


def verify_job(case: str, policy: str, migration, cwd) -> VerifyJob:
    before = FIXTURES / "migrate" / case / "before.py"
    # What the migration wrote decides, as for `ddpify verify`: a script that was already
    # distributed keeps its batch whatever policy was asked for.
    markers = read_markers(migration.output)
    options = {
        "converted_source": migration.output,
        "batch_policy": markers.batch_policy or "auto",
        "lr_scale": markers.lr_scale(2),
        "fixed_codes": sorted(migration.fixed_codes),
        "cwd": cwd,
    }
    return VerifyJob(before, before.with_name(f"verify_{policy}.py"), options)


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """(case, policy) -> the verify result, or the reason it was not run.

    All the pairs run in one batch (ddpify/verify/batch.py: one torchrun launch for the
    conversions, one process for the originals) instead of one `ddpify verify` each; a pair
    that two policies migrate identically runs once (a torchrun script keeps its batch).
    """
    outcomes, jobs, keys = {}, [], {}
    for case in CASES:
        for policy in POLICIES:
            migration, skip = migrate_case(case, policy)
            if skip:
                outcomes[case, policy] = skip
                continue
            job = verify_job(case, policy, migration, tmp_path_factory.mktemp(case))
            options = job.options
            key = (case, migration.output, options["batch_policy"], options["lr_scale"])
            key += tuple(options["fixed_codes"])
            if key not in keys:
                keys[key] = len(jobs)
                jobs.append(job)
            outcomes[case, policy] = keys[key]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        results = run_verify_many(jobs)
    return {
        pair: outcome if isinstance(outcome, str) else results[outcome]
        for pair, outcome in outcomes.items()
    }


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_migrated_case_verifies(case, policy, verified):
    result = verified[case, policy]
    if isinstance(result, str):
        pytest.skip(result)
    if result.failed_run == "original" or "without an optimizer step" in result.message:
        pytest.skip(f"the original does not train as one plain process: {result.message}")
    assert result.exit_code == 0, result.message
