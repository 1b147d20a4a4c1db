"""The loss function's metrics on their way to the log (megatron_rl.metrics.loss_metrics):
every metric the trainer's loss function returns is registered with its reduction and logged;
the reductions (sums, token means, maxima, minima) on one rank. Across data-parallel ranks:
tests/distributed/test_metrics_reduction.py."""
import types

import pytest
import torch

from megatron_rl import metrics
from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig
from megatron_rl.policy_losses import POLICY_LOSSES
from megatron_rl.update import make_rl_loss_fn


def _loss_fn_metrics(cfg: LossConfig) -> dict:
    """The metrics of update.make_rl_loss_fn (the trainer's loss function) on one microbatch of
    3 rows, with stand-ins for the model's scoring and the microbatch layout."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, 5)
    mask = (torch.rand(shape, generator=gen) < 0.7).float()
    logprobs = -torch.rand(shape, generator=gen)
    scored = types.SimpleNamespace(logprobs=logprobs.clone().requires_grad_(),
                                   entropy=torch.rand(shape, generator=gen),
                                   exact_kl=torch.rand(shape, generator=gen))
    policy = types.SimpleNamespace(score=lambda out, targets, **kw: scored)
    layout = types.SimpleNamespace(targets=None, to_rows=lambda x: x)
    advantages = (torch.randn(shape, generator=gen) * mask if cfg.token_level_advantages
                  else torch.randn(3, generator=gen))
    mb = {"layout": layout, "loss_mask": mask, "advantages": advantages,
          "old_logprobs": logprobs + 0.3 * torch.randn(shape, generator=gen),
          "ref_logprobs": logprobs + 0.3 * torch.randn(shape, generator=gen)}
    loss_fn = make_rl_loss_fn(policy, cfg, num_global_tokens=mask.sum().item(),
                              num_global_seqs=3.0, reference=object())
    _, m = loss_fn(mb, out=None, ref_out=object())
    return m


@pytest.mark.parametrize("kl", [KLConfig("k3", "reward+loss", coef=0.1),
                                KLConfig("exact", "loss", coef=0.1)])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_metric_of_the_loss_function_is_registered_and_logged(name, kl):
    """Each built-in policy loss, with the K3 and the exact KL in the loss: every metric the
    trainer's loss function returns has a reduction in LOSS_METRICS, and loss_metrics logs
    each of them but num_tokens (the token means' weight)."""
    cfg = LossConfig(policy_loss=name, kl=kl)
    m = _loss_fn_metrics(cfg)
    assert {"ratio_max", "ratio_min", "loss", "pg_loss", "entropy"} <= set(m)
    unregistered = sorted(set(m) - set(metrics.LOSS_METRICS))
    assert not unregistered, f"register these in metrics.LOSS_METRICS: {unregistered}"
    assert set(metrics.LOSS_METRICS.values()) <= set(metrics.LOSS_REDUCTIONS)
    logged = metrics.loss_metrics([m, m])
    assert set(logged) == set(m) - {"num_tokens"}


def test_each_reduction_over_microbatches_and_steps():
    """Two optimizer steps of two microbatches each: "sum" metrics add up within a step and
    average over steps; token means weigh each microbatch by its tokens; ratio_max / ratio_min
    (and the sequence ratio's) are the extremes over every microbatch; a metric no registry
    names (a custom policy loss's) is logged as a token mean."""
    rows = [dict(pg_loss=0.5, ratio_mean=1.0, ratio_max=1.5, ratio_min=0.9, seq_ratio_max=1.1,
                 seq_ratio_min=0.95, my_metric=2.0, num_tokens=1.0),
            dict(pg_loss=0.25, ratio_mean=1.2, ratio_max=3.0, ratio_min=0.8, seq_ratio_max=1.3,
                 seq_ratio_min=0.97, my_metric=4.0, num_tokens=3.0),
            dict(pg_loss=1.0, ratio_mean=0.6, ratio_max=1.1, ratio_min=0.2, seq_ratio_max=1.0,
                 seq_ratio_min=0.99, my_metric=0.0, num_tokens=2.0),
            dict(pg_loss=0.25, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, seq_ratio_max=1.0,
                 seq_ratio_min=1.0, my_metric=1.0, num_tokens=2.0)]
    results = [{k: torch.tensor(v) for k, v in r.items()} for r in rows]
    out = metrics.loss_metrics(results, num_steps=2)
    assert out == pytest.approx({
        "pg_loss": (0.5 + 0.25 + 1.0 + 0.25) / 2,
        "ratio_mean": (1.0 * 1 + 1.2 * 3 + 0.6 * 2 + 1.0 * 2) / 8,
        "my_metric": (2.0 * 1 + 4.0 * 3 + 0.0 * 2 + 1.0 * 2) / 8,
        "ratio_max": 3.0, "ratio_min": 0.2, "seq_ratio_max": 1.3, "seq_ratio_min": 0.95})
    # a shard without loss tokens reports -inf / +inf extremes: they lose to any other's
    empty = dict(results[0], ratio_max=torch.tensor(float("-inf")),
                 ratio_min=torch.tensor(float("inf")), num_tokens=torch.tensor(0.0))
    out = metrics.loss_metrics([empty, results[1]])
    assert (out["ratio_max"], out["ratio_min"]) == pytest.approx((3.0, 0.8))
    # a step without any loss token: no extreme logged (never an infinity in metrics.jsonl)
    out = metrics.loss_metrics([empty])
    assert "ratio_max" not in out and "ratio_min" not in out and "pg_loss" in out


def test_register_loss_metric():
    """A custom policy loss names the reduction of its own metric; an unknown reduction or a
    second, different one for a registered name is an error."""
    metrics.register_loss_metric("test_only_peak", "max")
    try:
        results = [{"test_only_peak": torch.tensor(v), "num_tokens": torch.tensor(1.0)}
                   for v in (3.0, 7.0)]
        assert metrics.loss_metrics(results) == {"test_only_peak": 7.0}
        with pytest.raises(ValueError, match="registered with reduction 'max', not 'min'"):
            metrics.register_loss_metric("test_only_peak", "min")
        with pytest.raises(ValueError, match="reduction 'median'; valid: sum, token_mean"):
            metrics.register_loss_metric("test_only_other", "median")
    finally:
        del metrics.LOSS_METRICS["test_only_peak"]


def test_batch_metrics_count_policy_and_environment_tokens_apart():
    """A multi-turn batch (batch.pack_rollouts of trajectories with environment tokens between
    the policy's turns): response/policy_tokens_mean counts the tokens the policy sampled,
    response/env_tokens_mean the others, response/length_mean both; a single-turn batch (no
    policy_tokens given) has no environment tokens."""
    from megatron_rl.batch import Trajectory, pack_rollouts

    def episode(mask, reward):
        return Trajectory([1, 2], list(range(3, 3 + len(mask))), mask,
                          [-0.5 * m for m in mask], "stop", reward)

    # policy tokens 2+1, 4, 1+2+1, 3; environment tokens 3, 0, 1+2+1, 0
    batch = pack_rollouts([[episode([1, 1, 0, 0, 0, 1], 1.0), episode([1, 1, 1, 1], 0.0)],
                           [episode([0, 1, 0, 0, 1, 1, 0, 1], 1.0), episode([1, 1, 1], 0.0)]],
                          pad_token_id=0)
    m = metrics.batch_metrics(batch.rewards, batch.response_lengths, batch.finish_reasons,
                              policy_tokens=batch.loss_mask.sum())
    assert m["response/length_mean"] == 21 / 4
    assert m["response/policy_tokens_mean"] == 14 / 4
    assert m["response/env_tokens_mean"] == 7 / 4
    assert m["reward/mean"] == 0.5
    single = metrics.batch_metrics(batch.rewards, batch.response_lengths, batch.finish_reasons)
    assert single["response/policy_tokens_mean"] == 21 / 4
    assert single["response/env_tokens_mean"] == 0.0
