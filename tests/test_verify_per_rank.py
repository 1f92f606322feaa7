"""The per-rank reference, piece by piece, without launching torchrun: when verify asks for it,
how its N records read as one, and what its verdict says (test_verify_runs.py runs it)."""

from __future__ import annotations

import json
from io import StringIO

import pytest

from ddpify.verify.report import VerifyResult, render_text

torch = pytest.importorskip("torch")

from ddpify.verify.compare import compare_runs  # noqa: E402
from ddpify.verify.per_rank import check_shares, merged_reference  # noqa: E402
from ddpify.verify.runner import Session, conclude  # noqa: E402
from tests.test_verify_alignment import GRADS, converted_pair, record  # noqa: E402


def one_process(converted_flags=None, original_flags=None, grads=None, draws=((), ())):
    """The comparison with the one-process original (its grads GRADS) of two ranks."""
    original = record(GRADS, original_flags, draws=draws[0])
    ranks = converted_pair(grads or [g + 0.1 for g in GRADS], converted_flags, draws[1])
    return compare_runs(original, ranks, 2, "per-rank")


@pytest.mark.parametrize(
    "flags",
    [
        {"local_bn": True},
        {"adaptive_solver": "RKAdaptiveStepsizeODESolver (rtol 0.001)"},
        {"batch_comparison": "z @ z.T (train.py:40)"},
        {"masked_mean": "cross_entropy(..., ignore_index=0)"},
        {"local_bn": True, "batch_comparison": "z @ z.T (train.py:40)"},
    ],
)
def test_differences_ddp_makes_by_design_ask_for_the_per_rank_reference(flags):
    comparison = one_process(flags)
    assert comparison.answered_per_rank, comparison.inconclusive + comparison.caveats
    assert comparison.per_rank_causes


def test_a_draw_sized_by_the_per_process_batch_asks_for_the_per_rank_reference():
    # Antithetic timesteps: n // 2 + 1 of them, not a batch dimension the probe can make whole.
    draws = ([("randint", [5], None, "s1")], [("randint", [3], None, "s1")])
    comparison = one_process(draws=draws)
    assert comparison.answered_per_rank
    assert "sized by the per-process batch" in comparison.per_rank_causes[0]


@pytest.mark.parametrize(
    ("flags", "original_flags", "draws"),
    [
        ({"local_bn": True, "sum_loss": "mse_loss"}, None, ((), ())),  # another doubt too
        ({"local_bn": True, "augmentation": True}, None, ((), ())),
        ({"unaligned_sampler": "an IterableDataset decides its own order"}, None, ((), ())),
        # a generator in another state (seeded per rank?) is no per-process batch size
        (None, None, ([("randn", [4, 6], None, "s1")], [("randn", [4, 6], 0, "other")])),
    ],
)
def test_other_doubts_keep_the_one_process_result(flags, original_flags, draws):
    comparison = one_process(flags, original_flags, draws=draws)
    assert comparison.inconclusive and not comparison.answered_per_rank


def test_a_mismatch_is_never_handed_to_the_per_rank_reference():
    # Every rank saw the whole batch (their data sums are the original's): a data mismatch.
    ranks = [record([g + 0.1 for g in GRADS], {"local_bn": True}, rank=r) for r in (0, 1)]
    comparison = compare_runs(record(GRADS), ranks, 2, "per-rank")
    assert comparison.findings and not comparison.answered_per_rank


def test_a_match_is_never_handed_to_the_per_rank_reference():
    assert not one_process(grads=GRADS).answered_per_rank


def reference(grads, flags=None, data=((2.0, 0.5, 1.0), (2.0, 0.5, 1.0))):
    """The per-rank reference's N records: the same averaged gradients on every rank."""
    return [record(grads, flags, share, rank) for rank, share in enumerate(data)]


def test_the_reference_reads_as_one_record_with_the_global_batch():
    references = reference(GRADS, {"local_bn": True}, ((2.0, 0.5, 1.0), (2.0, 1.5, 3.0)))
    references[1]["flags"]["reference_weights_checked"] = True
    merged = merged_reference(references)
    assert merged["role"] == "reference"
    assert merged["steps"][0]["data"] == [4.0, 2.0, 4.0]
    assert merged["flags"] == {"local_bn": True, "reference_weights_checked": True}


def against_reference(converted_grads, flags=None, reference_data=None):
    references = reference(GRADS, flags, *(reference_data or ()))
    converted = converted_pair(converted_grads, flags)
    comparison = compare_runs(merged_reference(references), converted, 2, "per-rank")
    check_shares(references, converted, comparison)
    return conclude(VerifyResult(2, "error", ""), comparison, 1)


@pytest.mark.parametrize(
    "flags", [{"local_bn": True}, {"adaptive_solver": "dopri5"}, {"batch_comparison": "z @ z.T"}]
)
def test_what_the_reference_computes_too_is_compared_conclusively(flags):
    assert against_reference(GRADS, flags).verdict == "match"
    halved = against_reference([g / 2 for g in GRADS], flags)
    assert (halved.exit_code, halved.verdict) == (1, "mismatch")
    assert "0.5x the original's" in halved.message


def test_a_rank_with_another_share_than_the_references_is_a_data_mismatch():
    # The ranks' data add up to the reference's, but rank 0 and rank 1 swapped their shares.
    swapped = ((2.0, 1.5, 3.0), (2.0, -0.5, -1.0))
    result = against_reference(GRADS, {"local_bn": True}, (swapped,))
    assert (result.exit_code, result.verdict) == (1, "mismatch")
    assert "rank 0 trained on other samples than the reference's rank 0" in result.message


def test_a_reference_that_did_not_start_alike_settles_nothing():
    references = reference(GRADS, {"local_bn": True})
    references[1]["flags"]["reference_weights"] = 1
    converted = converted_pair(GRADS, {"local_bn": True})
    comparison = compare_runs(merged_reference(references), converted, 2, "per-rank")
    check_shares(references, converted, comparison)
    assert conclude(VerifyResult(2, "error", ""), comparison, 1).verdict == "inconclusive"


def test_the_report_says_what_the_conversion_was_compared_with():
    result = VerifyResult(0, "match", "against the original run as DDP (...): gradients match")
    result.reference, result.per_rank_causes = "per-rank", ["BatchNorm statistics are per process"]
    result.settings = {"original": "a.py", "converted": "b.py", "nproc": 2, "steps": 3}
    text = render_text(result)
    assert "compared with the original run as DDP on 2 processes" in text
    assert "BatchNorm statistics are per process" in text
    stream = StringIO()
    result.render(stream, "json")
    report = json.loads(stream.getvalue())
    assert report["reference"] == "per-rank"
    assert report["per_rank_causes"] == ["BatchNorm statistics are per process"]
    assert VerifyResult(0, "match", "").as_dict()["reference"] == "one-process"


# -- a difference in gradients alone ---------------------------------------------------------


def test_a_difference_in_gradients_alone_asks_the_per_rank_reference():
    """Data, learning rates and ranks agree; only the gradients differ from one process."""
    comparison = one_process()
    assert comparison.differs_in_gradients_only
    assert not comparison.answered_per_rank


def test_a_data_mismatch_is_not_a_difference_in_gradients_alone():
    ranks = [record([g + 0.1 for g in GRADS], rank=r) for r in (0, 1)]
    assert not compare_runs(record(GRADS), ranks, 2, "per-rank").differs_in_gradients_only


def session_after_a_gradient_mismatch(tmp_path):
    first = conclude(VerifyResult(2, "error", ""), one_process(), 1)
    assert first.verdict == "mismatch"
    return Session(tmp_path, tmp_path, [], 10, first), first


def test_a_conversion_that_is_ddp_of_the_original_is_not_called_wrong(tmp_path):
    """It matches the original run as DDP, yet differs from one process: inconclusive,
    saying both, never a match."""
    session, first = session_after_a_gradient_mismatch(tmp_path)
    result = session.unexplained_difference(first, against_reference(GRADS))
    assert (result.exit_code, result.verdict, result.reference) == (2, "inconclusive", "per-rank")
    assert "the conversion computes the original run as DDP" in result.inconclusive[0]
    assert first.message in result.inconclusive[0]


def test_a_conversion_that_differs_from_the_reference_too_stays_a_mismatch(tmp_path):
    session, first = session_after_a_gradient_mismatch(tmp_path)
    result = session.unexplained_difference(first, against_reference([g / 2 for g in GRADS]))
    assert (result.exit_code, result.verdict) == (1, "mismatch")
    assert result.message == first.message
    assert any("differs from the conversion too" in note for note in result.notes)


# -- the precision check: rounding or a difference in what the code computes ------------------


def session_with_float64_runs(tmp_path, monkeypatch, converted_grads, flags=None):
    """A session whose conversion matched the reference while the one-process run differed,
    its float64 runs read from these records instead of files."""
    session, first = session_after_a_gradient_mismatch(tmp_path)
    session.unexplained_difference(first, against_reference(GRADS))
    assert session.wants_precision_check()
    flags = {"float64": True} if flags is None else flags
    records = {
        "original": [record(GRADS, dict(flags))],
        "converted": converted_pair(converted_grads, dict(flags)),
    }
    monkeypatch.setattr(session, "load", lambda role, nproc: records[role])
    return session, first


def test_a_difference_float64_removes_is_rounding_and_a_match(tmp_path, monkeypatch):
    session, first = session_with_float64_runs(tmp_path, monkeypatch, GRADS)
    result = session.judge_precision(2, 1, "per-rank", None, None)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert result.message.startswith(
        "in float64 (the model, the batches and the tensors the scripts make, both runs)"
    )
    assert f"in float32 the runs differ by rounding alone ({first.message})" in result.message
    assert any(note.startswith("precision check:") for note in result.notes)
    assert result.settings["precision"] == "float64"


def test_a_difference_float64_keeps_is_not_rounding(tmp_path, monkeypatch):
    session, _ = session_with_float64_runs(tmp_path, monkeypatch, [g + 0.1 for g in GRADS])
    result = session.judge_precision(2, 1, "per-rank", None, None)
    assert (result.exit_code, result.verdict, result.reference) == (2, "inconclusive", "per-rank")
    assert any("the difference is not rounding alone" in note for note in result.notes)


def test_runs_the_probe_did_not_switch_to_float64_settle_nothing(tmp_path, monkeypatch):
    session, _ = session_with_float64_runs(tmp_path, monkeypatch, GRADS, flags={})
    result = session.judge_precision(2, 1, "per-rank", None, None)
    assert result.verdict == "inconclusive"
    assert any("the probe did not switch to float64" in note for note in result.notes)


def test_a_mismatch_the_reference_cannot_settle_is_checked_in_float64(tmp_path, monkeypatch):
    """The reference differs from the conversion too (it may deal its samples otherwise):
    float64 runs that agree make the float32 mismatch rounding, a match."""
    session, first = session_after_a_gradient_mismatch(tmp_path)
    session.unexplained_difference(first, against_reference([g / 2 for g in GRADS]))
    assert session.wants_precision_check()
    flags = {"float64": True}
    records = {"original": [record(GRADS, dict(flags))], "converted": converted_pair(GRADS, flags)}
    monkeypatch.setattr(session, "load", lambda role, nproc: records[role])
    result = session.judge_precision(2, 1, "per-rank", None, None)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert any("the per-rank reference settled nothing" in note for note in result.notes)


def test_a_mismatch_float64_keeps_stays_a_mismatch(tmp_path, monkeypatch):
    session, first = session_after_a_gradient_mismatch(tmp_path)
    session.unexplained_difference(first, against_reference([g / 2 for g in GRADS]))
    flags = {"float64": True}
    converted = converted_pair([g + 0.1 for g in GRADS], flags)
    records = {"original": [record(GRADS, dict(flags))], "converted": converted}
    monkeypatch.setattr(session, "load", lambda role, nproc: records[role])
    result = session.judge_precision(2, 1, "per-rank", None, None)
    assert (result.exit_code, result.verdict) == (1, "mismatch")
    assert any("the difference is not rounding alone" in note for note in result.notes)
