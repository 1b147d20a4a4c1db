"""The toy's policy-loss study (`megatron-rl toy --policy-loss`): every --policy-loss through the
production loss, on- and off-policy, against closed forms computed here without the loss code
(per-token scores s_t = (y_t - p_t)(1, c_{t-1}) of the sigmoid model), at fixed and at variable
lengths (--stop-after-ones)."""
import json
import math

import pytest
import torch

from megatron_rl.experiments.toy import (DEFAULT_PARAMS, POLICY_LOSS_CLIPS, POLICY_LOSS_KL_CONFIGS,
                                         POLICY_LOSS_NAMES, BinaryARPolicy, enumerate_sequences,
                                         main, objective_gradient, policy_loss_config,
                                         policy_loss_moments, prefix_features, stop_mask)
from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig

SEQ_LEN = 5
STOP = 2  # variable lengths: a sequence ends with its second 1
THETA, REF, OLD = DEFAULT_PARAMS["count"]
UNBIASED = 1e-20
AGGREGATIONS = ("seq-mean-token-sum", "seq-mean-token-mean")


def _kl(config, correction="none"):
    estimator, placement = config.split("/")
    return KLConfig(estimator, placement, coef=1.0, off_policy_correction=correction)


def _moments(name, config, *, clip=False, aggregation="seq-mean-token-sum", stop=None,
             off_policy=False, correction="none"):
    return policy_loss_moments(THETA, REF, SEQ_LEN, _kl(config, correction),
                               policy_loss_config(name, clip, aggregation),
                               OLD if off_policy else None, stop_after=stop)


def _grad(*args, **kwargs):
    return _moments(*args, **kwargs)[0]


def _laws(stop):
    """Per enumerated sequence [S]: P_theta, P_old, n = its length, R = sum_t K1_t (the reward
    side's KL), and per token [S, T]: the ratio r_t = A_theta/A_old and the score s_t [S, T, 2]."""
    y, mask = enumerate_sequences(SEQ_LEN, stop)
    with torch.no_grad():
        policy = BinaryARPolicy(*THETA)
        lp, lp_old, lp_ref = (BinaryARPolicy(*params)(y)[0] * mask[0]
                              for params in (THETA, OLD, REF))
        dz = (y - torch.sigmoid(policy.logits(y)))[0] * mask[0]
        score = torch.stack([dz, dz * prefix_features(y, "count")[0]], dim=-1)
    return {"p": lp.sum(-1).exp(), "p_old": lp_old.sum(-1).exp(), "n": mask[0].sum(-1),
            "R": (lp - lp_ref).sum(-1), "ratio": (lp - lp_old).exp(), "score": score}


# ---------------------------------------------------------------- variable lengths

def test_stop_token_law():
    """--stop-after-ones K: a sequence ends with its K-th 1; one representative per stopped
    sequence, their probabilities sum to 1, lengths K..T."""
    y = torch.tensor([[[0.0, 1.0, 0.0, 1.0, 1.0]]], dtype=torch.float64)
    assert stop_mask(y, 2)[0, 0].tolist() == [1, 1, 1, 1, 0]
    assert stop_mask(y, 1)[0, 0].tolist() == [1, 1, 0, 0, 0]
    assert stop_mask(y, None)[0, 0].tolist() == [1] * 5
    for stop in (1, 2, 3, None):
        seqs, mask = enumerate_sequences(SEQ_LEN, stop)
        law = (BinaryARPolicy(*THETA)(seqs) * mask).sum(-1).exp()
        assert law.sum().item() == pytest.approx(1.0, abs=1e-14)
        assert (seqs * (1 - mask)).abs().sum() == 0  # nothing after the stop
        lengths = set(mask.sum(-1)[0].tolist())
        assert lengths == ({SEQ_LEN} if stop is None else set(range(stop, SEQ_LEN + 1)))
    assert enumerate_sequences(SEQ_LEN, None)[0].shape[1] == 2 ** SEQ_LEN
    # the policy controls the length: the study's lengths differ between A_theta and A_old
    laws = _laws(STOP)
    assert abs((laws["p"] @ laws["n"]) - (laws["p_old"] @ laws["n"])) > 0.1


def test_objective_gradients_by_score_function():
    """objective_gradient (autograd through the law) = E[f S] + E[grad f] by the score function."""
    laws = _laws(STOP)
    seq_score = laws["score"].sum(1)
    g_seq = (laws["p"] * laws["R"]) @ seq_score  # E[S] = 0: only the score term
    assert torch.allclose(objective_gradient(THETA, REF, SEQ_LEN, stop_after=STOP), g_seq,
                          atol=1e-13, rtol=0)
    inv_n = 1 / laws["n"]
    g_tok = (laws["p"] * laws["R"] * inv_n) @ seq_score + (laws["p"] * inv_n) @ seq_score
    assert torch.allclose(objective_gradient(THETA, REF, SEQ_LEN, stop_after=STOP, per_token=True),
                          g_tok, atol=1e-13, rtol=0)
    assert ((laws["p"] * inv_n) @ seq_score).norm() > 0.05  # grad E[1/n] is not 0 here


# ---------------------------------------------------------------- on-policy

@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("stop", [None, STOP])
def test_on_policy_every_loss_gives_the_same_gradient(aggregation, stop):
    """At ratio 1 every loss's gradient is A grad log pi per token (gspo's sequence ratio has
    gradient (1/n) sum_t s_t, carried by each of its n tokens), and no clip binds: the same
    E[grad] and variance for every loss, clipped or not, under either aggregation."""
    for config in POLICY_LOSS_KL_CONFIGS:
        ref_mean, ref_var = _moments("ppo-clip", config, aggregation=aggregation, stop=stop)
        for name in POLICY_LOSS_NAMES:
            for clip in (False, True):
                mean, var = _moments(name, config, clip=clip, aggregation=aggregation, stop=stop)
                assert torch.allclose(mean, ref_mean, atol=1e-14, rtol=0), (name, clip, config)
                assert var == pytest.approx(ref_var, rel=1e-12, abs=1e-14), (name, clip, config)


@pytest.mark.parametrize("name", ["gspo", "gspo-token", "ppo-clip"])
@pytest.mark.parametrize("stop", [None, STOP])
def test_on_policy_k1_reward_is_the_aggregations_weighted_score(name, stop):
    """K1 in the reward on-policy: E[w R S] with w = 1 (seq-mean-token-sum) and w = 1/n
    (seq-mean-token-mean), computed directly: GSPO's 1/n inside its sequence ratio is undone by
    the n tokens that carry the sequence's loss; the 1/n weighting is the aggregation's, the
    same for ppo-clip."""
    laws = _laws(stop)
    seq_score = laws["score"].sum(1)
    for aggregation, weight in zip(AGGREGATIONS, (1.0, 1 / laws["n"])):
        expected = (laws["p"] * laws["R"] * weight) @ seq_score
        got = _grad(name, "k1/reward", aggregation=aggregation, stop=stop)
        assert torch.allclose(got, expected, atol=1e-13, rtol=0), aggregation


def test_length_normalised_k1_objectives():
    """Variable lengths, seq-mean-token-mean (GSPO's aggregation, any loss): K1 in the reward is
    biased for the sequence KL and for the per-token-averaged KL E[log(A/B)/n]; it is the
    gradient of E[(log(A/B) - 1)/n]. K1 in reward+loss is the per-token-averaged KL's gradient;
    K1 in the loss alone is grad E[1/n] (a push towards length), not 0."""
    agg = "seq-mean-token-mean"
    g_seq = objective_gradient(THETA, REF, SEQ_LEN, stop_after=STOP)
    g_tok = objective_gradient(THETA, REF, SEQ_LEN, stop_after=STOP, per_token=True)
    y, mask = enumerate_sequences(SEQ_LEN, STOP)
    policy = BinaryARPolicy(*THETA)
    law = (policy(y) * mask).sum(-1).exp()
    g_inv_n = torch.stack(torch.autograd.grad((law / mask.sum(-1)).sum(), [policy.a, policy.b]),
                          dim=-1).squeeze(0)
    for name in ("gspo", "ppo-clip"):
        reward = _grad(name, "k1/reward", aggregation=agg, stop=STOP)
        assert (reward - g_seq).square().sum() > 1e-2 and (reward - g_tok).square().sum() > 1e-3
        assert torch.allclose(reward, g_tok - g_inv_n, atol=1e-13, rtol=0)
        both = _grad(name, "k1/reward+loss", aggregation=agg, stop=STOP)
        assert (both - g_tok).square().sum() < UNBIASED
        assert torch.allclose(_grad(name, "k1/loss", aggregation=agg, stop=STOP), g_inv_n,
                              atol=1e-13, rtol=0)
    # at fixed length E[1/n] is a constant: K1 in the reward is unbiased for the per-token KL
    fixed = _grad("gspo", "k1/reward", aggregation=agg)
    assert (fixed - objective_gradient(THETA, REF, SEQ_LEN, per_token=True)).square().sum() < UNBIASED


def test_token_sum_k1_reward_is_unbiased_at_variable_length():
    """seq-mean-token-sum with a stop token: K1 in the reward is the sequence KL's gradient for
    every loss (gspo included), K1 in the loss is 0 (E[S] = 0 over the stopped law)."""
    g_seq = objective_gradient(THETA, REF, SEQ_LEN, stop_after=STOP)
    for name in ("gspo", "cispo", "sapo"):
        assert (_grad(name, "k1/reward", stop=STOP) - g_seq).square().sum() < UNBIASED
        assert _grad(name, "k1/loss", stop=STOP).abs().max() < 1e-14


# ---------------------------------------------------------------- off-policy

@pytest.mark.parametrize("stop", [None, STOP])
def test_off_policy_k1_reward_closed_forms(stop):
    """Samples from A_old, K1 in the reward (advantage -R), clipping off, seq-mean-token-sum:
      ppo-clip, cispo:  E_old[R sum_t r_t s_t]         (token ratios)
      gspo:             E_old[R w^(1/n) S]             (w = A_theta(y)/A_old(y): a tempered seq-is)
      sapo:             E_old[R sum_t g(r_t) r_t s_t], g(r) = 4 sigma (1 - sigma),
                        sigma = sigmoid(tau (r - 1)), tau by the sign of A = -R
      cispo clipped:    E_old[R sum_t clip(r_t) s_t]   (clip at 1 + 0.28 above, none below)."""
    laws = _laws(stop)
    p_old, R, ratio, score = laws["p_old"], laws["R"], laws["ratio"], laws["score"]
    token = torch.einsum("s,st,std->d", p_old * R, ratio, score)
    assert torch.allclose(_grad("ppo-clip", "k1/reward", stop=stop, off_policy=True), token,
                          atol=1e-13, rtol=0)
    assert torch.allclose(_grad("cispo", "k1/reward", stop=stop, off_policy=True), token,
                          atol=1e-13, rtol=0)
    w = (laws["p"] / p_old) ** (1 / laws["n"])
    gspo = (p_old * R * w) @ score.sum(1)
    for name in ("gspo", "gspo-token"):
        assert torch.allclose(_grad(name, "k1/reward", stop=stop, off_policy=True), gspo,
                              atol=1e-13, rtol=0)
    cfg = LossConfig()
    tau = torch.where(-R > 0, R.new_tensor(cfg.sapo_tau_pos), R.new_tensor(cfg.sapo_tau_neg))[:, None]
    sigma = torch.sigmoid(tau * (ratio - 1))
    sapo = torch.einsum("s,st,std->d", p_old * R, 4 * sigma * (1 - sigma) * ratio, score)
    assert torch.allclose(_grad("sapo", "k1/reward", stop=stop, off_policy=True), sapo,
                          atol=1e-13, rtol=0)
    high = 1 + POLICY_LOSS_CLIPS["cispo"][1]
    cispo = torch.einsum("s,st,std->d", p_old * R, ratio.clamp(max=high), score)
    assert (ratio > high).any()  # the clip binds somewhere
    assert torch.allclose(_grad("cispo", "k1/reward", clip=True, stop=stop, off_policy=True),
                          cispo, atol=1e-13, rtol=0)
    g_seq = objective_gradient(THETA, REF, SEQ_LEN, stop_after=stop)
    for got in (token, gspo, sapo, cispo):
        assert (got - g_seq).square().sum() > 1e-4  # all biased without seq-is


def test_gspo_at_one_token_is_sequence_importance_sampling():
    """n = 1: GSPO's ratio is the sequence weight, so its K1-in-the-reward gradient off-policy is
    seq-is's, unbiased; ppo-clip's token ratio is the same weight at T = 1 too."""
    for name in ("gspo", "ppo-clip"):
        got = policy_loss_moments(THETA, REF, 1, _kl("k1/reward"), policy_loss_config(name, False),
                                  OLD)[0]
        assert (got - objective_gradient(THETA, REF, 1)).square().sum() < UNBIASED


@pytest.mark.parametrize("stop", [None, STOP])
def test_off_policy_where_the_loss_does_not_matter(stop):
    """With task reward 0 the policy loss sees a zero advantage wherever the KL is outside it
    (the loss placement; seq-is, which moves the reward-side KL into its own surrogate): every
    loss, clipped or not, gives the same gradient there. seq-is gives the on-policy expectation
    (K1 reward, reward+loss and K3 reward+loss unbiased); cispo unclipped is ppo-clip unclipped
    everywhere (gradient sg(r) A s = A grad r); dual-clip is ppo-clip while the token ratios stay
    below c."""
    laws = _laws(stop)
    assert laws["ratio"].max() < LossConfig().clip_ratio_c
    g_seq = objective_gradient(THETA, REF, SEQ_LEN, stop_after=stop)
    for config in POLICY_LOSS_KL_CONFIGS:
        for correction in ("none", "token-is", "seq-is"):
            base = _grad("ppo-clip", config, stop=stop, off_policy=True, correction=correction)
            for clip in (False, True):
                assert torch.equal(_grad("dual-clip", config, clip=clip, stop=stop, off_policy=True,
                                         correction=correction),
                                   _grad("ppo-clip", config, clip=clip, stop=stop,
                                         off_policy=True, correction=correction))
            assert torch.allclose(_grad("cispo", config, stop=stop, off_policy=True,
                                        correction=correction), base, atol=1e-14, rtol=0)
            if correction == "seq-is" or config.endswith("/loss"):
                for name in POLICY_LOSS_NAMES:
                    for clip in (False, True):
                        got = _grad(name, config, clip=clip, stop=stop, off_policy=True,
                                    correction=correction)
                        assert torch.allclose(got, base, atol=1e-14, rtol=0), (name, config)
        if config in ("k1/reward", "k1/reward+loss", "k3/reward+loss"):
            seq_is = _grad("gspo", config, stop=stop, off_policy=True, correction="seq-is")
            assert (seq_is - g_seq).square().sum() < UNBIASED, config


def test_seq_is_loss_side_is_biased_under_length_normalisation():
    """seq-mean-token-mean with variable lengths: the loss-side term K_t / n depends on the
    tokens after t (through n), which the prefix weight w_{<=t} does not cover: seq-is no longer
    gives the on-policy expectation there (the reward side's sequence weight still does)."""
    agg = "seq-mean-token-mean"
    for config, same in (("k1/reward", True), ("k1/loss", False), ("k1/reward+loss", False)):
        on = _grad("gspo", config, aggregation=agg, stop=STOP)
        off = _grad("gspo", config, aggregation=agg, stop=STOP, off_policy=True, correction="seq-is")
        assert torch.allclose(off, on, atol=1e-13, rtol=0) == same, config
    fixed_on = _grad("gspo", "k1/reward+loss", aggregation=agg)
    fixed_off = _grad("gspo", "k1/reward+loss", aggregation=agg, off_policy=True, correction="seq-is")
    assert torch.allclose(fixed_on, fixed_off, atol=1e-13, rtol=0)  # fixed n: prefix weights suffice


def test_gspo_clip_range_zeroes_most_sequences_off_policy():
    """GSPO's 3e-4/4e-4 range on the sequence ratio: off-policy nearly every sequence's ratio is
    outside it; the clip removes the gradient of those whose advantage pushes the ratio further
    out, so the expected gradient shrinks towards the sequences with s < 1 - 3e-4 and A > 0."""
    laws = _laws(None)
    s = (laws["p"] / laws["p_old"]) ** (1 / laws["n"])
    low, high = POLICY_LOSS_CLIPS["gspo"]
    inside = ((s >= 1 - low) & (s <= 1 + high)).to(torch.float64)
    assert (laws["p_old"] @ inside).item() < 0.05
    A = -laws["R"]
    keep = ((A > 0) & (s <= 1 + high)) | ((A < 0) & (s >= 1 - low)) | (A == 0)
    expected = (laws["p_old"] * laws["R"] * s * keep) @ laws["score"].sum(1)
    assert torch.allclose(_grad("gspo", "k1/reward", clip=True, off_policy=True), expected,
                          atol=1e-13, rtol=0)


# ---------------------------------------------------------------- CLI

def test_cli_policy_loss_study(tmp_path, capsys):
    base = ["--seq-len", "4", "--num-trials", "0", "--no-plot", "--json"]
    assert main(["--out", str(tmp_path / "plain"), *base]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "policy_loss" not in plain
    argv = ["--out", str(tmp_path / "all"), *base, "--policy-loss", "all", "--stop-after-ones", "2",
            "--loss-aggregation", "seq-mean-token-mean"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == plain["rows"]  # the default study is untouched
    study = result["policy_loss"]
    assert study["losses"] == list(POLICY_LOSS_NAMES) and study["stop_after"] == 2
    assert study["target"] == "per-token"
    assert len(study["rows"]) == len(POLICY_LOSS_NAMES) * 2 * len(POLICY_LOSS_KL_CONFIGS) * 4
    on = [r for r in study["rows"] if r["sampling"] == "on-policy"]
    assert max(r["closed_form_abs_err"] for r in on) < 1e-12
    rows = {(r["loss"], r["config"], r["clip"], r["sampling"], r["correction"]): r
            for r in study["rows"]}
    assert rows["gspo", "k1/reward+loss", "off", "on-policy", "none"]["biased"] is False
    assert rows["gspo", "k1/reward", "off", "on-policy", "none"]["biased"] is True
    table = (tmp_path / "all" / "table.md").read_text()
    assert "Policy losses (--policy-loss)" in table and "| k1/reward | seq-is |" in table
    assert main(["--out", str(tmp_path / "one"), *base[:-1], "--policy-loss", "cispo"]) == 0
    assert "| config | gradient of | cispo |" in capsys.readouterr().out
    for bad in (["--stop-after-ones", "2"], ["--loss-aggregation", "seq-mean-token-mean"],
                ["--policy-loss", "gspo", "--stop-after-ones", "5"]):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "bad"), *base, *bad])


def test_policy_loss_config_clipping():
    off = policy_loss_config("gspo", False)
    assert (off.clip_low, off.clip_high, off.policy_loss) == (1.0, math.inf, "gspo")
    on = policy_loss_config("gspo", True, "seq-mean-token-mean")
    assert (on.clip_low, on.clip_high, on.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert policy_loss_config("dual-clip", False).clip_ratio_c == LossConfig().clip_ratio_c
    with pytest.raises(ValueError, match="--policy-loss"):
        policy_loss_config("my.module:loss", False)
