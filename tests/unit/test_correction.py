"""Rollout correction (megatron_rl/correction.py): the weights of each correction against their
definitions, the logged statistics against a direct computation, and the loss they enter."""
import math

import pytest
import torch

from megatron_rl.correction import (CorrectionStats, RolloutCorrectionConfig,
                                    rollout_correction_weights)
from megatron_rl.loss import LossConfig, policy_loss_per_token


def _batch():
    """Three responses (the last one shorter) with log pi_old - log mu chosen to hit every
    branch: ratios inside and outside [0.5, 2] and [0.5, 5]."""
    log_w = torch.tensor([[0.1, -0.2, 0.3, 0.0],
                          [1.0, 2.0, -1.0, 0.5],
                          [-3.0, 0.2, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    rollout = torch.full_like(log_w, -1.5)
    return rollout + log_w, rollout, mask, log_w


def test_tis_truncates_token_weights_at_the_upper_bound():
    old, rollout, mask, log_w = _batch()
    w, _ = rollout_correction_weights(old, rollout, mask, RolloutCorrectionConfig("tis"))
    expected = (log_w.exp().clamp(max=2.0) * mask).float()
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad
    w, _ = rollout_correction_weights(old, rollout, mask,
                                      RolloutCorrectionConfig("tis", is_low=0.5, is_high=3.0))
    torch.testing.assert_close(w, (log_w.exp().clamp(0.5, 3.0) * mask).float())


def test_icepop_masks_token_weights_outside_its_band():
    old, rollout, mask, log_w = _batch()
    w, stats = rollout_correction_weights(old, rollout, mask, RolloutCorrectionConfig("icepop"))
    raw = log_w.exp()
    keep = (raw >= 0.5) & (raw <= 5.0) & (mask > 0)
    torch.testing.assert_close(w, (raw * keep).float())
    sums = dict(zip(CorrectionStats.names(), stats.sums.tolist()))
    assert sums["changed"] == int(((~keep) & (mask > 0)).sum()) == 3  # e^2, e^-1, e^-3


def test_seq_mis_keeps_or_masks_whole_sequences_by_their_ratio_product():
    old, rollout, mask, log_w = _batch()
    w, stats = rollout_correction_weights(old, rollout, mask, RolloutCorrectionConfig("seq-mis"))
    rho = ((log_w * mask).sum(-1)).exp()  # e^0.2, e^2.5, e^-2.8
    keep = (rho >= 0.5) & (rho <= 2.0)
    assert keep.tolist() == [True, False, False]
    torch.testing.assert_close(w, ((rho * keep)[:, None] * mask).float())
    sums = dict(zip(CorrectionStats.names(), stats.sums.tolist()))
    assert sums["masked_seqs"] == 2 and sums["seqs"] == 3


def test_statistics_match_a_direct_computation():
    old, rollout, mask, log_w = _batch()
    cfg = RolloutCorrectionConfig("tis")
    w, stats = rollout_correction_weights(old, rollout, mask, cfg)
    m = CorrectionStats.as_metrics(stats.sums.tolist(), float(stats.raw_max),
                                   float(stats.raw_min))
    raw = log_w.exp()[mask > 0]
    corrected = w.double()[mask > 0]
    n = raw.numel()
    assert m["rollout_corr/is_mean"] == pytest.approx(float(raw.mean()), rel=1e-6)
    assert m["rollout_corr/is_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    assert m["rollout_corr/is_min"] == pytest.approx(math.exp(-3.0), rel=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(float(raw.square().mean()) - 1, rel=1e-6)
    assert m["rollout_corr/is_ess"] == pytest.approx(
        float(raw.sum() ** 2 / (n * raw.square().sum())), rel=1e-6)
    assert m["rollout_corr/weight_mean"] == pytest.approx(float(corrected.mean()), rel=1e-6)
    assert m["rollout_corr/changed_fraction"] == pytest.approx(float((raw > 2).sum()) / n)
    assert m["rollout_corr/log_ratio_abs_mean"] == pytest.approx(
        float(log_w.abs()[mask > 0].mean()), rel=1e-6)


def test_weights_scale_the_policy_gradient_term_only():
    """The loss with weights w has the policy-gradient gradient of each token times w_t; the
    KL term in the loss is not weighted; weights of one leave the loss unchanged."""
    torch.manual_seed(0)
    B, T = 3, 5
    old = -torch.rand(B, T) - 0.5
    ref = -torch.rand(B, T) - 0.5
    adv = torch.randn(B)
    mask = torch.ones(B, T)
    w = torch.rand(B, T) * 2

    def grads(cfg, weights):
        lp = (old + 0.05 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))
              ).requires_grad_()
        per_token, _ = policy_loss_per_token(lp, old, adv, mask, cfg, ref_logprobs=ref,
                                             is_weights=weights)
        per_token.sum().backward()
        return per_token.detach(), lp.grad

    pg_only = LossConfig()  # K1 in the reward: nothing in the loss but the surrogate
    base_loss, base_grad = grads(pg_only, None)
    ones_loss, ones_grad = grads(pg_only, torch.ones(B, T))
    torch.testing.assert_close(ones_loss, base_loss)
    torch.testing.assert_close(ones_grad, base_grad)
    _, weighted = grads(pg_only, w)
    torch.testing.assert_close(weighted, base_grad * w)

    from megatron_rl.kl import KLConfig

    in_loss = LossConfig(kl=KLConfig(estimator="k3", placement="loss", coef=0.1))
    pg_kl_loss, pg_kl_grad = grads(in_loss, None)
    _, weighted_kl_grad = grads(in_loss, w)
    kl_grad = pg_kl_grad - base_grad  # the KL term's own gradient
    torch.testing.assert_close(weighted_kl_grad, base_grad * w + kl_grad)


def test_bounds_are_checked(tmp_path):
    from megatron_rl.config import parse_config

    yaml_path = tmp_path / "cfg.yaml"  # YAML values bypass argparse's choices
    yaml_path.write_text("rollout_correction: is\n")
    with pytest.raises(ValueError, match="--rollout-correction 'is'; valid: none, tis"):
        parse_config(["--config", str(yaml_path), "--hf-checkpoint", "m", "--train-data", "d"])
    with pytest.raises(ValueError, match="need 0 <= low < high"):
        RolloutCorrectionConfig("icepop", is_low=6.0).validate()
    with pytest.raises(ValueError, match="--rollout-is-low 6.0 / --rollout-is-high 5.0"):
        parse_config(["--hf-checkpoint", "m", "--train-data", "d", "--rollout-correction",
                      "icepop", "--rollout-is-low", "6", "--old-logprobs", "recompute"])


def test_kl_importance_weights_divide_by_the_proposal_asked_for():
    """--kl-is-proposal rollout: the KL's seq-is / token-is weights are pi_theta / mu (the
    engine's log-probs), not pi_theta / pi_old; the policy-gradient term is untouched."""
    from megatron_rl.kl import KLConfig, kl_loss_term, kl_reward_is_surrogate

    torch.manual_seed(1)
    B, T = 2, 4
    lp = (-torch.rand(B, T) - 0.5).requires_grad_()
    old, mu, ref = (-torch.rand(B, T) - 0.5 for _ in range(3))
    adv, mask = torch.randn(B), torch.ones(B, T)
    for correction in ("seq-is", "token-is"):
        kl = KLConfig(estimator="k3", placement="reward+loss", off_policy_correction=correction)
        behaviour = LossConfig(kl=kl)
        rollout = LossConfig(kl=KLConfig(**{**kl.__dict__, "is_proposal": "rollout"}))
        pg_only = LossConfig(kl=KLConfig(placement="none"))
        base, _ = policy_loss_per_token(lp, old, adv, mask, pg_only)
        for cfg, q in ((behaviour, old), (rollout, mu)):
            got, _ = policy_loss_per_token(lp, old, adv, mask, cfg, ref_logprobs=ref,
                                           rollout_logprobs=mu)
            want = base + kl_loss_term(lp, ref, mask, kl, q)
            if correction == "seq-is":
                want = want + kl_reward_is_surrogate(lp, ref, q, mask, kl)
            torch.testing.assert_close(got, want)
