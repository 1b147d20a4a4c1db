"""The policy losses of --policy-loss (policy_losses.py) against direct float64 computations of
their values and gradients; ppo-clip's ops unchanged; sequence-level losses per sequence and
independent of padding; a loss by import path; the entropy bonus; overlong handling; the flags'
validation."""
import math
import sys

import pytest
import torch

from megatron_rl.kl import KLConfig
from megatron_rl.loss import (LossConfig, build_advantages, policy_loss, policy_loss_per_token,
                              shape_overlong)
from megatron_rl.policy_losses import POLICY_LOSSES

F64 = torch.float64
BUILT_INS = ("ppo-clip", "dual-clip", "gspo", "gspo-token", "cispo", "sapo")


def _batch(seed=0, batch=6, seq_len=7, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, seq_len, generator=gen, dtype=F64) * 2 - 0.1
    old = logprobs + spread * torch.randn(batch, seq_len, generator=gen, dtype=F64)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen)
    mask = (torch.arange(seq_len) < lengths[:, None]).to(F64)
    advantages = torch.randn(batch, generator=gen, dtype=F64)
    return logprobs, old, mask, advantages


def _cfg(name, **kw):
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.28)
    return LossConfig(policy_loss=name, kl=KLConfig(placement="none"), **kw)


# -- direct per-sequence float64 computations, written from the papers' formulas ---------------

def _clip(x, cfg):
    return min(max(x, 1 - cfg.clip_low), 1 + cfg.clip_high)


def _naive_token_loss(name, lp, old, a, cfg, seq):
    """The loss of one token (lp: its 0-dim log-prob with grad) of a sequence whose tokens'
    (logprobs, old_logprobs) lists are `seq`, with advantage a (a float)."""
    if name in ("gspo", "gspo-token"):
        s = torch.exp(sum(l - o for l, o in seq) / len(seq))
        if name == "gspo-token":  # the value of s, the gradient of this token's log-prob only
            s = s.detach() * torch.exp(lp - lp.detach())
        return torch.maximum(-a * s, -a * torch.clamp(s, 1 - cfg.clip_low, 1 + cfg.clip_high))
    r = torch.exp(lp - old)
    if name == "cispo":
        return -_clip(r.item(), cfg) * a * lp
    if name == "sapo":
        tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
        return -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
    ppo = torch.maximum(-a * r, -a * torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
    if name == "dual-clip" and a < 0:
        return torch.minimum(ppo, torch.tensor(-a * cfg.clip_ratio_c, dtype=F64))
    return ppo


def _naive_loss(name, logprobs, old, mask, advantages, cfg, aggregation):
    """Sum over sequences of a Python loop over their tokens; logprobs [B, T] with grad."""
    total = torch.zeros((), dtype=F64)
    num_tokens = mask.sum().item()
    for i in range(logprobs.shape[0]):
        idx = [t for t in range(logprobs.shape[1]) if mask[i, t] > 0]
        seq = [(logprobs[i, t], old[i, t]) for t in idx]
        losses = [_naive_token_loss(name, logprobs[i, t], old[i, t], advantages[i].item(), cfg,
                                    seq) for t in idx]
        if aggregation == "seq-mean-token-mean":
            total = total + sum(losses) / len(idx) / logprobs.shape[0]
        else:  # token-sum-over-batch-tokens
            total = total + sum(losses) / num_tokens
    return total


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-sum-over-batch-tokens"])
@pytest.mark.parametrize("name", BUILT_INS)
def test_value_and_gradient_against_a_direct_fp64_computation(name, aggregation):
    # gspo's clip range is GSPO's scale, the others' PPO's; the spread makes both branches occur
    cfg = _cfg(name, aggregation=aggregation,
               **(dict(clip_low=0.03, clip_high=0.04) if "gspo" in name else {}))
    logprobs, old, mask, adv = _batch(seed=3, spread=0.4 if "gspo" not in name else 0.1)
    lp = logprobs.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, num_global_tokens=mask.sum().item(),
                                num_global_seqs=mask.shape[0])
    (grad,) = torch.autograd.grad(loss, lp)

    lp_ref = logprobs.clone().requires_grad_()
    expected = _naive_loss(name, lp_ref, old, mask, adv, cfg, aggregation)
    (grad_ref,) = torch.autograd.grad(expected, lp_ref)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-13)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-13)
    assert grad.abs().sum() > 0 and (grad * (1 - mask)).abs().sum() == 0
    if name not in ("sapo", "cispo"):  # both the clipped and the unclipped branch occur
        assert 0 < metrics["clip_fraction"].item() < 1, metrics


def test_ppo_clip_is_the_previous_formula_op_for_op():
    """The default loss: the same ops in the same order as the PPO-clip code it replaces, so
    bit-identical losses, gradients and metrics (float32, rollout correction and KL in the
    loss included)."""
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 9, generator=gen) * 3
    old = logprobs + 0.3 * torch.randn(5, 9, generator=gen)
    ref = logprobs + 0.3 * torch.randn(5, 9, generator=gen)
    mask = (torch.rand(5, 9, generator=gen) < 0.8).float()
    is_w = torch.rand(5, 9, generator=gen) * 2
    for adv, kl in [(torch.randn(5, generator=gen), KLConfig("k3", "reward+loss", coef=0.1)),
                    (torch.randn(5, 9, generator=gen), KLConfig(placement="none"))]:
        cfg = LossConfig(clip_low=0.2, clip_high=0.28, kl=kl)
        lp = logprobs.clone().requires_grad_()
        per_token, metrics = policy_loss_per_token(lp, old, adv, mask, cfg, ref_logprobs=ref,
                                                   is_weights=is_w)
        (grad,) = torch.autograd.grad((per_token * mask).sum(), lp)

        lp_old = logprobs.clone().requires_grad_()
        a = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        log_ratio = (lp_old - old) * mask
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - 0.2, 1 + 0.28)
        pg_unclipped, pg_clipped = -a * ratio, -a * clipped
        pg = torch.maximum(pg_unclipped, pg_clipped) * is_w
        expected = pg
        if kl.in_loss:
            from megatron_rl.kl import kl_loss_term
            expected = expected + kl_loss_term(lp_old, ref, mask, kl, old)
        (grad_old,) = torch.autograd.grad((expected * mask).sum(), lp_old)
        assert torch.equal(per_token, expected) and torch.equal(grad, grad_old)
        assert torch.equal(metrics["pg_per_token"], pg.detach())
        num = mask.sum().clamp(min=1)
        assert torch.equal(metrics["clip_fraction"],
                           ((pg_clipped > pg_unclipped).float() * mask).sum() / num)
        assert torch.equal(metrics["ratio_mean"], (ratio * mask).sum().detach() / num)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # ratios 5, 2, 5 with advantages -1, -1, +1; c = 3, clip range [0.8, 1.2]
    old = torch.zeros(1, 3, dtype=F64)
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    cfg = _cfg("dual-clip", clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    per_token, metrics = policy_loss_per_token(lp, old, adv, mask, cfg)
    # A < 0, r = 5 > c: -A c = 3 (PPO: 5); r = 2 < c: PPO's 2; A > 0: PPO's clipped -1.2
    torch.testing.assert_close(per_token.detach(), torch.tensor([[3.0, 2.0, -1.2]], dtype=F64))
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=F64))
    assert metrics["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    ppo, _ = policy_loss_per_token(lp, old, adv, mask, _cfg("ppo-clip", clip_low=0.2,
                                                             clip_high=0.2))
    assert ppo[0, 0].item() == pytest.approx(5.0)


def test_gspo_ratio_is_the_sequence_geometric_mean_and_clips_per_sequence():
    # row 0: token log-ratios +2, -2, 0 (mean 0: s = 1, inside the clip although token 0's
    # ratio e^2 is far outside PPO's range); row 1: +0.3, +0.3 then padding (s = e^0.3, clipped)
    old = torch.zeros(2, 3, dtype=F64)
    lp = torch.tensor([[2.0, -2.0, 0.0], [0.3, 0.3, 7.0]], dtype=F64).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    cfg = _cfg("gspo", clip_low=0.1, clip_high=0.1)
    per_token, metrics = policy_loss_per_token(lp, old, adv, mask, cfg)
    s = torch.tensor([1.0, math.exp(0.3)], dtype=F64)
    assert metrics["seq_ratio_max"].item() == pytest.approx(s[1].item())
    assert metrics["seq_ratio_min"].item() == pytest.approx(1.0)
    assert metrics["seq_clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)  # the tokens of row 1
    torch.testing.assert_close(per_token.detach(),
                               torch.tensor([[-1.0] * 3, [-1.1] * 3], dtype=F64))
    (grad,) = torch.autograd.grad((per_token * mask).sum(), lp)
    # row 0: d(-s)/dlp_t = -s / n per token, times its 3 tokens; row 1 clipped: no gradient
    torch.testing.assert_close(grad, torch.tensor([[-1.0] * 3, [0.0] * 3], dtype=F64))
    ppo, _ = policy_loss_per_token(lp, old, adv, mask, _cfg("ppo-clip", clip_low=0.1,
                                                             clip_high=0.1))
    (grad_ppo,) = torch.autograd.grad((ppo * mask).sum(), lp)
    assert grad_ppo[0, 0] == 0 and grad_ppo[0, 1] != 0  # per token, token 0 is clipped


def test_gspo_refuses_token_advantages_gspo_token_takes_them():
    logprobs, old, mask, _ = _batch()
    token_adv = torch.randn(logprobs.shape, dtype=F64)
    with pytest.raises(ValueError, match="--policy-loss gspo takes one advantage per sequence.*"
                                         "gspo-token"):
        policy_loss_per_token(logprobs, old, token_adv, mask, _cfg("gspo"))
    cfg = _cfg("gspo-token", clip_low=0.05, clip_high=0.05)
    lp = logprobs.clone().requires_grad_()
    per_token, _ = policy_loss_per_token(lp, old, token_adv, mask, cfg)
    (grad,) = torch.autograd.grad((per_token * mask).sum(), lp)
    # analytic: -A_t s_i where -A_t s_i >= -A_t clip(s_i), else 0; nothing across tokens
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(((logprobs - old) * mask).sum(-1, keepdim=True) / n)
    cs = s.clamp(0.95, 1.05)
    expected = torch.where(-token_adv * s >= -token_adv * cs, -token_adv * s, 0.0) * mask
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", BUILT_INS)
def test_padding_does_not_change_a_sequences_loss(name):
    """The same sequences in rows of 7 and of 12 positions, the extra positions holding
    arbitrary values (as a packed microbatch's unpacked rows or a longer padded batch would):
    the per-token losses and gradients of the sequences' tokens are the same."""
    logprobs, old, mask, adv = _batch(seed=5, spread=0.1)
    gen = torch.Generator().manual_seed(9)
    pad = lambda x: torch.cat([x, torch.randn(x.shape[0], 5, generator=gen, dtype=F64)], 1)  # noqa: E731
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 5, dtype=F64)], 1)
    cfg = _cfg(name, clip_low=0.03, clip_high=0.04)
    results = []
    for lp0, old0, m in [(logprobs, old, mask), (pad(logprobs), pad(old), padded_mask)]:
        lp = lp0.clone().requires_grad_()
        per_token, _ = policy_loss_per_token(lp, old0, adv, m, cfg)
        (grad,) = torch.autograd.grad((per_token * m).sum(), lp)
        results.append(((per_token * m)[:, :7].detach(), grad[:, :7], grad[:, 7:]))
    (short, g_short, _), (long, g_long, g_pad) = results
    torch.testing.assert_close(long, short, rtol=0, atol=1e-15)
    torch.testing.assert_close(g_long, g_short, rtol=0, atol=1e-15)
    assert g_pad.abs().sum() == 0


def test_a_policy_loss_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        "def reinforce(logprobs, old_logprobs, advantages, loss_mask, cfg):\n"
        "    return -advantages * logprobs, {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_losses", raising=False)
    cfg = _cfg("my_losses:reinforce")
    cfg.validate()
    logprobs, old, mask, adv = _batch()
    lp = logprobs.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, num_global_tokens=mask.sum().item())
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum())
    assert "pg_loss" in metrics
    for name, message in [("nope", r"--policy-loss 'nope': neither a built-in policy loss "
                                   r"\(ppo-clip, dual-clip, gspo, gspo-token, cispo, sapo\)"),
                          ("my_losses:missing", "'my_losses' has no attribute 'missing'"),
                          ("no_such_module_q:f", "cannot import module 'no_such_module_q'")]:
        with pytest.raises(ValueError, match=message):
            _cfg(name).validate()


def test_entropy_bonus_has_the_gradient_of_minus_coef_times_the_entropy():
    """--entropy-coef through the scoring op: the loss's gradient w.r.t. the logits is the
    policy loss's plus -coef x that of the aggregated entropy, computed here in float64 from
    log_softmax."""
    from megatron_rl.ops import token_logprobs_and_kl

    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 11
    logits = torch.randn(B, T, V, generator=gen, dtype=F64)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.8).to(F64)
    adv = torch.randn(B, generator=gen, dtype=F64)
    grads = {}
    for coef in (0.0, 0.3):
        x = logits.clone().requires_grad_()
        o = token_logprobs_and_kl(x, targets, return_entropy=True)
        cfg = _cfg("ppo-clip", entropy_coef=coef)
        loss, _ = policy_loss(o.logprobs, o.logprobs.detach(), adv, mask, cfg,
                              entropy=o.entropy, num_global_tokens=mask.sum().item())
        (grads[coef],) = torch.autograd.grad(loss, x)
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    (g_entropy,) = torch.autograd.grad((entropy * mask).sum() / mask.sum(), x)
    torch.testing.assert_close(grads[0.3] - grads[0.0], -0.3 * g_entropy, rtol=0, atol=1e-12)
    assert g_entropy.abs().sum() > 0
    with pytest.raises(ValueError, match="--entropy-coef 0.3 needs the policy's entropy"):
        policy_loss(logits[..., 0], logits[..., 0], adv, mask, _cfg("ppo-clip", entropy_coef=0.3),
                    num_global_tokens=1.0)


def test_overlong_filtering_masks_the_truncated_responses_out():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = torch.ones(4, 6)
    cfg = LossConfig(overlong_filtering=True)
    r, m, counts = shape_overlong(rewards, mask, [3, 6, 6, 2], ["stop", "length", "length",
                                                                "stop"], 6, cfg)
    assert torch.equal(m.sum(-1), torch.tensor([6.0, 0.0, 0.0, 6.0]))
    assert torch.equal(r, rewards) and torch.equal(mask, torch.ones(4, 6))  # inputs kept
    assert counts["overlong/filtered"] == 2
    # masked out of the loss and of its KL: no gradient reaches the filtered rows
    lp = torch.randn(4, 6, dtype=F64, requires_grad=True)
    cfg_kl = LossConfig(overlong_filtering=True, kl=KLConfig("k3", "reward+loss", coef=0.1))
    ref = torch.randn(4, 6, dtype=F64)
    adv = build_advantages(r, lp.detach(), ref, m, cfg_kl, group_size=2)
    loss, _ = policy_loss(lp, lp.detach(), adv, m, cfg_kl, ref_logprobs=ref,
                          num_global_tokens=m.sum().item())
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[1:3].abs().sum() == 0 and grad[0].abs().sum() > 0


@pytest.mark.parametrize("length, penalty", [(5, 0.0), (6, 0.0), (7, 0.25), (9, 0.75),
                                             (10, 1.0)])
def test_soft_overlong_punishment_at_the_buffer_boundaries(length, penalty):
    # --max-new-tokens 10, buffer 4: no penalty up to 6 tokens, linear to -factor at 10
    for factor in (1.0, 0.5):
        cfg = LossConfig(overlong_buffer_len=4, overlong_penalty_factor=factor)
        r, m, counts = shape_overlong(torch.tensor([1.0]), torch.ones(1, 10), [length],
                                      ["length" if length == 10 else "stop"], 10, cfg)
        assert r.item() == pytest.approx(1.0 - factor * penalty)
        assert torch.equal(m, torch.ones(1, 10))  # the punishment alone masks nothing
        assert counts["overlong/penalized"] == (penalty > 0)


def _train_config(**loss):
    from megatron_rl.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.hf_checkpoint, cfg.data.train_data = "m", ["d.jsonl"]
    for k, v in loss.items():
        setattr(cfg.algorithm.loss, k, v)
    return cfg


@pytest.mark.parametrize("loss, message", [
    (dict(clip_ratio_c=1.0), r"--clip-ratio-c 1.0: must be > 1"),
    (dict(sapo_tau_neg=0.0), r"--sapo-tau-pos 1.0, --sapo-tau-neg 0.0: both must be > 0"),
    (dict(policy_loss="gspo", kl=KLConfig("k1", "reward", reward_to_go=True)),
     r"--policy-loss gspo takes one advantage per sequence, but --kl-reward-to-go .*"
     r"--policy-loss gspo-token"),
    (dict(policy_loss="gspo", kl=KLConfig("exact", "reward+loss")),
     r"--kl-estimator exact in the reward"),
    (dict(policy_loss="ppo"), r"--policy-loss 'ppo': neither a built-in policy loss"),
    (dict(overlong_buffer_len=256), r"--overlong-buffer-len 256: .*--max-new-tokens \(256\)"),
    (dict(overlong_buffer_len=-1), r"--overlong-buffer-len -1: must be >= 0"),
])
def test_flags_are_validated(loss, message):
    with pytest.raises(ValueError, match=message):
        _train_config(**loss).validate()


def test_accepted_combinations():
    for name in POLICY_LOSSES:  # token advantages: every loss but gspo
        if name != "gspo":
            _train_config(policy_loss=name, kl=KLConfig("k1", "reward", reward_to_go=True)
                          ).validate()
    _train_config(policy_loss="gspo", kl=KLConfig("k3", "reward+loss")).validate()
    cfg = _train_config(overlong_buffer_len=64, overlong_filtering=True)
    cfg.validate()
    cfg.rollout.rollout_function = "agent"
    with pytest.raises(ValueError, match="--overlong-buffer-len measures .*--rollout-function "
                                         "agent"):
        cfg.validate()
    cfg.algorithm.loss.overlong_buffer_len = 0
    cfg.validate()  # filtering works with any rollout function


def test_the_update_shapes_the_batch_it_trains_on():
    """update.overlong_batch: the batch's truncated rows masked, the punishment in its rewards,
    the fractions logged; the rollout's batch itself is kept (its metrics are the task's)."""
    from megatron_rl.batch import pack_rollouts
    from megatron_rl.rollout.base import Completion
    from megatron_rl.rollout.single_turn import single_turn_trajectory
    from megatron_rl.update import overlong_batch

    def traj(n, reason, reward):
        return single_turn_trajectory([1, 2], Completion(list(range(3, 3 + n)), [-0.5] * n,
                                                         reason), reward)

    batch = pack_rollouts([[traj(3, "stop", 1.0), traj(8, "length", 0.0)],
                           [traj(7, "stop", 1.0), traj(2, "stop", 0.0)]], pad_token_id=0)
    cfg = _train_config(overlong_filtering=True, overlong_buffer_len=4)
    cfg.rollout.max_new_tokens = 8
    metrics: dict = {}
    shaped = overlong_batch(batch, cfg, metrics)
    assert shaped.loss_mask.sum(-1).tolist() == [3.0, 0.0, 7.0, 2.0]
    assert shaped.rewards.tolist() == [1.0, -1.0, 0.25, 0.0]  # start 4: 8 -> -1, 7 -> -0.75
    assert batch.loss_mask.sum(-1).tolist() == [3.0, 8.0, 7.0, 2.0]
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"overlong/filtered_fraction": 0.25, "overlong/penalized_fraction": 0.5,
                       "overlong/penalty_mean": pytest.approx(1.75 / 4)}


@pytest.mark.parametrize("name", ["gspo", "cispo", "ppo-clip"])
def test_trainer_loss_function_packed_equals_padded_with_entropy_bonus(name):
    """update.make_rl_loss_fn, the trainer's loss function, on one batch in its two layouts:
    right-padded rows scored from logits, and packed rows scored from hidden states (fused LM
    head). A position-wise stand-in model (hidden = E[token] + P[position]) gives both the same
    per-token outputs, so loss and gradients must agree; with --entropy-coef the difference to
    the loss without it is -coef x the aggregated entropy, whose gradient is computed here in
    float64 from log_softmax."""
    import functools
    import types

    from megatron_rl.batch import pack_rollouts
    from megatron_rl.models.policy import Policy
    from megatron_rl.packing import Layout
    from megatron_rl.rollout.base import Completion
    from megatron_rl.rollout.single_turn import single_turn_groups
    from megatron_rl.update import loss_microbatch, make_rl_loss_fn

    groups = [[Completion([5, 6, 7], [-0.5, -0.7, -0.1], "stop"), Completion([8], [-0.2], "stop")],
              [Completion([9, 2], [-1.0, -0.3], "stop"), Completion([3, 4, 5, 6], [-0.4] * 4,
                                                                     "stop")]]
    batch = pack_rollouts(single_turn_groups([[1, 2, 3], [4]], groups, [1.0, 0.0, 0.0, 1.0]),
                          pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    V, H = 12, 6
    batch.loss_mask = batch.loss_mask.double()
    batch.old_logprobs = (batch.rollout_logprobs.double()
                          + 0.3 * torch.randn(batch.loss_mask.shape, generator=gen, dtype=F64))
    emb0 = torch.randn(V, H, generator=gen, dtype=F64)
    pos0 = torch.randn(16, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    ref = batch.old_logprobs + 0.2 * torch.randn(batch.loss_mask.shape, generator=gen, dtype=F64)
    cfg = LossConfig(policy_loss=name, clip_low=0.05, clip_high=0.05,
                     aggregation="seq-mean-token-mean", kl=KLConfig("k3", "reward+loss"))
    adv = build_advantages(batch.rewards.double(), batch.old_logprobs, ref, batch.loss_mask, cfg,
                           batch.group_size)
    results = {}
    for packed in (False, True):
        for coef in (0.0, 0.5):
            cfg.entropy_coef = coef
            lay = Layout(packed=packed, micro_batch_size=4)
            (m,) = lay.microbatches(batch.tokens, batch.seq_lengths, [0, 1, 2, 3])
            mb = loss_microbatch(batch, adv, ref, m)
            emb, pos = emb0.clone().requires_grad_(), pos0.clone().requires_grad_()
            tokens = m.inputs["tokens"]
            positions = m.inputs.get("position_ids", torch.arange(tokens.shape[1])[None])
            hidden = emb[tokens] + pos[positions]
            policy = types.SimpleNamespace(tp_group=None, vocab_start=0, fused_lm_head=packed,
                                           output_weight=lambda: weight)
            policy.score = functools.partial(Policy.score, policy)
            out = hidden if packed else hidden @ weight.T
            loss, metrics = make_rl_loss_fn(policy, cfg, float(batch.loss_mask.sum()), 4.0)(mb,
                                                                                          out)
            results[packed, coef] = (loss.detach(), *torch.autograd.grad(loss, (emb, pos)))
    for coef in (0.0, 0.5):
        for a, b in zip(results[True, coef], results[False, coef]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    emb, pos = emb0.clone().requires_grad_(), pos0.clone().requires_grad_()
    logp = torch.log_softmax((emb[batch.tokens] + pos[:batch.tokens.shape[1]]) @ weight.T, -1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    mask = batch.loss_mask
    mean_entropy = ((entropy * mask).sum(-1) / mask.sum(-1)).sum() / 4
    expected = torch.autograd.grad(-0.5 * mean_entropy, (emb, pos))
    for got_with, got_without, e in zip(results[False, 0.5][1:], results[False, 0.0][1:],
                                        expected):
        torch.testing.assert_close(got_with - got_without, e, rtol=0, atol=1e-12)
    assert expected[0].abs().sum() > 0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("name", BUILT_INS)
def test_finite_loss_and_gradient_at_log_ratio_100(name, log_ratio, advantage):
    """A token whose log(pi/pi_old) is +-100 (pi_old ~0: an engine mismatch, a stale behaviour
    policy) gives a finite loss, gradient and metrics in float32, the trainer's precision
    (exp(100) overflows it): the log ratio is clamped to +-LOG_RATIO_BOUND before exp, and the
    clamped token's own gradient is 0. Row 1 holds that token alone, so gspo's sequence ratio
    is the token's."""
    from megatron_rl.policy_losses import LOG_RATIO_BOUND

    lp0 = torch.tensor([[-1.0, -1.2, -0.9], [-0.5, -3.0, -3.0]])
    old = lp0 - torch.tensor([[log_ratio, 0.1, -0.1], [log_ratio, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    cfg = _cfg(name, aggregation="seq-mean-token-mean")
    for adv in (torch.full((2,), advantage), torch.full((2, 3), advantage) * mask):
        if name == "gspo" and adv.dim() == 2:
            continue  # one advantage per sequence
        lp = lp0.clone().requires_grad_()
        loss, metrics = policy_loss(lp, old, adv, mask, cfg, num_global_seqs=2.0)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
        assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
        assert metrics["ratio_max" if log_ratio > 0 else "ratio_min"].item() == pytest.approx(
            math.exp(math.copysign(LOG_RATIO_BOUND, log_ratio)), rel=1e-5)
        if name not in ("gspo", "gspo-token", "cispo"):  # the token's own ratio r_t is bounded
            assert grad[1, 0] == 0  # where the clamp binds, the token has no gradient


def test_the_clamp_changes_nothing_below_the_bound():
    """Log ratios within +-LOG_RATIO_BOUND: the losses' values and gradients are those of the
    unclamped formulas (checked against the direct float64 computation at log ratio +-19.9)."""
    from megatron_rl.policy_losses import LOG_RATIO_BOUND

    old = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    x = LOG_RATIO_BOUND - 0.1
    for name in ("ppo-clip", "sapo", "cispo"):
        cfg = _cfg(name)
        for adv in (1.0, -1.0):
            lp = torch.tensor([[x, -x]], dtype=F64, requires_grad=True)
            per_token, _ = policy_loss_per_token(lp, old, torch.tensor([adv], dtype=F64),
                                                 mask, cfg)
            (grad,) = torch.autograd.grad(per_token.sum(), lp)
            lp_ref = torch.tensor([[x, -x]], dtype=F64, requires_grad=True)
            expected = torch.stack([_naive_token_loss(name, lp_ref[0, t], old[0, t], adv, cfg,
                                                      []) for t in range(2)])
            (grad_ref,) = torch.autograd.grad(expected.sum(), lp_ref)
            torch.testing.assert_close(per_token[0].detach(), expected.detach(), rtol=1e-12,
                                       atol=0)
            torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=0)


def test_gspo_token_seq_clip_fraction_with_per_token_advantages():
    """gspo-token with per-token advantages (reward-to-go: 0 at the prompt positions, which
    come first in a row): a sequence counts as clipped where its ratio s lies outside the clip
    range on the side its tokens' advantages push (the sign of their sum over the response);
    with one advantage per sequence, broadcast to its tokens, the count is gspo's."""
    cfg = _cfg("gspo-token", clip_low=0.1, clip_high=0.1)
    old = torch.zeros(4, 5, dtype=F64)
    mask = torch.tensor([[0, 0, 1, 1, 1]] * 4, dtype=F64)  # two prompt positions, 3 tokens
    # s = e^0.3 > 1.1 for rows 0-2, s = e^-0.3 < 0.9 for row 3
    lp = torch.tensor([[0.0, 0.0, 0.3, 0.3, 0.3]] * 3 + [[0.0, 0.0, -0.3, -0.3, -0.3]],
                      dtype=F64) * mask
    adv = torch.tensor([[0, 0, 1.0, 0.8, 0.5],     # pushes s up, above the range: clipped
                        [0, 0, -1.0, -0.8, -0.5],  # pushes s down, s above: not clipped
                        [0, 0, 1.0, 1.0, -3.0],    # sum -1: pushes down, s above: not clipped
                        [0, 0, -0.2, -0.2, 0.1]],  # sum -0.3: pushes down, s below: clipped
                       dtype=F64)
    _, metrics = policy_loss_per_token(lp, old, adv, mask, cfg)
    assert metrics["seq_clip_fraction"].item() == pytest.approx(2 / 4)

    logprobs, old, mask, seq_adv = _batch(seed=4, spread=0.1)
    cfg = _cfg("gspo", clip_low=0.02, clip_high=0.02)
    _, by_seq = policy_loss_per_token(logprobs, old, seq_adv, mask, cfg)
    cfg.policy_loss = "gspo-token"
    _, by_token = policy_loss_per_token(logprobs, old, seq_adv[:, None] * mask, mask, cfg)
    assert 0 < by_seq["seq_clip_fraction"].item() < 1
    assert by_token["seq_clip_fraction"].item() == pytest.approx(
        by_seq["seq_clip_fraction"].item(), abs=1e-15)
