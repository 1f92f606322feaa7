"""ddpify verify without running scripts: markers, verdicts, CLI wiring, torch-free imports."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys

import pytest

from ddpify.cli import build_parser, main
from ddpify.verify import run_verify
from ddpify.verify.markers import read_markers
from tests.helpers import FIXTURES

VERIFY = FIXTURES / "verify"


@pytest.mark.parametrize(
    ("comment", "policy", "scale"),
    [
        (
            "# ddpify: linear LR scaling (Goyal et al. 2017): each process keeps the batch size",
            "per-rank",
            4.0,
        ),
        (
            "# ddpify: square-root LR scaling (Malladi et al. 2022): each process keeps the batch",
            "per-rank",
            2.0,
        ),
        (
            "# ddpify: batch policy global: batch_size // WORLD_SIZE per process, LR unchanged",
            "global",
            1.0,
        ),
        ("x = 1  # DDPIFY: lr scale = 0.5, per-rank batch", "per-rank", 0.5),
        ("# ddpify: learning rate not scaled", None, 1.0),
    ],
)
def test_markers_give_policy_and_lr_scale(comment, policy, scale):
    markers = read_markers(f"import torch\n{comment}\nprint(1)\n")
    assert markers.batch_policy == policy
    assert markers.lr_scale(4) == pytest.approx(scale)


def test_comments_without_ddpify_are_not_markers():
    markers = read_markers("# linear LR scaling, per-rank batch\nlr = 0.1 * 4\n")
    assert (markers.batch_policy, markers.lr_scale(4), markers.lines) == (None, None, [])


def test_fixture_markers_match_the_fixture_policies():
    per_rank = read_markers((VERIFY / "mlp" / "converted.py").read_text())
    global_ = read_markers((VERIFY / "mlp" / "converted_global.py").read_text())
    assert (per_rank.batch_policy, per_rank.lr_scale(2)) == ("per-rank", 2.0)
    assert (global_.batch_policy, global_.lr_scale(2)) == ("global", 1.0)


def test_script_args_after_double_dash():
    args = build_parser().parse_args(
        ["verify", "a.py", "b.py", "--steps", "2", "--", "--epochs", "1", "--lr=0.5"]
    )
    assert (args.steps, args.script_args) == (2, ["--epochs", "1", "--lr=0.5"])


def test_check_and_import_do_not_import_torch():
    code = (
        "import sys\nfrom ddpify.cli import main\n"
        f"main(['check', {str(VERIFY / 'mlp' / 'converted.py')!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_verify_without_torch_exits_2_and_says_how_to_install(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else find_spec(name, *a),
    )
    code = main(
        ["verify", str(VERIFY / "mlp" / "original.py"), str(VERIFY / "mlp" / "converted.py")]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "needs PyTorch" in out and "ddpify[verify]" in out


def test_missing_script_exits_2():
    result = run_verify(VERIFY / "mlp" / "original.py", VERIFY / "mlp" / "nope.py")
    assert result.exit_code == 2 and "no such file" in result.message


torch = pytest.importorskip("torch")

from ddpify.verify.compare import compare_runs  # noqa: E402
from ddpify.verify.report import VerifyResult  # noqa: E402
from ddpify.verify.runner import conclude  # noqa: E402


def record(grads, flags=None, lr=0.1, data=(4.0, 1.0, 2.0), rank=0):
    """A probe record of one optimizer step on a two-parameter model."""
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
                "lrs": [lr],
                "native_lrs": [lr],
                "grads": grads,
                "loader": 0,
                "data": list(data),
            }
        ],
        "initial": {0: params},
        "final": {0: [p - lr * g for p, g in zip(params, grads)]},
        "names": {0: ["fc.weight", "fc.bias"]},
    }


def verdict(original, converted) -> VerifyResult:
    comparison = compare_runs(original, converted, 2, "per-rank")
    return conclude(VerifyResult(2, "error", ""), comparison, 1)


def halves(data=(4.0, 1.0, 2.0)):
    return (data[0] / 2, data[1] / 2, data[2] / 2)


def test_equal_gradients_match():
    grads = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]
    converted = [record(grads, data=halves(), rank=r) for r in (0, 1)]
    result = verdict(record(grads), converted)
    assert (result.exit_code, result.verdict) == (0, "match")


def test_constant_factor_is_named():
    grads = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]
    doubled = [g * 2 for g in grads]
    converted = [record(doubled, data=halves(), rank=r) for r in (0, 1)]
    result = verdict(record(grads), converted)
    assert result.exit_code == 1
    assert result.first_mismatch.parameter == "fc.weight"
    assert "2x the original's" in result.message


def test_sum_reduced_loss_is_inconclusive_even_when_gradients_agree():
    grads = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]
    flags = {"sum_loss": "cross_entropy"}
    converted = [record(grads, flags, data=halves(), rank=r) for r in (0, 1)]
    result = verdict(record(grads, flags), converted)
    assert (result.exit_code, result.verdict) == (2, "inconclusive")
    assert "sum-reduced loss" in " ".join(result.inconclusive)


def test_random_data_pipeline_makes_a_difference_inconclusive():
    grads = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]
    other = [g + 0.1 for g in grads]
    converted = [record(other, {"augmentation": True}, data=halves(), rank=r) for r in (0, 1)]
    result = verdict(record(grads), converted)
    assert (result.exit_code, result.verdict) == (2, "inconclusive")


def test_json_rendering_carries_first_mismatch():
    grads = [torch.full((2, 2), 0.25), torch.tensor([0.5, -0.5])]
    converted = [record([g * 0.5 for g in grads], data=halves(), rank=r) for r in (0, 1)]
    stream = io.StringIO()
    verdict(record(grads), converted).render(stream, "json")
    data = json.loads(stream.getvalue())
    assert data["exit_code"] == 1
    assert data["first_mismatch"]["step"] == 1
    assert data["first_mismatch"]["parameter"] == "fc.weight"
    assert data["steps"][1]["compared"] == "gradients" and not data["steps"][1]["ok"]


def test_amp_tolerance_scales_with_the_gradients():
    # Seen on an H100: a loss divided by the process count (gradients halved) passed the
    # AMP comparison because an absolute atol of 1e-2 dwarfed gradients of about 1e-3.
    import torch

    from ddpify.verify.compare import AMP_TOLERANCES, AmpAtol, tensor_diff

    rtol, atol = AMP_TOLERANCES["bfloat16"]
    expected = torch.linspace(-1e-3, 1e-3, 50)
    assert tensor_diff(expected / 2, expected, rtol, atol).ok  # the old, absolute reading
    assert not tensor_diff(expected / 2, expected, rtol, AmpAtol(atol)).ok
    noisy = expected * (1 + 0.03 * torch.randn(50, generator=torch.Generator().manual_seed(0)))
    assert tensor_diff(noisy, expected, rtol, AmpAtol(atol)).ok


def test_amp_norm_check_spares_tensors_that_are_rounding_noise():
    # A bias before BatchNorm has a zero gradient in exact math: bf16 noise of 1e-3 on it
    # is no bug while the step's other gradients are large and agree.
    import torch

    from ddpify.verify.compare import AMP_TOLERANCES, AmpAtol, list_diff

    rtol, atol = AMP_TOLERANCES["bfloat16"][0], AmpAtol(AMP_TOLERANCES["bfloat16"][1])
    weight = torch.linspace(-0.5, 0.5, 64)
    bias_expected, bias_actual = torch.full((8,), 1e-7), torch.full((8,), 1e-3)
    names = ["weight", "bias"]
    assert list_diff(names, [weight, bias_actual], [weight, bias_expected], rtol, atol).ok
    assert not list_diff(names, [weight / 2, bias_actual], [weight, bias_expected], rtol, atol).ok
