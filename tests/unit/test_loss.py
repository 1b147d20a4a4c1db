"""Policy loss (PPO-clip; gspo and cispo where layouts are compared), KL placement in the loss,
advantages with the KL reward, aggregation invariance."""
import math

import pytest
import torch

from megatron_rl.kl import KLConfig, k1
from megatron_rl.loss import (AGGREGATIONS, SEQUENCE_SHARES, LossConfig, aggregate_loss,
                              build_advantages, compute_rewards_with_kl, policy_loss)

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def _batch(seed=0, batch=8, seq_len=6):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, seq_len, generator=gen, dtype=F64) * 2
    old = logprobs + 0.4 * torch.randn(batch, seq_len, generator=gen, dtype=F64)
    ref = logprobs + 0.5 * torch.randn(batch, seq_len, generator=gen, dtype=F64)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen)
    mask = (torch.arange(seq_len) < lengths[:, None]).to(F64)
    rewards = torch.randint(0, 2, (batch,), generator=gen).to(F64)
    return logprobs, old, ref, mask, rewards


def _global_normalizers(mask):
    return dict(num_global_tokens=mask.sum().item(), num_global_seqs=mask.shape[0])


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("kl", [KLConfig("k3", "reward+loss", coef=0.1),
                                KLConfig("k1", "reward", coef=0.1, reward_to_go=True,
                                         off_policy_correction="seq-is")])
@pytest.mark.parametrize("policy_loss_name", ["ppo-clip", "gspo", "cispo"])
def test_microbatch_losses_sum_to_full_batch(aggregation, kl, policy_loss_name):
    """Uneven microbatches / DP shards with the global normalizers give the full batch's loss,
    gradient and sequence-level metric shares, for the token-level and the sequence-level
    policy losses."""
    if policy_loss_name == "gspo" and kl.reward_to_go:
        policy_loss_name = "gspo-token"  # per-token advantages
    logprobs, old, ref, mask, rewards = _batch()
    clip = (0.02, 0.03) if "gspo" in policy_loss_name else (0.2, 0.28)
    cfg = LossConfig(clip_low=clip[0], clip_high=clip[1], aggregation=aggregation, kl=kl,
                     policy_loss=policy_loss_name)
    advantages = build_advantages(rewards, logprobs, ref, mask, cfg, group_size=4)
    norm = _global_normalizers(mask)

    full_lp = logprobs.clone().requires_grad_()
    full, metrics = policy_loss(full_lp, old, advantages, mask, cfg, ref_logprobs=ref, **norm)
    full.backward()
    assert 0 < metrics["clip_fraction"].item() < 1  # the off-policy ratios exercise clipping

    shard_lp = logprobs.clone().requires_grad_()
    total = 0.0
    shares: dict = {}
    for rows in ([0, 1, 2], [3], [4, 5, 6, 7]):  # uneven microbatches / DP shards
        loss, m = policy_loss(shard_lp[rows], old[rows], advantages[rows], mask[rows], cfg,
                              ref_logprobs=ref[rows], **norm)
        loss.backward()
        total = total + loss.detach()
        for k in SEQUENCE_SHARES:
            if k in m:
                shares[k] = shares.get(k, 0.0) + m[k].item()
    assert abs(total.item() - full.item()) < 1e-13
    assert torch.allclose(shard_lp.grad, full_lp.grad, atol=1e-14, rtol=0)
    assert full_lp.grad.abs().sum() > 0
    assert bool(shares) == ("gspo" in policy_loss_name)
    for k, v in shares.items():
        assert v == pytest.approx(metrics[k].item(), abs=1e-14)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("policy_loss_name", ["ppo-clip", "gspo"])
def test_rows_without_loss_tokens_are_no_sequences(aggregation, policy_loss_name):
    """Rows without loss tokens (overlong-filtered responses, failed episodes) change neither a
    seq-mean loss, nor its gradient, nor the sequence metrics: the batch with three such rows
    added, split into uneven shards (one of them holding only an empty row), with
    num_global_seqs the sum of num_sequences over the shards, gives the batch's own values."""
    import megatron_rl.loss as loss_module

    logprobs, old, ref, mask, rewards = _batch()
    clip = (0.02, 0.03) if policy_loss_name == "gspo" else (0.2, 0.28)
    cfg = LossConfig(clip_low=clip[0], clip_high=clip[1], aggregation=aggregation,
                     kl=KLConfig("k3", "loss", coef=0.1), policy_loss=policy_loss_name)
    advantages = build_advantages(rewards, logprobs, ref, mask, cfg, group_size=4)
    lp = logprobs.clone().requires_grad_()
    want, want_m = policy_loss(lp, old, advantages, mask, cfg, ref_logprobs=ref,
                               num_global_seqs=mask.shape[0])
    (want_grad,) = torch.autograd.grad(want, lp)

    gen = torch.Generator().manual_seed(1)
    empty = [0, 4, 10]  # rows of the larger batch without a loss token
    keep = [i for i in range(11) if i not in empty]

    def with_empty_rows(x, fill):
        """x's rows at `keep`, fill's (3 rows) at `empty`."""
        out = torch.empty((11, *x.shape[1:]), dtype=x.dtype)
        out[keep], out[empty] = x, fill
        return out

    noise = lambda: -torch.rand(3, mask.shape[1], generator=gen, dtype=F64)  # noqa: E731
    big_lp, big_old = with_empty_rows(logprobs, noise()), with_empty_rows(old, noise())
    big_ref = with_empty_rows(ref, noise())
    big_mask = with_empty_rows(mask, torch.zeros(3, mask.shape[1], dtype=F64))
    big_adv = with_empty_rows(advantages, torch.tensor([1.5, -2.0, 0.7], dtype=F64))
    shards = ([0, 1, 2], [3], [4], [5, 6, 7, 8, 9, 10])  # [4]: a shard of one empty row
    num_seqs = sum(loss_module.num_sequences(big_mask[rows]).item() for rows in shards)
    assert num_seqs == mask.shape[0]

    big = big_lp.clone().requires_grad_()
    total, shares, extremes = torch.zeros((), dtype=F64), {}, {}
    for rows in shards:
        loss, m = policy_loss(big[rows], big_old[rows], big_adv[rows], big_mask[rows], cfg,
                              ref_logprobs=big_ref[rows], num_global_seqs=num_seqs)
        loss.backward()
        total = total + loss.detach()
        for k in SEQUENCE_SHARES:
            if k in m:
                shares[k] = shares.get(k, 0.0) + m[k].item()
        for k, pick in (("seq_ratio_max", max), ("seq_ratio_min", min)):
            if k in m:
                extremes[k] = pick(extremes.get(k, m[k].item()), m[k].item())
    assert total.item() == pytest.approx(want.item(), abs=1e-13)
    torch.testing.assert_close(big.grad[keep], want_grad, rtol=0, atol=1e-14)
    assert big.grad[empty].abs().sum() == 0
    assert bool(shares) == bool(extremes) == (policy_loss_name == "gspo")
    for k, v in {**shares, **extremes}.items():
        assert v == pytest.approx(want_m[k].item(), abs=1e-14), k


def test_aggregation_values_by_hand():
    per_token = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    assert aggregate_loss(per_token, mask, "token-sum-over-batch-tokens", num_global_tokens=10).item() \
        == pytest.approx(18 / 10)
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean", num_global_seqs=4).item() \
        == pytest.approx((1.5 + 5.0) / 4)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum", num_global_seqs=4).item() \
        == pytest.approx(18 / 4)
    with pytest.raises(ValueError, match="num_global_tokens"):
        aggregate_loss(per_token, mask, "token-mean")
    with pytest.raises(ValueError, match=r"seq-mean-token-mean.*seq-mean-token-sum.*token-mean"
                                         r".*token-sum-over-batch-tokens"):
        aggregate_loss(per_token, mask, "sum")
    from megatron_rl.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.hf_checkpoint, cfg.data.train_data = "m", ["d.jsonl"]
    cfg.algorithm.loss = LossConfig(aggregation="mean")  # checked once, by TrainConfig.validate
    with pytest.raises(ValueError, match="--loss-aggregation 'mean'; valid: .*token-sum-over-"):
        cfg.validate()


def test_ppo_clip_by_hand():
    # ratios 1.5, 0.5, 0.5, 1.1 with advantages +1, +1, -1, -1; clip range [0.8, 1.28].
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logprobs = torch.log(t([[1.5, 0.5, 0.5, 1.1]])).requires_grad_()
    advantages = t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=F64)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, kl=KLConfig(placement="none"))
    loss, metrics = policy_loss(logprobs, old, advantages, mask, cfg, num_global_tokens=4)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1) / 4, abs=1e-14)
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio where unclipped, 0 where the clipped branch is taken.
    assert torch.allclose(logprobs.grad, t([[0.0, -0.5, 0.0, 1.1]]) / 4, atol=1e-14)
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())


def test_reward_placement_has_no_pathwise_gradient():
    logprobs, _, ref, mask, rewards = _batch(seed=1)
    lp = logprobs.clone().requires_grad_()
    cfg = LossConfig(kl=KLConfig("k3", "reward", coef=0.5))
    advantages = build_advantages(rewards, lp, ref, mask, cfg, group_size=4)
    assert not advantages.requires_grad  # the KL reaches the loss only through detached advantages
    norm = _global_normalizers(mask)
    loss, _ = policy_loss(lp, lp.detach(), advantages, mask, cfg, ref_logprobs=ref, **norm)
    (grad,) = torch.autograd.grad(loss, lp)
    # At ratio == 1 the gradient is -A m / N whatever ref_logprobs is.
    assert torch.allclose(grad, -advantages[:, None] * mask / norm["num_global_tokens"], atol=1e-15)
    other_ref = ref + 3.0
    loss2, _ = policy_loss(lp, lp.detach(), advantages, mask, cfg, ref_logprobs=other_ref, **norm)
    (grad2,) = torch.autograd.grad(loss2, lp)
    assert torch.equal(grad, grad2)
    # The loss placement, in contrast, differentiates the estimator.
    cfg_loss = LossConfig(kl=KLConfig("k3", "loss", coef=0.5))
    loss3, _ = policy_loss(lp, lp.detach(), advantages, mask, cfg_loss, ref_logprobs=ref, **norm)
    (grad3,) = torch.autograd.grad(loss3, lp)
    expected = grad + 0.5 * (1 - torch.exp(ref - logprobs)) * mask / norm["num_global_tokens"]
    assert torch.allclose(grad3, expected, atol=1e-14)


def test_rewards_with_kl_and_rloo_by_hand():
    logprobs = t([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0], [-3.0, -0.1]])
    ref = t([[-1.5, -1.0], [-0.5, -1.0], [-2.0, -1.0], [-1.0, -0.1]])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1]])
    rewards = t([1.0, 0.0, 1.0, 0.0])
    kl_cfg = KLConfig("k1", "reward", coef=0.1)
    kl_sum = (k1(logprobs, ref) * mask).sum(-1)  # [-0.5, 0, 1, -2]
    returns = compute_rewards_with_kl(rewards, logprobs, ref, mask, kl_cfg)
    assert torch.allclose(returns, t([1.05, 0.0, 0.9, 0.2]), atol=1e-14)
    assert torch.allclose(returns, rewards - 0.1 * kl_sum, atol=1e-15)
    adv = build_advantages(rewards, logprobs, ref, mask, LossConfig(kl=kl_cfg), group_size=2)
    assert torch.allclose(adv, t([1.05, -1.05, 0.7, -0.7]), atol=1e-14)
    # seq-is leaves the KL out of the advantage (the loss adds its weighted surrogate).
    seq_is = KLConfig("k1", "reward", coef=0.1, off_policy_correction="seq-is")
    assert torch.equal(compute_rewards_with_kl(rewards, logprobs, ref, mask, seq_is), rewards)
    # Reward-to-go: (R - beta sum_{s>=t} K_s) per valid token.
    rtg = compute_rewards_with_kl(rewards, logprobs, ref, mask,
                                  KLConfig("k1", "reward", coef=0.1, reward_to_go=True))
    assert torch.allclose(rtg[0], t([1.05, 1.1]), atol=1e-14)
    assert torch.allclose(rtg[1], t([0.0, 0.0]), atol=1e-14)


def test_kl_needs_ref_logprobs():
    logprobs, old, _, mask, _ = _batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, torch.zeros(8, dtype=F64), mask,
                    LossConfig(kl=KLConfig("k3", "loss")), num_global_tokens=mask.sum())
    # The reward placement needs no ref_logprobs in the loss: the KL is in the advantages.
    loss, metrics = policy_loss(logprobs, old, torch.zeros(8, dtype=F64), mask, LossConfig(),
                                num_global_tokens=mask.sum())
    assert loss.item() == 0.0 and "kl_k1" not in metrics


def test_loss_config_validation(tmp_path):
    from megatron_rl.config import parse_config

    path = tmp_path / "cfg.yaml"  # YAML values bypass argparse's choices
    path.write_text("advantage_estimator: gae\n")
    with pytest.raises(ValueError, match="--advantage-estimator 'gae'; valid: .*rloo"):
        parse_config(["--config", str(path), "--hf-checkpoint", "m", "--train-data", "d"])
    with pytest.raises(ValueError, match="--clip-low"):
        LossConfig(clip_low=-0.1).validate()
    assert LossConfig(clip_low=1.0, clip_high=math.inf).clip_high == math.inf
