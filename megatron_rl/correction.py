"""Rollout correction: the policy-gradient loss of tokens that another distribution sampled.

The engine samples with its own numerics (vLLM or SGLang kernels, bf16, weights up to
--async-level updates old): its distribution mu is not the trainer's behaviour policy pi_old,
whose log-probs the trainer recomputes (--old-logprobs recompute). The PPO ratio pi_theta/pi_old
then corrects only from pi_old to pi_theta; the importance weight of the rest is, per token,

    w_t = pi_old(y_t | y_<t) / mu(y_t | y_<t) = exp(old_logprobs_t - rollout_logprobs_t),

detached, multiplying the clipped surrogate of token t (so E_mu[w * grad] = E_pi_old[grad]).
Raw weights have unbounded variance where mu puts little mass; the corrections bound them:

    tis      token-level truncated IS: w_t -> clamp(w_t, low, high) (default [0, 2]: min(w, 2))
    seq-mis  sequence-level masked IS: rho = prod_t w_t for the whole response; each token of
             the sequence gets rho when low <= rho <= high (default [0.5, 2]), else 0
    icepop   two-sided token mask: w_t where low <= w_t <= high (default [0.5, 5]), else 0

Under --async-level the engine's weights are up to k updates old and the recompute uses the
current ones (the decoupled behaviour policy): w then corrects the staleness as well.

Truncating or masking trades the bias of the dropped mass for bounded variance. The weight
multiplies the policy-gradient term only, never the KL terms (kl.py corrects those), and the
loss keeps its normalizer: a masked token adds nothing but still counts. With --old-logprobs
rollout the behaviour log-probs are the engine's, w = 1, and every correction is a no-op.

The log-ratio is clamped to [-20, 20] before exp (a token the engine sampled at ~0 probability
under pi_old gives weight 0 rather than inf*0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CORRECTIONS = ("none", "tis", "seq-mis", "icepop")
# (low, high) of each correction when --rollout-is-low / --rollout-is-high are not given
DEFAULT_BOUNDS = {"tis": (0.0, 2.0), "seq-mis": (0.5, 2.0), "icepop": (0.5, 5.0)}
LOG_RATIO_CLAMP = 20.0


@dataclass
class RolloutCorrectionConfig:
    """Which rollout correction the policy-gradient loss uses (module docstring)."""

    mode: str = field(default="none", metadata={
        "flag": "rollout_correction", "choices": list(CORRECTIONS), "help": (
            "importance weight pi_old/mu of the policy-gradient term, where mu is the engine "
            "that sampled (its rollout log-probs) and pi_old the trainer's recompute: none; "
            "tis = token-level, truncated to [--rollout-is-low, --rollout-is-high] (default "
            "[0, 2]); seq-mis = the sequence's product of token weights, the whole sequence "
            "masked outside the bounds (default [0.5, 2]); icepop = token weights masked "
            "outside the bounds (default [0.5, 5]). Needs --old-logprobs recompute (with the "
            "engine's own log-probs the weight is 1) and sampling at temperature 1 without "
            "top-p (the engine reports the log-probs it sampled from). Under --async-level the "
            "recompute is the current weights and w also corrects the engine's staleness")})
    is_low: float | None = field(default=None, metadata={"flag": "rollout_is_low", "help": (
        "lower bound of --rollout-correction's weights (tis: truncation; seq-mis, icepop: "
        "mask); unset: the correction's default")})
    is_high: float | None = field(default=None, metadata={
        "flag": "rollout_is_high", "inf": True, "help": (
        "upper bound of --rollout-correction's weights (tis: truncation; seq-mis, icepop: "
        "mask; inf: none); unset: the correction's default")})

    def validate(self) -> None:
        """The bounds (the mode's choices are checked by the trainer's TrainConfig.validate)."""
        if self.mode != "none":
            low, high = self.bounds()
            if not 0 <= low < high:
                raise ValueError(f"--rollout-is-low {low} / --rollout-is-high {high}: need "
                                 "0 <= low < high")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def bounds(self) -> tuple[float, float]:
        """(low, high) of the active correction."""
        low, high = DEFAULT_BOUNDS.get(self.mode, (0.0, float("inf")))
        return (low if self.is_low is None else self.is_low,
                high if self.is_high is None else self.is_high)


@dataclass
class CorrectionStats:
    """Sums over one rank's tokens and sequences, for the global metrics (all-reduced by the
    caller, then `as_metrics`). raw: the weights before truncation or masking."""

    sums: torch.Tensor  # [9] float64, see `as_metrics`
    raw_max: torch.Tensor  # [1]
    raw_min: torch.Tensor  # [1]

    @staticmethod
    def names() -> tuple[str, ...]:
        return ("tokens", "seqs", "raw", "raw_sq", "weight", "weight_sq", "changed",
                "masked_seqs", "log_ratio_abs")

    @staticmethod
    def as_metrics(sums: list[float], raw_max: float, raw_min: float) -> dict[str, float]:
        """rollout_corr/* metrics from the global sums: the raw weights' mean, max, min and
        effective sample size (ESS/N = (sum w)^2 / (N sum w^2)), chi^2 = E[w^2] - 1 (the
        divergence the raw weights' variance grows with), the corrected weights' mean and ESS,
        the share of tokens the correction changed (truncated or masked), the share of masked
        sequences (seq-mis), and the mean |log pi_old - log mu| per token."""
        s = dict(zip(CorrectionStats.names(), sums))
        n = max(s["tokens"], 1.0)
        return {
            "rollout_corr/is_mean": s["raw"] / n,
            "rollout_corr/is_max": raw_max,
            "rollout_corr/is_min": raw_min,
            "rollout_corr/chi2_token": s["raw_sq"] / n - 1.0,
            "rollout_corr/is_ess": s["raw"] ** 2 / max(n * s["raw_sq"], 1e-30),
            "rollout_corr/weight_mean": s["weight"] / n,
            "rollout_corr/weight_ess": s["weight"] ** 2 / max(n * s["weight_sq"], 1e-30),
            "rollout_corr/changed_fraction": s["changed"] / n,
            "rollout_corr/seq_masked_fraction": s["masked_seqs"] / max(s["seqs"], 1.0),
            "rollout_corr/log_ratio_abs_mean": s["log_ratio_abs"] / n,
        }


def rollout_correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                               mask: torch.Tensor, cfg: RolloutCorrectionConfig
                               ) -> tuple[torch.Tensor, CorrectionStats]:
    """(weights [B, T], detached, 0 off the response; this rank's CorrectionStats).

    old_logprobs, rollout_logprobs, mask: [B, T] (the trainer's behaviour log-probs, the
    engine's, the response mask). With cfg.mode "none" the weights are the raw ones (for the
    metrics only; the caller does not apply them).
    """
    with torch.no_grad():
        m = mask.to(torch.float32)
        log_w = ((old_logprobs.float() - rollout_logprobs.float()) * m).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        raw = log_w.exp() * m
        low, high = cfg.bounds()
        masked_seqs = torch.zeros((), device=m.device)
        if cfg.mode == "tis":
            weights = raw.clamp(low, high) * m
        elif cfg.mode == "icepop":
            weights = raw * ((raw >= low) & (raw <= high)).to(raw.dtype)
        elif cfg.mode == "seq-mis":
            has = m.sum(-1) > 0
            rho = log_w.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            keep = (rho >= low) & (rho <= high)
            weights = (rho * keep)[:, None] * m
            masked_seqs = (has & ~keep).sum().to(torch.float32)
        else:
            weights = raw
        changed = ((weights != raw) & (m > 0)).sum().to(torch.float32)
        sums = torch.stack([m.sum(), (m.sum(-1) > 0).sum().to(torch.float32), raw.sum(),
                            raw.square().sum(), weights.sum(), weights.square().sum(), changed,
                            masked_seqs, (log_w.abs() * m).sum()]).double()
        big = torch.finfo(torch.float32).max
        raw_max = raw.masked_fill(m == 0, -big).max().reshape(1)
        raw_min = raw.masked_fill(m == 0, big).min().reshape(1)
    return weights, CorrectionStats(sums, raw_max, raw_min)
