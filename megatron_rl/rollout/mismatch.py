"""Train-vs-rollout log-prob mismatch: how far the engine's numerics are from the trainer's.

The rollout engine (vLLM, SGLang) samples with its own kernels, so the log-probs it reports,
`rollout_logprobs`, differ from the trainer's recomputation, `logprobs`, of the same weights.
With delta_t = logprobs_t - rollout_logprobs_t on response tokens:
- token level: mean and max |delta_t|, which should be ~1e-3 or less in fp32 when weight sync
  is correct; a jump means stale or wrong weights on the server;
- sequence level: the importance weight w = exp(sum_t delta_t) = pi_train(y) / pi_rollout(y)
  that an off-policy correction would apply; its spread (mean/min/max/std) is what that
  correction would do to the gradient.

Pure PyTorch on plain tensors; parallel reductions are the caller's business.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LogprobMismatch:
    """Mismatch statistics over one batch (see module docstring). Counts are over masked
    tokens and over sequences with at least one masked token."""

    num_tokens: int
    num_sequences: int
    abs_delta_mean: float
    abs_delta_max: float
    delta_mean: float
    seq_weight_mean: float
    seq_weight_min: float
    seq_weight_max: float
    seq_weight_std: float

    def as_dict(self, prefix: str = "mismatch/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in dataclasses.asdict(self).items()}


def logprob_mismatch(rollout_logprobs: torch.Tensor, logprobs: torch.Tensor,
                     mask: torch.Tensor) -> LogprobMismatch:
    """Mismatch between engine and trainer log-probs of the sampled tokens.

    rollout_logprobs, logprobs: [B, T] float; mask: [B, T] (bool or 0/1), 1 on response tokens.
    Padding positions may hold anything (also inf/nan): they are never read.
    Statistics are computed in float64; with no masked token every field is 0.
    """
    if rollout_logprobs.shape != logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"shapes differ: rollout_logprobs {list(rollout_logprobs.shape)}, "
                         f"logprobs {list(logprobs.shape)}, mask {list(mask.shape)}")
    if logprobs.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {logprobs.dim()} dims")
    m = mask.bool()
    delta = torch.where(m, logprobs.double() - rollout_logprobs.double(),
                        torch.zeros((), dtype=torch.float64, device=logprobs.device))
    num_tokens = int(m.sum())
    has_tokens = m.any(dim=1)
    num_sequences = int(has_tokens.sum())
    if num_tokens == 0:
        return LogprobMismatch(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    abs_delta = delta.abs()
    # exp of the summed log-ratio; float64 keeps it finite for sum |delta| up to ~700.
    weights = delta.sum(dim=1)[has_tokens].exp()
    std = weights.std(unbiased=False) if num_sequences > 1 else weights.new_zeros(())
    return LogprobMismatch(
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        abs_delta_mean=float(abs_delta.sum() / num_tokens),
        abs_delta_max=float(abs_delta.max()),
        delta_mean=float(delta.sum() / num_tokens),
        seq_weight_mean=float(weights.mean()),
        seq_weight_min=float(weights.min()),
        seq_weight_max=float(weights.max()),
        seq_weight_std=float(std),
    )


def combine(parts: list[LogprobMismatch]) -> LogprobMismatch:
    """The statistics of the union of disjoint batches (e.g. data-parallel shards) from each
    batch's: counts add, means are count-weighted, extremes taken, and the (population) std
    pooled through E[w^2] = std^2 + mean^2."""
    parts = [p for p in parts if p.num_tokens > 0]
    if not parts:
        return LogprobMismatch(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    tok = sum(p.num_tokens for p in parts)
    seq = sum(p.num_sequences for p in parts)
    mean = sum(p.seq_weight_mean * p.num_sequences for p in parts) / seq
    second = sum((p.seq_weight_std ** 2 + p.seq_weight_mean ** 2) * p.num_sequences
                 for p in parts) / seq
    return LogprobMismatch(
        num_tokens=tok, num_sequences=seq,
        abs_delta_mean=sum(p.abs_delta_mean * p.num_tokens for p in parts) / tok,
        abs_delta_max=max(p.abs_delta_max for p in parts),
        delta_mean=sum(p.delta_mean * p.num_tokens for p in parts) / tok,
        seq_weight_mean=mean,
        seq_weight_min=min(p.seq_weight_min for p in parts),
        seq_weight_max=max(p.seq_weight_max for p in parts),
        seq_weight_std=max(second - mean ** 2, 0.0) ** 0.5,
    )


def pad_ragged(rows: list[list[float]], pad: float = 0.0,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad variable-length rows (e.g. Completion.rollout_logprobs) into ([B, T], mask)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
        mask[i, :len(r)] = True
    return out, mask
