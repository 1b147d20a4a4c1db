"""The toy study: closed forms (C1)-(C3) vs enumeration, exact expected gradients of the production
loss vs closed forms, bias verdicts, and the `exact` per-position KL estimator."""
import json
import math

import pytest
import torch

from megatron_rl.kl import KLConfig
from megatron_rl.experiments.toy import (DEFAULT_PARAMS, BinaryARPolicy, ExactKL, ToySetup, all_sequences,
                             closed_form_gradients, closed_form_kl, closed_form_kl_gradient,
                             default_runs, enumerated_kl, enumerated_kl_gradient,
                             estimator_gradients, exact_expected_gradient, exact_gradient_moments,
                             main, prefix_features, true_gradient, _state_marginals)

SEQ_LEN = 6
THETA, REF, OLD = DEFAULT_PARAMS["count"]
UNBIASED = 1e-20


def _exact(kl, off_policy=False, model="count"):
    return exact_expected_gradient(THETA, REF, SEQ_LEN, kl, OLD if off_policy else None, model)


def _sq_bias(grad, model="count"):
    return (grad - true_gradient(THETA, REF, SEQ_LEN, model)).square().sum().item()


@pytest.mark.parametrize("model", ["count", "sign"])
def test_model_is_a_distribution(model):
    policy = BinaryARPolicy(*THETA, model=model)
    y = all_sequences(SEQ_LEN)
    assert y.shape == (1, 2 ** SEQ_LEN, SEQ_LEN)
    total = policy(y).sum(-1).exp().sum().item()
    assert total == pytest.approx(1.0, abs=1e-14)


def test_count_model_conditions_on_the_number_of_ones():
    a, b = 0.3, -0.7
    y = torch.tensor([[[1.0, 0.0, 1.0, 1.0]]], dtype=torch.float64)
    assert prefix_features(y, "count")[0, 0].tolist() == [0, 1, 1, 2]
    assert prefix_features(y, "sign")[0, 0].tolist() == [0, 1, -1, 1]
    lp = BinaryARPolicy(a, b)(y)[0, 0]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [math.log(sig(a)), math.log(1 - sig(a + b)), math.log(sig(a + b)),
                math.log(sig(a + 2 * b))]
    assert lp.tolist() == pytest.approx(expected, abs=1e-15)


def test_sampler_follows_the_model():
    gen = torch.Generator().manual_seed(0)
    y = BinaryARPolicy(*THETA, 1).sample(40000, 3, gen)[0]
    counts = torch.zeros(8, dtype=torch.float64)
    counts.index_add_(0, (y @ torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)).long(),
                      torch.ones(len(y), dtype=torch.float64))
    probs = BinaryARPolicy(*THETA)(all_sequences(3)).sum(-1).exp()[0]
    assert (counts / len(y) - probs).abs().max() < 0.01


@pytest.mark.parametrize("model", ["count", "sign"])
@pytest.mark.parametrize("seq_len,theta,ref", [(1, (0.3, 0.2), (-0.1, 0.4)),
                                               (5, THETA, REF),
                                               (8, (0.5, -1.0), (-0.5, 1.0)),
                                               (10, (-0.2, 0.7), (0.4, -0.3))])
def test_closed_forms_match_enumeration(model, seq_len, theta, ref):
    """(C2) KL and (C3) gradient (no autograd) vs autograd through (C1)-(C2) vs all 2^T sequences."""
    kl = closed_form_kl(theta, ref, seq_len, model)
    assert kl == pytest.approx(enumerated_kl(theta, ref, seq_len, model), rel=1e-13, abs=1e-15)
    g_enum = enumerated_kl_gradient(theta, ref, seq_len, model)
    assert torch.allclose(closed_form_kl_gradient(theta, ref, seq_len, model), g_enum, atol=1e-12, rtol=0)
    assert torch.allclose(true_gradient(theta, ref, seq_len, model), g_enum, atol=1e-12, rtol=0)


def test_law_of_the_count_matches_enumeration():
    """(C1): m_t(c) = P(c_{t-1} = c), the count model's Poisson-binomial-like recursion."""
    seq_len = 7
    m, _ = _state_marginals(torch.tensor(THETA[0], dtype=torch.float64),
                            torch.tensor(THETA[1], dtype=torch.float64), seq_len, "count")
    y = all_sequences(seq_len)
    probs = BinaryARPolicy(*THETA)(y).sum(-1).exp()[0]
    counts = prefix_features(y, "count")[0].long()  # [2^T, T]
    for t in range(seq_len):
        law = torch.zeros(seq_len + 1, dtype=torch.float64).index_add(0, counts[:, t], probs)
        assert torch.allclose(m[t], law, atol=1e-15, rtol=0)


@pytest.mark.parametrize("model", ["count", "sign"])
def test_exact_gradients_equal_closed_forms(model):
    closed = closed_form_gradients(THETA, REF, SEQ_LEN, model)
    assert len(closed) == 12
    for key, expected in closed.items():
        estimator, placement = key.split("/")
        kl = ExactKL(placement) if estimator == "exact" else KLConfig(estimator, placement, coef=1.0)
        exact = _exact(kl, model=model)
        assert torch.allclose(exact, expected, atol=1e-10, rtol=0), key
    assert closed["k1/loss"].abs().max() == 0  # K1 in the loss: zero expected gradient
    assert closed["k3/loss"].abs().max() > 0.05


@pytest.mark.parametrize("kl", [KLConfig("k1", "reward", coef=1.0),
                                KLConfig("k1", "reward", coef=1.0, reward_to_go=True),
                                KLConfig("k1", "reward+loss", coef=1.0),
                                KLConfig("k3", "reward+loss", coef=1.0),
                                ExactKL("reward+loss", "full"), ExactKL("reward+loss", "to-go"),
                                ExactKL("reward+loss", "later")], ids=repr)
def test_unbiased_on_policy(kl):
    assert _sq_bias(_exact(kl)) < UNBIASED


@pytest.mark.parametrize("kl", [KLConfig("k1", "loss", coef=1.0), KLConfig("k3", "loss", coef=1.0),
                                KLConfig("k3", "reward", coef=1.0), KLConfig("k2", "reward", coef=1.0),
                                KLConfig("k2", "loss", coef=1.0), KLConfig("k2", "reward+loss", coef=1.0),
                                ExactKL("loss"), ExactKL("reward", "full"), ExactKL("reward", "to-go"),
                                ExactKL("reward", "later")], ids=repr)
def test_biased_on_policy(kl):
    assert _sq_bias(_exact(kl)) > 1e-6  # K2 in reward+loss: 1.4e-5 at T = 6; the others >= 0.1


def test_exact_placements_split_the_true_gradient():
    """loss = path-wise term (a) = E[K2 in loss]; reward = score term (b) for every return; a + b = g*."""
    pathwise = _exact(ExactKL("loss"))
    assert torch.allclose(pathwise, _exact(KLConfig("k2", "loss", coef=1.0)), atol=1e-12, rtol=0)
    score = {ret: _exact(ExactKL("reward", ret)) for ret in ("full", "to-go", "later")}
    assert torch.allclose(score["full"], score["to-go"], atol=1e-12, rtol=0)
    assert torch.allclose(score["full"], score["later"], atol=1e-12, rtol=0)
    g_star = true_gradient(THETA, REF, SEQ_LEN)
    assert torch.allclose(pathwise + score["later"], g_star, atol=1e-12, rtol=0)
    assert pathwise.norm() > 0.1 and score["later"].norm() > 0.1  # both terms matter


def test_exact_variance_vs_k1_and_the_current_position():
    """The documented variance findings (T = 8, per sample, no baseline)."""
    def var(kl, theta=THETA, ref=REF):
        return exact_gradient_moments(theta, ref, 8, kl)[1]

    k1_reward = var(KLConfig("k1", "reward", coef=1.0))
    later, to_go, full = (var(ExactKL("reward+loss", ret)) for ret in ("later", "to-go", "full"))
    assert later < k1_reward / 5  # default setting: 1.61 vs 15.4
    assert later < to_go < full  # dropping s_t KL_t lowers the variance here ...
    near = ((0.3, 0.1), (-0.3, 0.3))  # ... but not always: there full < later
    assert var(ExactKL("reward+loss", "full"), *near) < var(ExactKL("reward+loss", "later"), *near)
    far = ((0.5, -1.0), (-0.5, 1.0))  # far from the reference the gain over K1 in reward is gone
    ratio = var(ExactKL("reward+loss", "later"), *far) / var(KLConfig("k1", "reward", coef=1.0), *far)
    assert 0.9 < ratio < 1.0


def test_off_policy_corrections():
    for estimator in ("k1", "k3", "exact"):
        for placement in ("reward", "loss", "reward+loss"):
            def cfg(corr):
                if estimator == "exact":
                    return ExactKL(placement, off_policy_correction=corr)
                return KLConfig(estimator, placement, coef=1.0, off_policy_correction=corr)
            for correction in ("none", "token-is"):  # the paper: no configuration is unbiased
                assert _sq_bias(_exact(cfg(correction), off_policy=True)) > 1e-3, \
                    (estimator, placement, correction)
            # Prefix/sequence importance weights recover the on-policy expectation exactly.
            on = _exact(cfg("none"))
            assert torch.allclose(_exact(cfg("seq-is"), off_policy=True), on, atol=1e-12, rtol=0)
    for kl in (KLConfig("k1", "reward", coef=1.0, off_policy_correction="seq-is"),
               KLConfig("k1", "reward+loss", coef=1.0, off_policy_correction="seq-is"),
               KLConfig("k3", "reward+loss", coef=1.0, off_policy_correction="seq-is"),
               ExactKL("reward+loss", "full", "seq-is"), ExactKL("reward+loss", "later", "seq-is")):
        assert _sq_bias(_exact(kl, off_policy=True)) < UNBIASED, kl
    truncated = KLConfig("k1", "reward", coef=1.0, off_policy_correction="seq-is", is_truncation=1.5)
    assert _sq_bias(_exact(truncated, off_policy=True)) > 1e-3


@pytest.mark.parametrize("kl", [KLConfig("k1", "reward", coef=1.0),
                                KLConfig("k1", "reward", coef=1.0, reward_to_go=True),
                                KLConfig("k3", "reward+loss", coef=1.0),
                                ExactKL("reward+loss", "later"), ExactKL("reward", "full")], ids=repr)
@pytest.mark.parametrize("off_policy", [False, True])
def test_mean_baseline_keeps_the_expectation(kl, off_policy):
    old = OLD if off_policy else None
    mean, var = exact_gradient_moments(THETA, REF, SEQ_LEN, kl, old)
    mean_b, var_b = exact_gradient_moments(THETA, REF, SEQ_LEN, kl, old, baseline=True)
    assert torch.allclose(mean, mean_b, atol=1e-12, rtol=0)
    assert var_b != pytest.approx(var, rel=1e-6)  # the baseline is really applied


@pytest.mark.parametrize("kl", [KLConfig("k3", "loss", coef=1.0), ExactKL("reward+loss", "later")],
                         ids=repr)
def test_monte_carlo_agrees_with_exact(kl):
    gen = torch.Generator().manual_seed(3)
    num_trials, num_samples = 16, 400
    y = BinaryARPolicy(*THETA, num_trials).sample(num_samples, SEQ_LEN, gen)
    grads = estimator_gradients(BinaryARPolicy(*THETA, num_trials), BinaryARPolicy(*REF), y, kl)
    assert grads.shape == (num_trials, 2)
    stderr = grads.std(0) / math.sqrt(num_trials)
    mean, variance = exact_gradient_moments(THETA, REF, SEQ_LEN, kl)
    assert ((grads.mean(0) - mean).abs() < 5 * stderr + 1e-12).all()
    assert (grads.std(0) > 0).all()  # distinct trials, distinct gradients
    mc_variance = num_samples * grads.var(0).sum().item()
    assert mc_variance == pytest.approx(variance, rel=0.6)  # 16 trials: a loose check


def test_main_writes_outputs(tmp_path):
    out = tmp_path / "toy"
    assert main(["--out", str(out), "--seq-len", "4", "--num-trials", "4", "--num-samples", "20",
                 "--no-plot"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["setup"]["model"] == "count"
    rows = {r["config"]: r for r in result["rows"]}
    assert len(rows) == len(default_runs())
    assert rows["k1/reward"]["biased"] is False and rows["k3/loss"]["biased"] is True
    assert rows["exact/reward+loss later"]["biased"] is False
    assert rows["exact/loss"]["biased"] is True and rows["exact/reward"]["biased"] is True
    assert rows["k1/reward"]["closed_form_abs_err"] < 1e-10
    assert rows["exact/reward+loss"]["closed_form_abs_err"] < 1e-10
    table = (out / "table.md").read_text()
    assert "| k3/reward+loss | on-policy |" in table and "What it means" in table


def test_cli_parameters_and_json(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seq-len", "3", "--theta", "0.1", "0.2", "--ref", "0", "0.3",
            "--old", "0.4", "-0.1", "--num-trials", "0", "--no-plot", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["setup"]["theta"] == [0.1, 0.2] and result["setup"]["ref"] == [0.0, 0.3]
    assert result["setup"]["old"] == [0.4, -0.1] and result["setup"]["seq_len"] == 3
    assert result["kl"] == pytest.approx(enumerated_kl((0.1, 0.2), (0.0, 0.3), 3), abs=1e-15)
    assert "mc_sq_bias" not in result["rows"][0]
    sign = ["--out", str(tmp_path), "--model", "sign", "--num-trials", "0", "--no-plot", "--json"]
    assert main(sign) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["setup"]["theta"], result["setup"]["ref"]) == ([0.5, -1.0], [-0.5, 1.0])
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["k1/loss"]["exact_sq_bias"] == pytest.approx(6.494, abs=1e-3)  # the earlier table
    with pytest.raises(SystemExit):
        main(["--seq-len", "17"])


def test_default_setup_is_the_documented_one():
    setup = ToySetup()
    assert (setup.model, setup.seq_len) == ("count", 8)
    assert (setup.theta, setup.ref, setup.old) == (THETA, REF, OLD) == ((0.5, -0.25), (-0.5, 0.25),
                                                                       (0.9, -0.15))
    assert (setup.num_trials, setup.num_samples) == (200, 1000)
