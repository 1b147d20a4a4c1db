"""The toy study: closed forms (C1)-(C3) vs enumeration, exact expected gradients of the production
loss vs closed forms, bias verdicts, the `exact` per-position KL estimator, and the
three-distribution study (samples from mu, PPO ratio against pi_old, KL weights against either)."""
import json
import math

import pytest
import torch

from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.kl import KLConfig
from megatron_rl.experiments.toy import (DEFAULT_PARAMS, BinaryARPolicy, ExactKL, ToySetup, all_sequences,
                             closed_form_gradients, closed_form_kl, closed_form_kl_gradient,
                             default_runs, enumerated_kl, enumerated_kl_gradient,
                             estimator_gradients, exact_expected_gradient, exact_gradient_moments,
                             exact_kl_loss_per_token,
                             main, pg_corrections, prefix_features, three_distribution_configs,
                             three_distribution_kl, true_gradient, _state_marginals)

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
    assert "three_distribution" not in result  # only with --rollout
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


# ---------------------------------------------------------------- three distributions

ROLLOUT = (0.7, -0.05)  # mu: differs from pi_old = OLD and from A_theta = THETA
SEQ_IS_UNBIASED = ("k1/reward", "k1/reward rtg", "k1/reward+loss", "k3/reward+loss",
                   "exact/reward+loss", "exact/reward+loss later")


def _three(kl, rollout=ROLLOUT, pg=None):
    """E_mu[grad] [2]: samples from mu = rollout, PPO ratio against pi_old = OLD."""
    return exact_gradient_moments(THETA, REF, SEQ_LEN, kl, OLD, rollout=rollout, pg_correction=pg)[0]


def _per_sequence():
    """Over all 2^T sequences: A_theta(y), mu(y), pi_old(y), R(y) = sum_t K1_t and S(y) [2^T, 2]."""
    y = all_sequences(SEQ_LEN).transpose(0, 1)
    policy = BinaryARPolicy(*THETA, num_copies=y.shape[0])
    seq_lp = policy(y).sum((-1, -2))
    score = torch.stack(torch.autograd.grad(seq_lp.sum(), [policy.a, policy.b]), dim=-1)
    with torch.no_grad():
        lp_ref, lp_old, lp_mu = (BinaryARPolicy(*params)(y).sum((-1, -2))
                                 for params in (REF, OLD, ROLLOUT))
    seq_lp = seq_lp.detach()
    return seq_lp.exp(), lp_mu.exp(), lp_old.exp(), seq_lp - lp_ref, score


@pytest.mark.parametrize("name", SEQ_IS_UNBIASED)
def test_seq_is_against_the_sampler_is_unbiased_and_against_pi_old_is_not(name):
    assert _sq_bias(_three(three_distribution_kl(name, "seq-is", "rollout"))) < UNBIASED
    assert _sq_bias(_three(three_distribution_kl(name, "seq-is", "behaviour"))) > 1e-3


def test_behaviour_seq_is_bias_is_the_prefix_shift():
    """E_mu[(A_theta/pi_old)(y) R S] = E_theta[(mu/pi_old)(y) R S], K1 in the reward (sequence weight)."""
    p_theta, p_mu, p_old, returns, score = _per_sequence()
    expected = (p_theta * p_mu / p_old * returns) @ score
    got = _three(three_distribution_kl("k1/reward", "seq-is", "behaviour"))
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


def test_truncated_rollout_weights_cost_the_mass_above_c():
    """min(W, c), W = A_theta/mu: E_mu[min(W, c) R S] = g* - E_theta[(1 - c/W)_+ R S]."""
    c = 1.5
    p_theta, p_mu, _, returns, score = _per_sequence()
    lost = (p_theta * (1 - c * p_mu / p_theta).clamp(min=0) * returns) @ score
    assert lost.norm() > 0.1  # the truncation bites here
    got = _three(three_distribution_kl("k1/reward", "seq-is", "rollout", truncation=c))
    assert torch.allclose(got, true_gradient(THETA, REF, SEQ_LEN) - lost, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", three_distribution_configs())
def test_proposals_agree_exactly_when_mu_is_pi_old(name):
    """mu = pi_old: both proposals give the same gradients, those of the study sampling from pi_old."""
    for correction in ("token-is", "seq-is"):
        moments = [exact_gradient_moments(THETA, REF, SEQ_LEN,
                                          three_distribution_kl(name, correction, proposal), OLD,
                                          rollout=OLD) for proposal in ("behaviour", "rollout")]
        assert torch.equal(moments[0][0], moments[1][0]) and moments[0][1] == moments[1][1]
        single = exact_gradient_moments(THETA, REF, SEQ_LEN,
                                        three_distribution_kl(name, correction, "behaviour"), OLD)
        assert torch.equal(moments[0][0], single[0]) and moments[0][1] == single[1]


@pytest.mark.parametrize("name,correction", [("k3/loss", "token-is"), ("exact/loss", "token-is"),
                                             ("k3/loss", "seq-is"), ("k1/reward rtg", "seq-is"),
                                             ("k1/reward+loss", "seq-is"),
                                             ("exact/reward+loss later", "seq-is")])
def test_rollout_proposal_weights_the_kl_against_the_sampler(name, correction):
    """KL terms outside the advantage (the loss side; the reward side under seq-is) with weights
    against mu do not see pi_old: they equal the single-sampler study with pi_old := mu. (Under
    token-is the reward side stays in the advantage, where the PPO ratio divides by pi_old.)"""
    got = _three(three_distribution_kl(name, correction, "rollout"))
    single = exact_expected_gradient(THETA, REF, SEQ_LEN,
                                     three_distribution_kl(name, correction, "behaviour"), ROLLOUT)
    assert torch.allclose(got, single, atol=1e-12, rtol=0)


def test_policy_gradient_correction_corrects_the_token_not_the_prefix():
    """KL inside the advantage: untruncated tis makes the token weight (A_theta/pi_old)(pi_old/mu)
    = A_theta/mu, i.e. the study with pi_old := mu and no correction; still biased (prefixes from mu).
    With mu = pi_old every correction's weight is 1."""
    kl = KLConfig("k1", "reward", coef=1.0)
    tis = pg_corrections(2.0)["tis [0, inf]"]
    got = _three(kl, pg=tis)
    assert torch.allclose(got, exact_expected_gradient(THETA, REF, SEQ_LEN, kl, ROLLOUT), atol=1e-6,
                          rtol=1e-6)  # the trainer's correction weights are float32
    assert _sq_bias(got) > 0.1
    for pg in pg_corrections(2.0).values():
        assert torch.equal(_three(kl, rollout=OLD, pg=pg), _three(kl, rollout=OLD))
    assert isinstance(tis, RolloutCorrectionConfig) and tis.bounds() == (0.0, math.inf)


def test_main_with_rollout_prints_the_three_distribution_study(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seq-len", "5", "--num-trials", "0", "--no-plot",
            "--rollout", *map(str, ROLLOUT), "--is-truncation", "1.5"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Three distributions" in table and "| seq-is / mu |" in table
    result = json.loads((tmp_path / "results.json").read_text())
    three = result["three_distribution"]
    assert three["rollout"] == list(ROLLOUT) and three["is_truncation"] == 1.5
    rows = {(r["table"], r["config"], r["correction"], r["proposal"], r["pg_correction"]): r
            for r in three["rows"]}
    for name in SEQ_IS_UNBIASED:
        assert rows["kl", name, "seq-is", "rollout", "none"]["biased"] is False
        assert rows["kl", name, "seq-is", "behaviour", "none"]["biased"] is True
    truncated = rows["truncation", "k1/reward", "seq-is", "rollout", "none"]
    assert truncated["exact_sq_bias"] == pytest.approx(truncated["truncation_shift_sq"], rel=1e-12)
    assert three["sequence_weights"]["rollout"]["mean"] == pytest.approx(1.0, abs=1e-14)
    assert result["rows"] == json.loads(json.dumps(main_rows(tmp_path / "plain")))
    with pytest.raises(SystemExit):
        main(argv + ["--is-truncation", "0"])


def main_rows(out):
    assert main(["--out", str(out), "--seq-len", "5", "--num-trials", "0", "--no-plot", "--json"]) == 0
    return json.loads((out / "results.json").read_text())["rows"]


def test_exact_seq_is_sequence_weight_is_the_last_masked_tokens():
    """ExactKL's seq-is full return weighs the sequence by the prefix weight at its last token of
    the loss_mask: positions after it (padding, a tool's output) change nothing."""
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(1, 4, dtype=torch.float64, generator=gen)
    old = -torch.rand(1, 4, dtype=torch.float64, generator=gen)
    kl = torch.rand(1, 4, dtype=torch.float64, generator=gen)
    cfg = ExactKL("reward", "full", "seq-is")

    def grad(num_tokens, mask):
        lp = logprobs[:, :num_tokens].clone().requires_grad_()
        loss = (exact_kl_loss_per_token(lp, old[:, :num_tokens], kl[:, :num_tokens], mask, cfg)
                * mask).sum()
        return torch.autograd.grad(loss, lp)[0][:, :3]

    short = grad(3, torch.ones(1, 3, dtype=torch.float64))
    padded = grad(4, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64))
    assert short.abs().min() > 0
    assert torch.allclose(padded, short, atol=1e-15, rtol=0)
