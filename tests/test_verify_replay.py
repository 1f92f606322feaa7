"""verify's comparison: weights that differ only by what the optimizer makes of gradient
differences within tolerance (Adam near its eps), and batch-coupled ODE solvers.

Probe records are built by hand here (no processes): the numbers are those of real Adam steps.
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from ddpify.verify.compare import compare_runs  # noqa: E402
from ddpify.verify.probe import after_import  # noqa: E402
from ddpify.verify.report import VerifyResult  # noqa: E402
from ddpify.verify.runner import conclude  # noqa: E402

LR = 1e-3
INITIAL = [torch.linspace(-1, 1, 8)]


def adam_record(grads_per_step, rank=None, actual_lr=LR, flags=None, betas=(0.9, 0.999)):
    """The record of a run that took one Adam step per entry of grads_per_step: the original's
    (rank None) or a converted rank's, which saw half of each batch."""
    param = torch.nn.Parameter(INITIAL[0].clone())
    opt = torch.optim.Adam([param], lr=actual_lr, betas=betas)
    steps = []
    for step, grad in enumerate(grads_per_step, start=1):
        steps.append(
            {
                "optimizer": 0,
                "step": step,
                "lrs": [LR],
                "native_lrs": [LR],
                "grads": [grad.clone()],
                "loader": 0,
                "data": [4.0, 1.0, 2.0] if rank is None else [2.0, 0.5, 1.0],
                "weights": [param.detach().clone()] if step > 1 else None,
            }
        )
        param.grad = grad.clone()
        opt.step()
    groups = [{"params": 1, "lr": LR, "betas": betas, "eps": 1e-8, "weight_decay": 0}]
    return {
        "rank": rank or 0,
        "flags": flags or {},
        "optimizers": [{"class": "Adam", "lr_scale": 1.0, "groups": groups}],
        "loaders": [{"batch_size": 2, "used_batch_size": 4, "policy": "per-rank"}],
        "steps": steps,
        "initial": {0: [t.clone() for t in INITIAL]},
        "final": {0: [param.detach().clone()]},
        "names": {0: ["layer.weight"]},
        "param_ids": {0: [1]},
    }


def verdict(original, converted) -> VerifyResult:
    return conclude(
        VerifyResult(2, "error", ""), compare_runs(original, converted, 2, "per-rank"), 1
    )


def rounding_noise(seed):
    """Gradients of about 1e-8, as a weight before a normalisation gets in float32."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, generator=generator) * 1e-8 for _ in range(3)]


def test_adam_amplifying_gradient_rounding_is_explained_not_a_mismatch():
    ours, theirs = rounding_noise(0), rounding_noise(1)
    original = adam_record(ours)
    converted = [adam_record(theirs, rank=r) for r in (0, 1)]
    # The weights really differ by far more than the tolerance: Adam's steps are about lr.
    assert float((original["final"][0][0] - converted[0]["final"][0][0]).abs().max()) > 1e-4
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert any("replaying the optimizer (Adam)" in note for note in result.notes)


def test_an_optimizer_that_did_something_else_still_fails():
    grads = rounding_noise(0)
    original = adam_record(grads)
    # Same gradients and recorded LR, but the converted optimizer stepped at twice the LR.
    converted = [adam_record(grads, rank=r, actual_lr=2 * LR) for r in (0, 1)]
    result = verdict(original, converted)
    assert result.exit_code == 1
    assert "weights after step 3 differ" in result.message


def test_no_explanation_when_the_gradients_themselves_differ():
    grads = [torch.full((8,), 0.5)] * 3
    original = adam_record(grads)
    converted = [adam_record([g * 2 for g in grads], rank=r) for r in (0, 1)]
    result = verdict(original, converted)
    assert result.exit_code == 1
    assert not any("replaying the optimizer" in note for note in result.notes)


def drifting_runs(**converted_options):
    """Step 1 on rounding noise (Adam turns it into weights about lr apart), then gradients
    that differ as gradients computed at those other weights do."""
    ours, theirs = rounding_noise(0), rounding_noise(1)
    later = [torch.linspace(0.1, 0.8, 8), torch.linspace(0.2, 0.9, 8)]
    original = adam_record([ours[0], *later])
    shifted = [g + 1e-3 for g in later]
    converted = [adam_record([theirs[0], *shifted], rank=r, **converted_options) for r in (0, 1)]
    return original, converted


def test_weights_drifted_apart_by_the_optimizer_end_the_comparison_with_a_match():
    original, converted = drifting_runs()
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (0, "match"), result.message
    assert [r.step for r in result.steps if r.compared == "gradients"] == [1]
    assert any("compared the gradients up to step 2 only" in n for n in result.notes)
    assert "later gradients are not compared" in result.message  # never "all steps"


@pytest.mark.parametrize(
    "options", [{"actual_lr": 3 * LR}, {"betas": (0.5, 0.999)}], ids=["lr", "betas"]
)
def test_drift_the_replay_does_not_explain_stays_inconclusive(options):
    original, converted = drifting_runs(**options)
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (2, "inconclusive"), result.message
    assert "computed at weights that already differ" in result.message


def test_after_the_drift_a_learning_rate_difference_is_still_a_mismatch():
    original, converted = drifting_runs()
    for run in converted:
        run["steps"][2]["lrs"] = [2 * LR]
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (1, "mismatch")
    assert "learning rate" in result.message


def test_an_adaptive_ode_solver_makes_a_difference_inconclusive():
    grads = [torch.full((8,), 0.5)] * 3
    flags = {"adaptive_solver": "RKAdaptiveStepsizeODESolver (rtol 0.001)"}
    original = adam_record(grads, flags=flags)
    converted = [adam_record([g * 1.01 for g in grads], rank=r, flags=flags) for r in (0, 1)]
    result = verdict(original, converted)
    assert (result.exit_code, result.verdict) == (2, "inconclusive")
    assert "adaptive-step ODE solver" in " ".join(result.inconclusive)


def test_after_import_patches_a_module_imported_later(tmp_path, monkeypatch):
    (tmp_path / "ddpify_fake_solver.py").write_text("class Solver:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patched = []
    finders = list(sys.meta_path)
    try:
        after_import({"ddpify_fake_solver": ()}, lambda module: patched.append(module.__name__))
        import ddpify_fake_solver  # noqa: F401

        assert patched == ["ddpify_fake_solver"]
    finally:
        sys.meta_path[:] = finders
        sys.modules.pop("ddpify_fake_solver", None)


def two_step_record(second_grad, entering, rank=None):
    """An SGD record of two steps; `entering` is the weight its second step was computed at."""
    record = adam_record([torch.full((8,), 0.5), second_grad], rank=rank)
    record["optimizers"][0]["class"] = "SGD"
    record["steps"][1]["weights"] = [entering]
    return record


@pytest.mark.parametrize(("drift", "verdict_wanted"), [(3e-6, "inconclusive"), (0.0, "mismatch")])
def test_gradients_computed_at_drifted_weights_are_not_like_with_like(drift, verdict_wanted):
    # infogan: Adam turned step-1 rounding into weights 3.6e-6 apart, and step 2's gradients
    # then differed by 1.04e-5 (atol 1e-5). At equal weights the same difference is a mismatch.
    entering = INITIAL[0] - 0.1
    original = two_step_record(torch.full((8,), 0.25), entering)
    converted = [
        two_step_record(torch.full((8,), 0.25 + 2e-5), entering + drift, rank=r) for r in (0, 1)
    ]
    result = verdict(original, converted)
    assert result.verdict == verdict_wanted, result.message
    caveat = "computed at weights that already differ"
    assert (caveat in " ".join(result.inconclusive)) == (verdict_wanted == "inconclusive")


def test_optimizers_sharing_parameters_are_replayed_together():
    """InfoGAN's info optimizer steps the generator's and the discriminator's weights after
    their own optimizers did: the replay must step the same tensors, in the run's order."""
    from ddpify.verify.replay import replay_events

    torch.manual_seed(0)
    g, d = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    first, shared = torch.optim.SGD([g], lr=0.1), torch.optim.Adam([g, d], lr=0.01)
    initial, steps = {0: [g.detach().clone()]}, []
    for step in (1, 2):
        for index, opt in ((0, first), (1, shared)):
            params = opt.param_groups[0]["params"]
            grads = [torch.randn(4) for _ in params]
            initial.setdefault(index, [p.detach().clone() for p in params])
            steps.append({"optimizer": index, "step": step, "lrs": [opt.param_groups[0]["lr"]]})
            steps[-1]["grads"] = grads
            for p, grad in zip(params, grads):
                p.grad = grad
            opt.step()
    groups = [
        {"params": 1, "lr": 0.1, "momentum": 0, "weight_decay": 0},
        {"params": 2, "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0},
    ]
    record = {
        "optimizers": [
            {"class": "SGD", "groups": [groups[0]]},
            {"class": "Adam", "groups": [groups[1]]},
        ],
        "steps": steps,
        "initial": initial,
        "param_ids": {0: [10], 1: [10, 11]},  # the generator's weight is shared
    }
    replayed = replay_events(record, [(s["optimizer"], s["step"]) for s in steps])
    torch.testing.assert_close(replayed[10], g.detach())
    torch.testing.assert_close(replayed[11], d.detach())
    record["param_ids"] = {0: [10], 1: [12, 11]}  # as if not shared: the replay goes elsewhere
    apart = replay_events(record, [(s["optimizer"], s["step"]) for s in steps])
    assert not torch.allclose(apart[10], g.detach())
