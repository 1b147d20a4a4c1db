"""The toy study: exact expected gradients of the production loss vs closed forms; bias verdicts."""
import json
import math

import pytest
import torch

from megatron_rl.kl import KLConfig
from megatron_rl.toy import (BinaryARPolicy, ToySetup, all_sequences, closed_form_gradients,
                             default_runs, enumerated_kl_gradient, estimator_gradients,
                             exact_expected_gradient, main, true_gradient)

SEQ_LEN = 6
THETA, REF, OLD = (0.5, -1.0), (-0.5, 1.0), (0.9, -0.6)


def _exact(kl, off_policy=False):
    return exact_expected_gradient(THETA, REF, SEQ_LEN, kl, OLD if off_policy else None)


def _sq_bias(grad):
    return (grad - true_gradient(THETA, REF, SEQ_LEN)).square().sum().item()


def test_model_is_a_distribution():
    policy = BinaryARPolicy(*THETA)
    y = all_sequences(SEQ_LEN)
    assert y.shape == (1, 2 ** SEQ_LEN, SEQ_LEN)
    total = policy(y).sum(-1).exp().sum().item()
    assert total == pytest.approx(1.0, abs=1e-14)
    # p_1 = sigmoid(a) (c_0 = 0); p_2 after y_1 = 1 is sigmoid(a + b).
    lp = policy(torch.tensor([[[1.0, 1.0]]], dtype=torch.float64))[0, 0]
    assert lp[0].item() == pytest.approx(math.log(1 / (1 + math.exp(-0.5))), abs=1e-15)
    assert lp[1].item() == pytest.approx(math.log(1 / (1 + math.exp(0.5))), abs=1e-15)


def test_true_gradient_recursion_matches_enumeration():
    g_rec = true_gradient(THETA, REF, SEQ_LEN)
    g_enum = enumerated_kl_gradient(THETA, REF, SEQ_LEN)
    assert g_rec.abs().min() > 0.1
    assert torch.allclose(g_rec, g_enum, atol=1e-12, rtol=0)


def test_exact_gradients_equal_closed_forms():
    closed = closed_form_gradients(THETA, REF, SEQ_LEN)
    assert len(closed) == 9
    for key, expected in closed.items():
        estimator, placement = key.split("/")
        exact = _exact(KLConfig(estimator, placement, coef=1.0))
        assert torch.allclose(exact, expected, atol=1e-10, rtol=0), key
    assert closed["k1/loss"].abs().max() == 0  # K1 in the loss: zero expected gradient
    assert closed["k3/loss"].abs().max() > 0.1


@pytest.mark.parametrize("estimator,placement,rtg", [("k1", "reward", False), ("k1", "reward", True),
                                                     ("k1", "reward+loss", False),
                                                     ("k3", "reward+loss", False)])
def test_unbiased_on_policy(estimator, placement, rtg):
    kl = KLConfig(estimator, placement, coef=1.0, reward_to_go=rtg)
    assert _sq_bias(_exact(kl)) < 1e-20


@pytest.mark.parametrize("estimator,placement", [("k1", "loss"), ("k3", "loss"), ("k3", "reward"),
                                                 ("k2", "reward"), ("k2", "loss"),
                                                 ("k2", "reward+loss")])
def test_biased_on_policy(estimator, placement):
    assert _sq_bias(_exact(KLConfig(estimator, placement, coef=1.0))) > 1e-3


def test_off_policy_corrections():
    for estimator in ("k1", "k3"):
        for placement in ("reward", "loss", "reward+loss"):
            for correction in ("none", "token-is"):  # the paper: no configuration is unbiased
                kl = KLConfig(estimator, placement, coef=1.0, off_policy_correction=correction)
                assert _sq_bias(_exact(kl, off_policy=True)) > 1e-3, (estimator, placement, correction)
            # Prefix/sequence importance weights recover the on-policy expectation exactly.
            kl = KLConfig(estimator, placement, coef=1.0, off_policy_correction="seq-is")
            on = _exact(KLConfig(estimator, placement, coef=1.0))
            assert torch.allclose(_exact(kl, off_policy=True), on, atol=1e-12, rtol=0)
    for estimator, placement in (("k1", "reward"), ("k1", "reward+loss"), ("k3", "reward+loss")):
        kl = KLConfig(estimator, placement, coef=1.0, off_policy_correction="seq-is")
        assert _sq_bias(_exact(kl, off_policy=True)) < 1e-20
    truncated = KLConfig("k1", "reward", coef=1.0, off_policy_correction="seq-is", is_truncation=1.5)
    assert _sq_bias(_exact(truncated, off_policy=True)) > 1e-3


def test_monte_carlo_agrees_with_exact():
    gen = torch.Generator().manual_seed(3)
    num_trials, num_samples = 16, 400
    y = BinaryARPolicy(*THETA, num_trials).sample(num_samples, SEQ_LEN, gen)
    kl = KLConfig("k3", "loss", coef=1.0)
    grads = estimator_gradients(BinaryARPolicy(*THETA, num_trials), BinaryARPolicy(*REF), y, kl)
    assert grads.shape == (num_trials, 2)
    stderr = grads.std(0) / math.sqrt(num_trials)
    assert ((grads.mean(0) - _exact(kl)).abs() < 5 * stderr + 1e-12).all()
    assert (grads.std(0) > 0).all()  # distinct trials, distinct gradients


def test_main_writes_outputs(tmp_path):
    out = tmp_path / "toy"
    assert main(["--out", str(out), "--seq-len", "4", "--num-trials", "4", "--num-samples", "20",
                 "--no-plot"]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert len(rows) == len(default_runs())
    assert rows["k1/reward"]["biased"] is False and rows["k3/loss"]["biased"] is True
    assert rows["k1/reward"]["closed_form_abs_err"] < 1e-10
    assert "| k3/reward+loss | on-policy |" in (out / "table.md").read_text()


def test_default_setup_is_the_documented_one():
    setup = ToySetup()
    assert (setup.theta, setup.ref, setup.old) == (THETA, REF, OLD)
    assert (setup.num_trials, setup.num_samples) == (200, 1000)
