"""The policy-gradient losses, by --policy-loss name: one signature, the KL terms and the rollout
correction composed around them in one place (loss.policy_loss_per_token), not inside each.

The signature every policy loss has:

    def fn(logprobs, old_logprobs, advantages, loss_mask, cfg) -> (pg_per_token, metrics)

    logprobs      [B, T] log pi_theta of the sampled tokens (current policy, with grad)
    old_logprobs  [B, T] log pi_old (the behaviour policy the ratio divides by)
    advantages    [B, 1] (one per sequence) or [B, T] (per token), detached
    loss_mask     [B, T] 1 on the policy's tokens, 0 on padding, prompts and environment tokens
    cfg           loss.LossConfig (clip ranges, temperatures, ...)
    pg_per_token  [B, T] the loss of each token, not yet masked or normalised (loss.aggregate_loss
                  does both); its gradient w.r.t. logprobs is the policy gradient
    metrics       detached scalars over the rows' masked tokens: clip_fraction, ratio_mean,
                  ratio_max, ratio_min; sequence-level losses add seq_clip_fraction and
                  seq_ratio_mean (means over the rows that hold a loss token), seq_ratio_max,
                  seq_ratio_min. Each name has its reduction across microbatches and ranks in
                  megatron_rl.metrics.LOSS_METRICS (a new one: metrics.register_loss_metric)

Each row is one sequence, also under sequence packing (the trainer's loss function unpacks to
per-sequence rows, packing.Microbatch.to_rows), so a sequence-level quantity is taken over the
row's masked tokens; padding (mask 0) never changes a sequence's loss. Notation below: r_t =
pi_theta(y_t)/pi_old(y_t) = exp(log_ratio_t), log_ratio_t = clamp(logprobs_t - old_logprobs_t,
-LOG_RATIO_BOUND, LOG_RATIO_BOUND) (log_ratio: every built-in takes its ratio from there), A the
advantage, sg[.] the stop-gradient, eps_low / eps_high = --clip-low / --clip-high, clip(x) = clamp(x, 1 - eps_low,
1 + eps_high), s_t = grad log pi_theta(y_t | y_<t), n = the sequence's token count.

A loss by import path: --policy-loss `module:function` names a function with this signature
(resolve_policy_loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from megatron_rl.imports import import_callable

if TYPE_CHECKING:
    from megatron_rl.loss import LossConfig

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "LossConfig"],
                      tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""The built-in policy losses by --policy-loss name."""

SEQUENCE_LEVEL = ("gspo",)
"""Built-ins whose loss is a function of the whole sequence's ratio, so of one advantage per
sequence: they refuse per-token advantages (gspo-token takes them)."""


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: the function as the built-in policy loss `name`."""
    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} registered twice")
        POLICY_LOSSES[name] = fn
        return fn
    return add


def resolve_policy_loss(name: str) -> PolicyLoss:
    """The policy loss --policy-loss `name` names: a POLICY_LOSSES key, or `module:function`.
    Raises ValueError naming the flag when it is neither, or does not import."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    return import_callable(name, f"--policy-loss {name!r}", "policy loss", POLICY_LOSSES)


LOG_RATIO_BOUND = 20.0
"""|log(pi/pi_old)| is clamped to this before any exp (log_ratio)."""


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """[B, T] clamp((logprobs - old_logprobs) m, -LOG_RATIO_BOUND, LOG_RATIO_BOUND): the token
    log-ratio log r_t every built-in loss exponentiates (0 at masked positions).

    Why a clamp: exp overflows float32 above 88.7, and a loss that multiplies exp's gradient by
    0 (a clipped branch, SAPO's saturated gate) then makes 0 x inf = NaN, which the NaN guard
    turns into a skipped step; a token whose pi_old was ~0 (an engine mismatch, a stale
    behaviour policy) does that. Why 20: r = e^20 ~ 4.9e8 lies far beyond every clip range and
    gate (PPO's 1 + eps ~ 1.3, dual-clip's c ~ 3; SAPO's sigmoid(tau (r - 1)) is 1 in float32
    once tau (r - 1) > 18), so the clamp changes no value or gradient where every |log r_t| <
    20, and it keeps r, A r and their sums over a batch of millions of tokens (< 1e16)
    finite in float32. Where the clamp is active the token's gradient is 0 (d clamp/dx = 0): it
    drops out of the update like a clipped token, which is what the clip does anyway on the
    side its advantage pushes; on the other side (ppo-clip's -A r with A < 0 and r > e^20) the
    unclipped gradient -A r s_t would exceed 4.9e8 |A| per token, a step no optimizer
    survives. Below -20 (r < 2.1e-9) the ratio is already 0 next to 1 in float32 (1 - r == 1):
    the lower bound changes no clip decision and no gate."""
    return ((logprobs - old_logprobs) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _token_metrics(ratio, mask, clipped) -> dict[str, torch.Tensor]:
    """clip_fraction (share of the masked tokens where `clipped`), ratio mean/max/min over the
    masked tokens of the token ratio [B, T]."""
    with torch.no_grad():
        num_tokens = mask.sum().clamp(min=1)
        return {
            "clip_fraction": (clipped.to(mask.dtype) * mask).sum() / num_tokens,
            "ratio_mean": (ratio * mask).sum() / num_tokens,
            "ratio_max": ratio.masked_fill(mask == 0, float("-inf")).max(),
            "ratio_min": ratio.masked_fill(mask == 0, float("inf")).min(),
        }


@register_policy_loss("ppo-clip")
def ppo_clip(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """PPO's clipped surrogate with an asymmetric range (clip-higher: eps_high > eps_low):

        loss_t = max(-A r_t, -A clip(r_t))

    Gradient: -A r_t s_t where the unclipped branch is taken, 0 where the clip binds (r_t >
    1 + eps_high with A > 0, r_t < 1 - eps_low with A < 0). Metrics: clip_fraction = share of
    tokens whose clipped branch is the larger."""
    mask = loss_mask
    ratio = log_ratio(logprobs, old_logprobs, mask).exp()
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    return pg, _token_metrics(ratio, mask, pg_clipped > pg_unclipped)


@register_policy_loss("dual-clip")
def dual_clip(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): PPO-clip, and for A < 0 also a bound
    c = --clip-ratio-c > 1 on the loss, so that a token whose ratio has grown far (r_t > c)
    cannot dominate the batch:

        A >= 0: loss_t = max(-A r_t, -A clip(r_t))
        A <  0: loss_t = min(max(-A r_t, -A clip(r_t)), -A c)

    Gradient: PPO-clip's, and 0 for A < 0 where r_t > c. Metrics: PPO's clip_fraction and
    dual_clip_fraction = share of tokens (of all) where the bound -A c binds."""
    mask = loss_mask
    pg, metrics = ppo_clip(logprobs, old_logprobs, advantages, loss_mask, cfg)
    bound = -advantages * cfg.clip_ratio_c
    negative = (advantages < 0).expand_as(pg)
    dual = torch.where(negative, torch.minimum(pg, bound), pg)
    with torch.no_grad():
        binds = negative & (pg > bound)
        metrics["dual_clip_fraction"] = ((binds.to(mask.dtype) * mask).sum()
                                         / mask.sum().clamp(min=1))
    return dual, metrics


def _sequence_log_ratio(logprobs, old_logprobs, mask) -> torch.Tensor:
    """[B, 1] log s_i = (1/n) sum_t m_t log_ratio_t: the length-normalised log-ratio of each
    row's sequence (0 for a row without tokens), within +-LOG_RATIO_BOUND as its terms are."""
    return (log_ratio(logprobs, old_logprobs, mask).sum(-1, keepdim=True)
            / mask.sum(-1, keepdim=True).clamp(min=1))


def _sequence_metrics(metrics, seq_ratio, seq_clipped, mask) -> None:
    """seq_clip_fraction, seq_ratio_mean (means over the rows that hold a loss token: a row
    without any, an overlong-filtered response or a failed episode, is no sequence of the
    loss), seq_ratio_max and seq_ratio_min (-inf / +inf where no row holds one) of the [B, 1]
    sequence ratio."""
    with torch.no_grad():
        has = mask.sum(-1, keepdim=True) > 0
        num_seqs = has.sum().clamp(min=1)
        metrics["seq_clip_fraction"] = (seq_clipped & has).to(seq_ratio.dtype).sum() / num_seqs
        metrics["seq_ratio_mean"] = (seq_ratio * has).sum() / num_seqs
        metrics["seq_ratio_max"] = seq_ratio.masked_fill(~has, float("-inf")).max()
        metrics["seq_ratio_min"] = seq_ratio.masked_fill(~has, float("inf")).min()


@register_policy_loss("gspo")
def gspo(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the sequence's length-normalised ratio,
    clipped PPO-style per sequence (--clip-low / --clip-high act on s_i; the paper's ranges are
    of order 3e-4 / 4e-4):

        s_i = exp((1/n) sum_t (logprobs_t - old_logprobs_t)),
        loss_i = max(-A_i s_i, -A_i clip(s_i)),   every token of sequence i carries loss_i

    Gradient of loss_i: -A_i s_i (1/n) sum_t s_t, or 0 where the clip binds for the whole
    sequence. With seq-mean-token-mean aggregation the loss is the paper's (1/G) sum_i loss_i;
    with token aggregations sequence i weighs n times (the gradient is then n/N x the above).
    Needs one advantage per sequence (gspo-token takes per-token ones). Metrics: the token
    clip_fraction (tokens of clipped sequences) and ratio statistics of the token ratio r_t;
    seq_clip_fraction and seq_ratio_* of s_i."""
    if advantages.shape[-1] != 1:
        raise ValueError("--policy-loss gspo takes one advantage per sequence, got per-token "
                         "advantages (--kl-reward-to-go, or the exact KL in the reward): use "
                         "--policy-loss gspo-token")
    mask = loss_mask
    seq_ratio = _sequence_log_ratio(logprobs, old_logprobs, mask).exp()
    clipped = seq_ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_unclipped = -advantages * seq_ratio
    pg_clipped = -advantages * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    seq_clipped = pg_clipped > pg_unclipped
    with torch.no_grad():
        metrics = _token_metrics(log_ratio(logprobs, old_logprobs, mask).exp(), mask,
                                 seq_clipped.expand_as(mask))
    _sequence_metrics(metrics, seq_ratio.detach(), seq_clipped, mask)
    return pg.expand_as(logprobs), metrics


@register_policy_loss("gspo-token")
def gspo_token(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """GSPO-token (Zheng et al. 2025, eq. 13): each token's ratio has the sequence ratio's value
    and its own gradient,

        s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)],
        loss_t = max(-A_t s_{i,t}, -A_t clip(s_{i,t})),

    so per-token advantages A_t are allowed. Gradient: -A_t s_i s_t where not clipped (the
    clip decision is the sequence's, s_{i,t} = s_i in value). With one advantage per sequence
    its value and gradient equal gspo's under every aggregation. Metrics as gspo's; a sequence
    counts as clipped (seq_clip_fraction) where s_i lies outside the clip range on the side its
    tokens' advantages push it, by the sign of their sum over the response:

        seq_clipped_i = (s_i > 1 + eps_high and sum_t m_t A_t > 0)
                        or (s_i < 1 - eps_low and sum_t m_t A_t < 0),

    gspo's rule with one advantage per sequence (sum_t m_t A_t = n A_i)."""
    mask = loss_mask
    seq_log_ratio = _sequence_log_ratio(logprobs, old_logprobs, mask).detach()
    ratio = (logprobs - logprobs.detach() + seq_log_ratio).exp()
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)
    with torch.no_grad():
        metrics = _token_metrics(log_ratio(logprobs, old_logprobs, mask).exp(), mask,
                                 (pg_clipped > pg_unclipped).expand_as(mask))
        seq_ratio = seq_log_ratio.exp()
        bounded = seq_ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        push = (advantages * mask).sum(-1, keepdim=True)  # [B, 1]; prompt positions hold 0
    _sequence_metrics(metrics, seq_ratio, -push * bounded > -push * seq_ratio, mask)
    return pg, metrics


@register_policy_loss("cispo")
def cispo(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with the clipped importance weight as a
    detached coefficient, so no token loses its gradient to the clip:

        loss_t = -sg[clip(r_t)] A log pi_theta(y_t)

    Gradient: -clip(r_t) A s_t (at r_t = 1 PPO's). The value is not a ratio surrogate (it
    carries log pi, so pg_loss reads differently from ppo-clip's). MiniMax clip only above: set
    --clip-low 1 (lower bound 0) and tune --clip-high. Metrics: clip_fraction = share of tokens
    whose weight is clipped."""
    mask = loss_mask
    ratio = log_ratio(logprobs, old_logprobs, mask).exp()
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    pg = -advantages * weight * logprobs
    return pg, _token_metrics(ratio.detach(), mask, weight != ratio.detach())


@register_policy_loss("sapo")
def sapo(logprobs, old_logprobs, advantages, loss_mask, cfg):
    """SAPO (Gao et al. 2025, arXiv 2511.20347, eq. 5-6): a soft, temperature-gated trust
    region in place of the clip,

        f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = --sapo-tau-pos if A > 0 else --sapo-tau-neg,
        loss_t = -f(r_t) A

    Gradient: -4 sigma(1 - sigma) r_t A s_t with sigma = sigmoid(tau (r_t - 1)): at r_t = 1
    exactly PPO's -A s_t, decaying smoothly (faster for larger tau) as r_t leaves 1; 0 only
    where |log r_t| reaches LOG_RATIO_BOUND (log_ratio). The per-token tau follows the sign of
    each token's advantage (the paper's sequence-level sign when A is one per sequence).
    Metrics: clip_fraction = share of tokens whose ratio lies outside [1 - --clip-low, 1 +
    --clip-high] (a diagnostic: nothing is clipped).

    Aggregation: the paper's objective averages each sequence's token terms, then the
    sequences, (1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it: that is --loss-aggregation
    seq-mean-token-mean. megatron-rl keeps one default for every loss,
    token-sum-over-batch-tokens (each token weighs the same, so a long response weighs more),
    which is not the paper's; the default is not switched per loss because the aggregation
    decides which KL placements are unbiased (docs/results.md, "Policy losses and KL
    placements") and should not change under a user who only changes --policy-loss."""
    mask = loss_mask
    ratio = log_ratio(logprobs, old_logprobs, mask).exp()
    tau = torch.where(advantages > 0, ratio.new_tensor(cfg.sapo_tau_pos),
                      ratio.new_tensor(cfg.sapo_tau_neg))  # in the ratio's precision
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    pg = -gate * advantages
    with torch.no_grad():
        outside = (ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)
    return pg, _token_metrics(ratio.detach(), mask, outside)
