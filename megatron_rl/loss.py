"""The policy loss: a policy-gradient loss (--policy-loss) + KL terms + entropy bonus, and its
aggregation over tokens.

Pure PyTorch on per-token tensors ([B, T], see the glossary in megatron_rl/kl.py); parallel
information (global token and sequence counts) comes in as arguments. Three steps:

0. `shape_overlong` (optional): truncated responses out of the loss, DAPO's soft penalty on
   long ones in the reward.
1. `build_advantages`: task rewards minus the reward-side KL (stop-gradient, paper eq. 7-8),
   then the group baseline (RLOO by default) -> advantages [B] (or [B, T] with reward-to-go,
   the KL's or the turn rewards', --turn-credit to-go).
2. `policy_loss_per_token`: the policy-gradient loss of --policy-loss (policy_losses.py;
   default ppo-clip: ratio exp(logprobs - old_logprobs), asymmetric clip range
   [1 - clip_low, 1 + clip_high]) times the rollout correction's weights, plus the path-wise
   KL loss term (placement "loss"/"reward+loss"), under off-policy "seq-is" the
   importance-weighted reward-side KL surrogate, minus the entropy bonus -> per-token loss
   [B, T]. The one place these are composed.
3. `aggregate_loss`: the one place that normalizes. Every mode divides by a *global* normalizer
   passed in by the caller, so the losses of DP shards and PP microbatches add up to the loss of
   the full batch (and so do their gradients).
"""
from dataclasses import dataclass, field

import torch

from megatron_rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.kl import (KLConfig, k1, k3, kl_loss_term, kl_reward_is_surrogate,
                            kl_reward_penalty, kl_reward_to_go_penalty)
from megatron_rl.policy_losses import SEQUENCE_LEVEL, resolve_policy_loss


def _token_sum_over(per_token, loss_mask, num_global_tokens=None, num_global_seqs=None):
    """sum_{i,t} l_it m_it / num_global_tokens: every token of the global batch weighs the same."""
    if num_global_tokens is None:
        raise ValueError("this aggregation needs num_global_tokens (tokens in the global batch)")
    return (per_token * loss_mask).sum() / num_global_tokens


def num_sequences(loss_mask: torch.Tensor) -> torch.Tensor:
    """0-dim: the rows of loss_mask [B, T] that hold at least one loss token, the sequences a
    seq-mean aggregation averages over. A row without any (an overlong-filtered response, a
    failed episode, padding rows) is no sequence of the loss: it adds 0 to the numerator and
    must not count in num_global_seqs, which is the sum of this over every shard of the global
    batch (all microbatches of all data-parallel ranks)."""
    return (loss_mask.sum(-1) > 0).sum()


def _seq_mean_token_mean(per_token, loss_mask, num_global_tokens=None, num_global_seqs=None):
    """sum_i (sum_t l_it m_it / sum_t m_it) / num_global_seqs: each sequence weighs the same (a
    row without loss tokens adds 0)."""
    if num_global_seqs is None:
        raise ValueError("seq-mean-token-mean needs num_global_seqs (sequences in the global batch)")
    per_seq = (per_token * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)
    return per_seq.sum() / num_global_seqs


def _seq_mean_token_sum(per_token, loss_mask, num_global_tokens=None, num_global_seqs=None):
    """sum_{i,t} l_it m_it / num_global_seqs: the sequence-level objective (no length
    normalization; a row without loss tokens adds 0)."""
    if num_global_seqs is None:
        raise ValueError("seq-mean-token-sum needs num_global_seqs (sequences in the global batch)")
    return (per_token * loss_mask).sum() / num_global_seqs


# "token-sum-over-batch-tokens" (the paper's) and "token-mean" share the formula and differ in the
# normalizer the caller passes as num_global_tokens: the token count of the whole rollout batch
# (fixed across the PPO minibatches of one RL step) versus that of the current optimizer step's
# batch (all DP ranks and microbatches of that step). With one optimizer step per rollout batch
# they coincide.
TURN_CREDITS = ("sum", "to-go")
"""--turn-credit: how per-turn rewards enter the advantage (turn_rewards_to_go)."""

AGGREGATIONS = {
    "token-sum-over-batch-tokens": _token_sum_over,
    "token-mean": _token_sum_over,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def aggregate_loss(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, *,
                   num_global_tokens: float | None = None,
                   num_global_seqs: float | None = None) -> torch.Tensor:
    """Scalar loss from a per-token loss [B, T] of one shard (a microbatch on one DP rank).

    Summing this over all shards of a global batch gives exactly the full-batch value, because
    the normalizer is global: num_global_tokens = sum of loss_mask over the global batch,
    num_global_seqs = number of sequences with a loss token in the global batch (the sum of
    num_sequences over the shards). (Megatron's schedule divides by the number of microbatches
    and DP averages gradients; the caller undoes those factors.)
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](per_token, loss_mask.to(per_token.dtype),
                              num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs)


@dataclass
class LossConfig:
    """Policy-loss settings. clip_low / clip_high: PPO clip range [1 - clip_low, 1 + clip_high]
    (clip_high 0.28 is DAPO's clip-higher). aggregation: a key of AGGREGATIONS.
    advantage_estimator: a key of megatron_rl.advantages.ADVANTAGE_ESTIMATORS."""

    clip_low: float = field(default=0.2, metadata={"help": (
        "PPO clip below: the ratio pi/pi_old is clipped at 1 - clip_low (1: no lower clip)")})
    clip_high: float = field(default=0.2, metadata={"inf": True, "help": (
        "PPO clip above: the ratio is clipped at 1 + clip_high (0.28: DAPO's clip-higher; "
        "inf: no upper clip)")})
    aggregation: str = field(default="token-sum-over-batch-tokens", metadata={
        "flag": "loss_aggregation", "choices": sorted(AGGREGATIONS), "help": (
        "how token losses become the loss: token-sum-over-batch-tokens = their sum over the "
        "token count of the whole rollout batch (the paper's; the same for all its PPO "
        "minibatches); token-mean = over the token count of the optimizer step's minibatch; "
        "seq-mean-token-mean = the mean of each sequence's token mean; seq-mean-token-sum = "
        "the sum over the sequence count (no length normalisation); the seq-mean modes count "
        "only sequences with a loss token (not overlong-filtered ones). The first two "
        "coincide with one optimizer step per batch")})
    kl: KLConfig = field(default_factory=KLConfig, metadata={"prefix": "kl_"})  # --kl-*
    # --rollout-correction, --rollout-is-low/high: the engine-vs-trainer importance weight
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    advantage_estimator: str = field(default="rloo", metadata={
        "choices": sorted(ADVANTAGE_ESTIMATORS), "help": (
        "baseline within each prompt's group: rloo = the mean of the other responses' returns "
        "(unbiased); grpo = the group mean, then divided by the group's std; dr_grpo = the "
        "group mean (the last two include the response itself: gradient scaled by 1 - "
        "1/group_size); reinforce = no baseline")})

    turn_credit: str = field(default="sum", metadata={"choices": TURN_CREDITS, "help": (
        "how a trajectory's per-turn rewards (Trajectory.turn_rewards: an agent environment's "
        "reward for each policy turn) enter its advantage: sum = its reward, their sum, one "
        "return per sequence; to-go = each token's return holds the rewards of its turn and "
        "of the later turns (per-token advantages; the reward-side KL whole, or to go with "
        "--kl-reward-to-go; not with --policy-loss gspo). A trajectory without turn rewards "
        "has its reward on its last token, where both agree. Both are unbiased "
        "(docs/results.md, \"Per-turn rewards\")")})

    policy_loss: str = field(default="ppo-clip", metadata={"help": (
        "the policy-gradient loss (megatron_rl/policy_losses.py: each one's math): ppo-clip = "
        "PPO's clipped ratio surrogate; dual-clip = ppo-clip with the loss of a negative "
        "advantage bounded at --clip-ratio-c; gspo = GSPO's sequence ratio (geometric mean of "
        "the token ratios), clipped per sequence with --clip-low/--clip-high (GSPO's are of "
        "order 3e-4/4e-4), one advantage per sequence; gspo-token = the same with each token's "
        "gradient (per-token advantages allowed); cispo = the clipped ratio as a detached "
        "weight of -A log pi (MiniMax: --clip-low 1, no lower clip); sapo = a soft sigmoid "
        "gate in place of the clip (--sapo-tau-pos, --sapo-tau-neg; the paper's per-sequence "
        "mean is --loss-aggregation seq-mean-token-mean); or the import path "
        "`module:function` of a function with policy_losses.py's signature")})
    clip_ratio_c: float = field(default=3.0, metadata={"help": (
        "dual-clip only: for a negative advantage the token loss is at most -A x this "
        "(tokens with ratio above it get no gradient); > 1")})
    sapo_tau_pos: float = field(default=1.0, metadata={"help": (
        "sapo only: the gate's temperature for positive advantages (larger: the gradient "
        "decays faster as the ratio leaves 1); > 0")})
    sapo_tau_neg: float = field(default=1.05, metadata={"help": (
        "sapo only: the gate's temperature for negative advantages; > 0")})
    entropy_coef: float = field(default=0.0, metadata={"help": (
        "entropy bonus: coef x the policy's entropy at each trained token is subtracted from "
        "its loss, aggregated like the loss (0: none)")})
    overlong_filtering: bool = field(default=False, metadata={"help": (
        "drop responses that hit --max-new-tokens (finish reason \"length\") from the loss: "
        "their tokens get loss mask 0, which removes them from the policy loss, from every "
        "KL term (reward and loss side) and from the token count the loss is normalised by; "
        "their reward still enters the group baseline of the others")})
    overlong_buffer_len: int = field(default=0, metadata={"min": 0, "help": (
        "DAPO's soft overlong punishment: a response longer than --max-new-tokens - L gets "
        "-factor x (length - (--max-new-tokens - L)) / L added to its task reward (at most "
        "-factor, at --max-new-tokens), beside the KL penalty of the reward; 0: off. "
        "Single-turn rollouts only")})
    overlong_penalty_factor: float = field(default=1.0, metadata={"min": 0, "help": (
        "the soft overlong punishment's largest penalty (--overlong-buffer-len)")})

    @property
    def token_level_advantages(self) -> bool:
        """Whether build_advantages gives per-token advantages [B, T]: the reward-side KL as
        reward-to-go, the exact KL in the advantage (the later positions' KL per token), or the
        turn rewards to go."""
        return (self.kl.reward_to_go or (self.kl.exact and self.kl.reward_in_advantage)
                or self.turn_credit == "to-go")

    def validate(self) -> None:
        """The rules beyond each field's declared choices and minimum (which the trainer's
        TrainConfig.validate checks), the KL's and the rollout correction's included."""
        # clip_low = 1 and clip_high = inf disable clipping (ratios are positive).
        if not (0 <= self.clip_low <= 1) or self.clip_high < 0:
            raise ValueError(f"need 0 <= --clip-low <= 1 and --clip-high >= 0, got "
                             f"{self.clip_low}, {self.clip_high}")
        resolve_policy_loss(self.policy_loss)  # imports a path: a bad one fails here
        if not self.clip_ratio_c > 1:
            raise ValueError(f"--clip-ratio-c {self.clip_ratio_c}: must be > 1 (dual-clip's "
                             "bound on the ratio of a negative advantage)")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"--sapo-tau-pos {self.sapo_tau_pos}, --sapo-tau-neg "
                             f"{self.sapo_tau_neg}: both must be > 0")
        if self.policy_loss in SEQUENCE_LEVEL and self.token_level_advantages:
            cause = ("--kl-reward-to-go" if self.kl.reward_to_go
                     else "--turn-credit to-go" if self.turn_credit == "to-go"
                     else f"--kl-estimator {self.kl.estimator} in the reward")
            raise ValueError(f"--policy-loss {self.policy_loss} takes one advantage per "
                             f"sequence, but {cause} makes them per token: use --policy-loss "
                             f"{self.policy_loss}-token")
        self.kl.validate()
        self.rollout_correction.validate()


def compute_rewards_with_kl(rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                            loss_mask: torch.Tensor, kl_cfg: KLConfig,
                            token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """Returns with the reward-side KL folded in, before any baseline (paper eq. 7-8).

    rewards [B] (task reward per sequence); logprobs, ref_logprobs, loss_mask [B, T]. logprobs is
    the policy the KL regularizes (current on-policy; see kl_reward_is_surrogate off-policy).
    Output [B]: R - beta sum_t K_t; with kl_cfg.reward_to_go, [B, T]: (R - beta sum_{s>=t} K_s) m_t.
    "exact" (token_kl [B, T] = KL_t, see megatron_rl.kl): [B, T] (R - beta sum_{s>t} KL_s) m_t,
    the later positions only (kl_reward_to_go_penalty), with or without reward_to_go.
    Unchanged rewards when the KL is not in the advantage (placement without "reward", or
    off_policy_correction "seq-is", where the loss handles it). Always detached.
    """
    rewards = rewards.detach().to(logprobs.dtype)
    if kl_cfg.reward_to_go or (kl_cfg.exact and kl_cfg.reward_in_advantage):
        returns = rewards.unsqueeze(-1) * loss_mask
        if kl_cfg.reward_in_advantage:
            returns = returns - kl_reward_to_go_penalty(logprobs, ref_logprobs, loss_mask, kl_cfg,
                                                        token_kl)
        return returns
    if kl_cfg.reward_in_advantage:
        return rewards - kl_reward_penalty(logprobs, ref_logprobs, loss_mask, kl_cfg)
    return rewards


def turn_rewards_to_go(returns: torch.Tensor, rewards: torch.Tensor,
                       token_rewards: torch.Tensor | None, loss_mask: torch.Tensor
                       ) -> torch.Tensor:
    """--turn-credit to-go: `returns` ([B], or [B, T] per token, each holding the whole task
    reward R) with R replaced at each token t by the task reward to go,
        G_t = sum_{s >= t} token_rewards_s + (R - sum_s token_rewards_s),
    token_rewards [B, T] holding each turn's reward at its turn's last token
    (RolloutBatch.token_rewards; None: all zero). What the turn rewards do not account for
    (a trajectory without them, the overlong penalty added to R) is at the last token, where
    every token sees it. Returns [B, T], 0 off the loss_mask. docs/results.md, "Per-turn
    rewards": unbiased, as the sum is."""
    rewards = rewards.detach().to(loss_mask.dtype)
    per_token = returns if returns.dim() == 2 else returns.unsqueeze(-1) * loss_mask
    to_go = rewards.unsqueeze(-1).expand_as(loss_mask)
    if token_rewards is not None:
        token_rewards = token_rewards.to(loss_mask.dtype)
        later = token_rewards.flip(-1).cumsum(-1).flip(-1)
        to_go = later + (rewards - token_rewards.sum(-1)).unsqueeze(-1)
    return per_token + (to_go - rewards.unsqueeze(-1)) * loss_mask


def build_advantages(rewards, logprobs, ref_logprobs, loss_mask, cfg: LossConfig,
                     group_size: int, token_kl: torch.Tensor | None = None,
                     in_baseline: torch.Tensor | None = None,
                     token_rewards: torch.Tensor | None = None,
                     group_sizes: list[int] | None = None) -> torch.Tensor:
    """Advantages [B] (or [B, T] with reward-to-go, the exact KL in the reward or --turn-credit
    to-go) from task rewards [B] and per-token log-probs (token_kl [B, T]: KL_t for the "exact"
    estimator). Rows with `in_baseline` 0 (RolloutBatch.in_baseline) stay out of their group's
    baseline. token_rewards [B, T]: each turn's reward at its last token, for --turn-credit
    to-go (turn_rewards_to_go). group_sizes: the groups' own sizes (RolloutBatch.group_sizes;
    None: `group_size` each).

    The KL penalty enters the returns before the baseline (eq. 7-8), so with RLOO it is centred
    by the other samples' KL like any reward. Detached.
    """
    returns = compute_rewards_with_kl(rewards, logprobs, ref_logprobs, loss_mask, cfg.kl, token_kl)
    if cfg.turn_credit == "to-go":
        returns = turn_rewards_to_go(returns, rewards, token_rewards, loss_mask)
    mask = loss_mask if returns.dim() == 2 else None
    return compute_advantages(cfg.advantage_estimator, returns, group_size, mask, in_baseline,
                              group_sizes)


def policy_loss_per_token(logprobs, old_logprobs, advantages, loss_mask, cfg: LossConfig,
                          ref_logprobs=None, token_kl=None, is_weights=None,
                          rollout_logprobs=None, entropy=None):
    """Per-token loss [B, T] (not yet masked or normalized) and a dict of detached metrics.

    logprobs [B, T] (current policy, with grad), old_logprobs [B, T] (behaviour policy),
    advantages [B] or [B, T] (detached), loss_mask [B, T], ref_logprobs [B, T] (needed for the
    loss-side KL and the "seq-is" reward surrogate; optional otherwise, then no kl_* metrics).
    token_kl [B, T]: for the "exact" estimator, KL_t at the current policy, differentiable in its
    logits (ops.exact_kl); it replaces ref_logprobs in the loss-side KL and the "seq-is" surrogate.
    is_weights [B, T] (detached): the rollout correction's weights (correction.py), multiplying
    the policy-gradient loss of each token (not the KL terms).
    rollout_logprobs [B, T]: the engine's log-probs, which the KL's importance weights divide by
    under cfg.kl.is_proposal "rollout" (else they divide by old_logprobs).
    entropy [B, T]: the policy's entropy at each position, differentiable in its logits (the
    scoring op's); needed when cfg.entropy_coef is not 0, whose bonus -coef * entropy_t joins
    the per-token loss.

        loss_t = is_weight_t * pg_t + [KL loss term]_t + [seq-is KL surrogate]_t - coef H_t

    with pg_t the --policy-loss's (policy_losses.py; advantages reach it as [B, 1] or [B, T]).
    The reward-side KL is already inside `advantages` (see build_advantages) and so
    has no path-wise gradient here; only the loss-side KL and the "seq-is" reward surrogate are
    differentiated through logprobs (and token_kl).
    """
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    pg, metrics = resolve_policy_loss(cfg.policy_loss)(logprobs, old_logprobs, adv, mask, cfg)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    per_token = pg

    kl_cfg = cfg.kl
    if kl_cfg.differentiated and (token_kl if kl_cfg.exact else ref_logprobs) is None:
        raise ValueError(f"KL placement {kl_cfg.placement!r} with off_policy_correction "
                         f"{kl_cfg.off_policy_correction!r} needs "
                         + ("token_kl (estimator 'exact')" if kl_cfg.exact else "ref_logprobs"))
    proposal = old_logprobs
    if kl_cfg.is_proposal == "rollout" and kl_cfg.off_policy_correction != "none":
        if rollout_logprobs is None:
            raise ValueError("--kl-is-proposal rollout needs the engine's rollout_logprobs")
        proposal = rollout_logprobs
    if kl_cfg.in_loss:
        per_token = per_token + kl_loss_term(logprobs, ref_logprobs, mask, kl_cfg, proposal,
                                             token_kl=token_kl)
    if kl_cfg.in_reward and not kl_cfg.reward_in_advantage:
        per_token = per_token + kl_reward_is_surrogate(logprobs, ref_logprobs, proposal, mask,
                                                       kl_cfg, token_kl=token_kl)
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError(f"--entropy-coef {cfg.entropy_coef} needs the policy's entropy "
                             "per token (policy_loss's entropy argument)")
        per_token = per_token - cfg.entropy_coef * entropy

    with torch.no_grad():
        num_tokens = mask.sum().clamp(min=1)
        metrics["pg_per_token"] = pg.detach()
        if ref_logprobs is not None:
            metrics["kl_k1"] = (k1(logprobs, ref_logprobs) * mask).sum() / num_tokens
            metrics["kl_k3"] = (k3(logprobs, ref_logprobs) * mask).sum() / num_tokens
        if token_kl is not None:
            metrics["kl_exact"] = (token_kl.detach() * mask).sum() / num_tokens
    return per_token, metrics


def policy_loss(logprobs, old_logprobs, advantages, loss_mask, cfg: LossConfig, *,
                ref_logprobs=None, token_kl=None, is_weights=None, rollout_logprobs=None,
                entropy=None, num_global_tokens=None, num_global_seqs=None):
    """Scalar loss of one shard and detached metrics; shards with global normalizers sum to the
    full-batch loss. Arguments as in policy_loss_per_token; normalizers as in aggregate_loss.

    metrics: pg_loss (the policy-gradient loss alone, aggregated like the loss), kl_k1 / kl_k3
    (token means of the shard), kl_exact (with token_kl), and the policy loss's own
    (clip_fraction, ratio_mean / ratio_max / ratio_min, ...; policy_losses.py). Its
    SEQUENCE_SHARES (seq_clip_fraction, seq_ratio_mean: means over the shard's rows with a
    loss token) become, given num_global_seqs, the shard's share of the global batch's value:
    they add up over shards like pg_loss.
    """
    per_token, metrics = policy_loss_per_token(logprobs, old_logprobs, advantages, loss_mask, cfg,
                                               ref_logprobs=ref_logprobs, token_kl=token_kl,
                                               is_weights=is_weights,
                                               rollout_logprobs=rollout_logprobs,
                                               entropy=entropy)
    normalizers = dict(num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs)
    loss = aggregate_loss(per_token, loss_mask, cfg.aggregation, **normalizers)
    metrics["pg_loss"] = aggregate_loss(metrics.pop("pg_per_token"), loss_mask, cfg.aggregation,
                                        **normalizers)
    if num_global_seqs is not None:
        shard_seqs = num_sequences(loss_mask)
        for k in SEQUENCE_SHARES:
            if k in metrics:
                metrics[k] = metrics[k] * (shard_seqs.to(metrics[k].dtype) / num_global_seqs)
    return loss, metrics


SEQUENCE_SHARES = ("seq_clip_fraction", "seq_ratio_mean")
"""Policy-loss metrics that are means over the shard's sequences (rows with a loss token,
num_sequences); policy_loss turns them into shares of the global batch's sequence count."""


def shape_overlong(rewards: torch.Tensor, loss_mask: torch.Tensor, response_lengths: list[int],
                   finish_reasons: list[str], max_new_tokens: int,
                   cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(rewards [B], loss_mask [B, T], counts) with the overlong handling of `cfg` applied to a
    batch's task rewards [B] and loss mask [B, T] (response_lengths: each response's tokens;
    finish_reasons: "length" where it hit max_new_tokens). New tensors; the inputs are kept.

    --overlong-filtering: a truncated response's loss mask becomes 0: it leaves the policy
    loss, every KL term (the reward-side KL sums over the mask, so its return is the bare task
    reward, which still enters the other responses' group baseline) and the token count.
    --overlong-buffer-len L > 0 (DAPO's soft punishment, factor f = --overlong-penalty-factor):
        R <- R - f * max(0, len - (max_new_tokens - L)) / L,
    0 up to max_new_tokens - L, -f at max_new_tokens. It joins the task reward, so it sits beside
    the KL penalty in the return (R - f ... - beta sum_t K_t) and goes through the baseline.
    counts: "overlong/filtered" (responses masked out), "overlong/penalized" (responses with a
    penalty), "overlong/penalty_sum" (sum of the penalties), over this batch.
    """
    counts = {"overlong/filtered": 0.0, "overlong/penalized": 0.0, "overlong/penalty_sum": 0.0}
    if cfg.overlong_filtering:
        truncated = [f == "length" for f in finish_reasons]
        keep = torch.tensor([not t for t in truncated], dtype=loss_mask.dtype)
        loss_mask = loss_mask * keep.to(loss_mask.device)[:, None]
        counts["overlong/filtered"] = float(sum(truncated))
    if cfg.overlong_buffer_len > 0:
        buffer = cfg.overlong_buffer_len
        start = max_new_tokens - buffer
        penalty = [cfg.overlong_penalty_factor * max(0, n - start) / buffer
                   for n in response_lengths]
        rewards = rewards - torch.tensor(penalty, dtype=rewards.dtype).to(rewards.device)
        counts["overlong/penalized"] = float(sum(p > 0 for p in penalty))
        counts["overlong/penalty_sum"] = float(sum(penalty))
    return rewards, loss_mask, counts
