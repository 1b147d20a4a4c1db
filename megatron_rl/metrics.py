"""The RL step's logged metrics, each the value over the whole global batch (all data-parallel
ranks), whatever the layout.

Every function here is collective over the data-parallel group `group` (None: no reduction) and
takes this rank's share: sums and counts are all-reduced on the device in one call, extremes
with MAX/MIN, and the few per-rank summaries that are not sums (reward-error counts keyed by
reason, log-prob mismatch statistics) are exchanged as small objects and combined.
"""

from __future__ import annotations

import collections
import math

import torch
import torch.distributed as dist

from megatron_rl.correction import CorrectionStats
from megatron_rl.parallel import all_reduce
from megatron_rl.rollout.mismatch import LogprobMismatch, combine, logprob_mismatch

LOSS_REDUCTIONS = ("sum", "token_mean", "max", "min", "weight")
"""How a loss metric becomes the global batch's value (loss_metrics): "sum" = a share of a
global quantity (already divided by the global counts: pg_loss, the loss, loss.SEQUENCE_SHARES),
summed over microbatches and ranks and divided by the optimizer steps; "token_mean" = a mean
over the microbatch's loss tokens, weighted by num_tokens; "max" / "min" = the extreme over
microbatches, ranks and optimizer steps; "weight" = num_tokens itself, the token means' weight,
not logged."""

LOSS_METRICS: dict[str, str] = {
    # loss.policy_loss and update.make_rl_loss_fn
    "loss": "sum", "pg_loss": "sum", "num_tokens": "weight", "entropy": "token_mean",
    "kl_k1": "token_mean", "kl_k3": "token_mean", "kl_exact": "token_mean",
    # the built-in policy losses (policy_losses.py)
    "clip_fraction": "token_mean", "dual_clip_fraction": "token_mean",
    "ratio_mean": "token_mean", "ratio_max": "max", "ratio_min": "min",
    "seq_clip_fraction": "sum", "seq_ratio_mean": "sum",
    "seq_ratio_max": "max", "seq_ratio_min": "min",
}
"""Every metric the loss function returns, by name, with its reduction (LOSS_REDUCTIONS). A
name not here (a --policy-loss `module:function`'s own metric) is logged as a token mean:
policy_losses.py's contract makes a loss's metrics scalars over its rows' masked tokens; a
loss whose metric reduces otherwise names it with register_loss_metric."""


def register_loss_metric(name: str, reduction: str) -> None:
    """Log the loss function's metric `name` with `reduction` (a LOSS_REDUCTIONS entry), e.g.
    from the module of a --policy-loss `module:function`. Raises ValueError for an unknown
    reduction or a name registered with another one."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss metric {name!r}: reduction {reduction!r}; valid: "
                         f"{', '.join(LOSS_REDUCTIONS)}")
    if LOSS_METRICS.get(name, reduction) != reduction:
        raise ValueError(f"loss metric {name!r} is registered with reduction "
                         f"{LOSS_METRICS[name]!r}, not {reduction!r}")
    LOSS_METRICS[name] = reduction


def batch_metrics(rewards: torch.Tensor, response_lengths: list[int], finish_reasons: list[str],
                  group=None, *, policy_tokens: torch.Tensor | float | None = None
                  ) -> dict[str, float]:
    """Per trajectory over the global batch: reward/mean, reward/accuracy (reward >= 1),
    response/truncated_fraction (finish reason "length") and the response's tokens:

        response/length_mean         all response tokens, the policy's and the environment's
                                     (a multi-turn rollout's tool outputs, user turns)
        response/policy_tokens_mean  the tokens the policy sampled (response_mask 1: trained on)
        response/env_tokens_mean     the others (response_mask 0): length_mean - policy_tokens_mean

    `policy_tokens`: this rank's policy tokens in all (the batch's loss_mask summed); None: every
    response token is the policy's (a single-turn batch)."""
    length = float(sum(response_lengths))
    dev = rewards.device
    policy = (torch.tensor(length, device=dev) if policy_tokens is None
              else torch.as_tensor(policy_tokens, device=dev).float())
    sums = torch.stack([rewards.sum(), (rewards >= 1.0).sum(),
                        torch.tensor(length, device=dev), policy.reshape(()),
                        torch.tensor(float(sum(f == "length" for f in finish_reasons)),
                                     device=dev),
                        torch.tensor(float(rewards.numel()), device=dev)]).double()
    total, correct, length, policy_sum, truncated, n = all_reduce(sums, group).tolist()
    return {"reward/mean": total / n, "reward/accuracy": correct / n,
            "response/length_mean": length / n, "response/policy_tokens_mean": policy_sum / n,
            "response/env_tokens_mean": (length - policy_sum) / n,
            "response/truncated_fraction": truncated / n}


def weighted_mean_tensor(results: list[dict], keys: list[str]) -> torch.Tensor:
    """[len(keys) + 1]: sum_m num_tokens_m * value_m for each key, then sum_m num_tokens_m, over
    this rank's microbatches (the loss function's metrics), on their device."""
    w = torch.stack([r["num_tokens"].float() for r in results])[:, None]              # [m, 1]
    if not keys:
        return w.sum().reshape(1).double()
    vals = torch.stack([torch.stack([r[k].float() for k in keys]) for r in results])  # [m, k]
    return torch.cat([(vals * w).sum(0), w.sum().reshape(1)]).double()


def loss_metrics(results: list[dict], group=None, num_steps: int = 1) -> dict[str, float]:
    """Every metric of the loss function's (results: one dict per microbatch, the keys of the
    first) over all microbatches of all data-parallel ranks, independent of how the batch was
    split into microbatches, by its LOSS_METRICS reduction: the "sum" ones (each microbatch's
    share of its optimizer step's value, already normalised by global counts) summed and
    divided by the `num_steps` optimizer steps that `results` span; token-weighted means;
    maxima and minima over every microbatch and step. One SUM and (with extremes) one MAX
    all-reduce. Ranks without results (earlier pipeline stages) return {}; all ranks of one
    data-parallel group are on the same stage, so they agree on taking part."""
    if not results:
        return {}
    kind = {k: LOSS_METRICS.get(k, "token_mean") for k in results[0]}
    added = [k for k, r in kind.items() if r == "sum"]
    meaned = [k for k, r in kind.items() if r == "token_mean"]
    maxed = [k for k, r in kind.items() if r == "max"]
    minned = [k for k, r in kind.items() if r == "min"]
    totals = torch.stack([torch.stack([r[k].float() for r in results]).sum() for k in added]
                         ).double() if added else torch.zeros(0, dtype=torch.float64)
    mean_part = weighted_mean_tensor(results, meaned)
    reduced = all_reduce(torch.cat([totals.to(mean_part.device), mean_part]), group).tolist()
    out = {k: v / num_steps for k, v in zip(added, reduced[:len(added)])}
    *sums, weight = reduced[len(added):]
    out.update({k: v / max(weight, 1e-9) for k, v in zip(meaned, sums)})
    if maxed or minned:  # min x = -max(-x): both in one MAX all-reduce
        ext = torch.stack([torch.stack([r[k].float() for r in results]).max() for k in maxed]
                          + [-torch.stack([r[k].float() for r in results]).min()
                             for k in minned]).double()
        high = all_reduce(ext, group, op=dist.ReduceOp.MAX).tolist()
        # an extreme over no loss token anywhere is -inf: left out of the log, not logged as
        # an infinity (metrics.jsonl stays strict JSON)
        out.update((k, v) for k, v in zip(maxed, high[:len(maxed)]) if math.isfinite(v))
        out.update((k, -v) for k, v in zip(minned, high[len(maxed):]) if math.isfinite(v))
    return out


def token_mean_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[2]: (sum of `values` over response tokens, token count), on their device."""
    return torch.stack([(values * mask).sum(), mask.sum()]).double()


def token_mean(values: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """Mean of a per-token quantity [B, T] over the response tokens of the global batch."""
    total, n = all_reduce(token_mean_sums(values, mask), group).tolist()
    return total / max(n, 1.0)


def forward_kl(ref_lp: torch.Tensor, old_lp: torch.Tensor, mask: torch.Tensor,
               group=None) -> float:
    """Forward KL(pi_ref || pi_theta) per response token, estimated on the policy's samples:
    E[r log r] with r = pi_ref / pi_theta."""
    lr_ = (ref_lp - old_lp) * mask
    return token_mean(lr_.exp() * lr_, mask, group)


def _gather_objects(obj, group) -> list:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def count_metrics(counts: dict[str, float], prefix: str, group=None) -> dict[str, float]:
    """Counts keyed by name (e.g. reward errors by reason; keys may differ between ranks),
    summed over ranks."""
    total: collections.Counter = collections.Counter()
    for part in _gather_objects(dict(counts), group):
        total.update(part)
    return {f"{prefix}{k}": float(v) for k, v in sorted(total.items())}


def correction_metrics(stats: CorrectionStats, group=None) -> dict[str, float]:
    """rollout_corr/* (correction.CorrectionStats.as_metrics) over the global batch."""
    sums = all_reduce(stats.sums, group).tolist()
    raw_max = float(all_reduce(stats.raw_max, group, op=dist.ReduceOp.MAX))
    raw_min = float(all_reduce(stats.raw_min, group, op=dist.ReduceOp.MIN))
    return CorrectionStats.as_metrics(sums, raw_max, raw_min)


def routing_metrics(own: torch.Tensor, engine: torch.Tensor, seq_lengths: list[int],
                    group=None) -> dict[str, float]:
    """routing/*: how often the trainer's routers, computing their own top-k, would have sent a
    rollout token to other experts than the engine did: own [B, L-1, M, k] (the recompute's,
    in the batch's layout), engine [B, L, M, k] (the batch's routed_experts), over each
    sequence's forwarded tokens; per token and MoE layer, and per token in any layer."""
    from megatron_rl.models.routing import disagreement

    n = own.shape[1]
    valid = torch.arange(n, device=own.device)[None, :] < torch.tensor(
        seq_lengths, device=own.device)[:, None] - 1
    s = all_reduce(disagreement(own, engine[:, :n].to(own.device), valid), group).tolist()
    return {"routing/differ_token_layers": s[0] / max(s[1], 1.0),
            "routing/differ_tokens": s[2] / max(s[3], 1.0)}


def mismatch_metrics(rollout_lp: torch.Tensor, lp: torch.Tensor, mask: torch.Tensor,
                     group=None) -> dict[str, float]:
    """Train-vs-rollout log-prob mismatch (mismatch/*) over the global batch."""
    parts: list[LogprobMismatch] = _gather_objects(logprob_mismatch(rollout_lp, lp, mask), group)
    return combine(parts).as_dict()
