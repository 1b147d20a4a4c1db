"""Pure-PyTorch kernels for the fused token log-prob / log-ratio / K3 op, and an fp64 oracle.

Two things live here:

1. The "torch" backend: `logprob_partials_torch` and `logprob_grad_torch`, the same two
   per-rank kernels that csrc/ implements in C++ and CUDA, written with chunked PyTorch ops.
   They run on any device. Rows are processed in chunks of at most `CHUNK_ELEMENTS` logits (CPU),
   so the only fp32 [rows, V_local] buffers ever alive are one chunk's.
2. `naive_token_logprobs_and_kl`: the textbook full-vocab computation (log_softmax in the
   requested dtype, gather, K3). Tests run it in float64 as the oracle and in the input dtype
   to measure PyTorch's own error; the benchmark uses it as the naive baseline.
3. The exact per-position KL(pi || pi_ref) from both logits: `exact_kl_partials_torch`,
   `exact_kl_grad_torch` (the kernels' contract is written above them) and the oracle
   `naive_exact_kl`.

Kernel contract (shared by every backend; `logits_NV` is this rank's vocab shard, contiguous):
    z = logits * inv_temperature                          (computed in fp32, fp64 for fp64 input)
    partials:  row_max[i]  = max_j z_ij
               sum_exp[i]  = sum_j exp(z_ij - row_max[i])
               target_z[i] = z_i,t(i)-vocab_start  if the target lies in this shard, else 0
               ent_w[i]    = sum_j exp(z_ij - row_max[i]) * (z_ij - row_max[i])   (entropy only)
    grad:      log p_ij = (z_ij - row_max[i]) - shifted_lse[i]       (global max / normalizer)
               d z_ij   = grad_coef[i] * (onehot_ij - p_ij)
                          - entropy_grad[i] * p_ij * (log p_ij + entropy[i])
               d logits = d z * inv_temperature

Non-finite logits, in every backend and kernel: -inf is a masked entry (probability 0; it adds
0 to every sum, 0 log 0 = 0, and gets a zero gradient, except the one-hot term of a masked
target, whose log-prob is -inf). A NaN makes its row's statistics NaN; so do +inf and a row
with every entry masked. Sums are relative to the "safe max" `safe_max(row_max)`: the max, or 0
where the max is -inf (a shard whose entries are all masked), so -inf - (-inf) never appears.
Exact KL: a policy entry that is not masked where the reference's is makes the KL +inf, as it
is mathematically, however small its probability (even where e^(z - max) underflows to 0: the
partial `w` keeps +inf through every rescale); that row's gradient is then not finite.
"""
from __future__ import annotations

from typing import Optional

import torch

# Upper bound on logits per chunk in the torch backend: on CPU 1M elements (4 MiB per fp32
# buffer, the size of the chunk's temporaries); on GPUs 16M elements (64 MiB), as there every
# chunk costs ~10 kernel launches and a few chunks' worth of memory does not matter.
CHUNK_ELEMENTS = 1 << 20
GPU_CHUNK_ELEMENTS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 logits (gradcheck), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(vocab_local: int, device: torch.device) -> int:
    budget = CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return max(1, budget // max(1, vocab_local))


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """The max a partial's sums are relative to: `m`, or 0 where `m` is -inf (nothing but masked
    entries), so that masked entries never produce -inf - (-inf)."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def safe_delta(m: torch.Tensor, global_m: torch.Tensor) -> torch.Tensor:
    """log of the factor that moves a partial's sums (relative to its safe max) to the global
    max: safe_max(m) - safe_max(global_m), clamped at 0 (a shard of masked entries only has sums
    0 and safe max 0, which next to a global max below 0 would give e^(-M) = inf times 0)."""
    return (safe_max(m) - safe_max(global_m)).clamp(max=0.0)


def _local_targets(targets_N: torch.Tensor, vocab_start: int, vocab_local: int):
    """(owned_N bool, local index_N clamped into [0, vocab_local)) for global target ids."""
    local = targets_N - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return owned, local.clamp(0, vocab_local - 1)


def logprob_partials_torch(logits_NV: torch.Tensor, targets_N: torch.Tensor, vocab_start: int,
                           inv_temperature: float, with_entropy: bool):
    """Per-rank forward partials (row_max, sum_exp, target_z, ent_w), each [N] in compute dtype.

    ent_w is an empty tensor when `with_entropy` is False.
    """
    num_rows, vocab_local = logits_NV.shape
    acc = compute_dtype(logits_NV.dtype)
    row_max = torch.empty(num_rows, dtype=acc, device=logits_NV.device)
    sum_exp = torch.empty_like(row_max)
    ent_w = torch.empty_like(row_max) if with_entropy else row_max.new_empty(0)

    owned, local = _local_targets(targets_N, vocab_start, vocab_local)
    target_z = logits_NV.gather(1, local.unsqueeze(1)).squeeze(1).to(acc)
    if inv_temperature != 1.0:
        target_z = target_z * inv_temperature
    target_z = torch.where(owned, target_z, torch.zeros_like(target_z))

    step = _rows_per_chunk(vocab_local, logits_NV.device)
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        z = logits_NV[r0:r1].to(acc, copy=True)  # in-place ops below
        if inv_temperature != 1.0:
            z.mul_(inv_temperature)
        m = z.amax(dim=1)
        z.sub_(safe_max(m).unsqueeze(1))        # z - max, exact for nearby values
        e = torch.exp(z)
        row_max[r0:r1] = m
        sum_exp[r0:r1] = e.sum(dim=1)
        if with_entropy:                        # 0 log 0 = 0 at masked entries
            ent_w[r0:r1] = e.mul_(z.masked_fill_(e == 0, 0.0)).sum(dim=1)
        del z, e
    return row_max, sum_exp, target_z, ent_w


def logprob_grad_torch(logits_NV: torch.Tensor, targets_N: torch.Tensor, vocab_start: int,
                       inv_temperature: float, row_max: torch.Tensor, shifted_lse: torch.Tensor,
                       grad_coef: torch.Tensor, entropy_grad: Optional[torch.Tensor],
                       entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """grad_logits [N, V_local] in the logits dtype (see the module docstring for the formula)."""
    num_rows, vocab_local = logits_NV.shape
    acc = compute_dtype(logits_NV.dtype)
    grad = torch.empty_like(logits_NV)
    owned, local = _local_targets(targets_N, vocab_start, vocab_local)
    # The one-hot term only where this rank owns the target.
    onehot_coef = torch.where(owned, grad_coef, torch.zeros_like(grad_coef))

    step = _rows_per_chunk(vocab_local, logits_NV.device)
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        logp = logits_NV[r0:r1].to(acc, copy=True)
        if inv_temperature != 1.0:
            logp.mul_(inv_temperature)
        logp.sub_(row_max[r0:r1].unsqueeze(1)).sub_(shifted_lse[r0:r1].unsqueeze(1))
        if entropy_grad is not None:
            # coef_ij = a_i + b_i * (log p_ij + H_i);  g_ij = -p_ij * coef_ij
            coef = (logp + entropy[r0:r1].unsqueeze(1)).mul_(entropy_grad[r0:r1].unsqueeze(1))
            coef.add_(grad_coef[r0:r1].unsqueeze(1))
            g = torch.exp(logp)
            g.mul_(coef.masked_fill_(g == 0, 0.0)).neg_()  # p = 0: no gradient
            del coef
        else:
            g = torch.exp(logp).mul_(-grad_coef[r0:r1].unsqueeze(1))
        del logp
        g.scatter_add_(1, local[r0:r1].unsqueeze(1), onehot_coef[r0:r1].unsqueeze(1))
        if inv_temperature != 1.0:
            g.mul_(inv_temperature)
        grad[r0:r1] = g
        del g
    return grad


def naive_token_logprobs_and_kl(logits: torch.Tensor, targets: torch.Tensor,
                                ref_logprobs: Optional[torch.Tensor] = None,
                                temperature: float = 1.0, dtype: Optional[torch.dtype] = None):
    """Full-vocab textbook version: (logprobs, log_ratio, k3, entropy), each shaped like targets.

    Computes in `dtype` (default: the logits dtype). With dtype=torch.float64 this is the
    oracle of the tests; with the input dtype it measures PyTorch's own rounding error.
    Materializes [N, V] log-probs: meant for tests and as the benchmark's naive baseline.
    """
    dtype = dtype or logits.dtype
    z = logits.to(dtype) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    log_ratio = k3 = None
    if ref_logprobs is not None:
        log_ratio = ref_logprobs.to(dtype) - logprobs
        k3 = torch.exp(log_ratio) - 1 - log_ratio
    return logprobs, log_ratio, k3, entropy


# --------------------------------------------------------------------------------------------
# The exact per-position KL(pi || pi_ref) from both full distributions ("exact" estimator).
# --------------------------------------------------------------------------------------------
# Kernel contract (every backend; `logits_NV` and `ref_NV` are this rank's shards of the same
# vocab range, contiguous, same dtype; z = logits, r = ref logits, in the compute dtype):
#     partials:  max_p[i] = max_j z_ij              sum_p[i] = sum_j exp(z_ij - max_p[i])
#                max_q[i] = max_j r_ij              sum_q[i] = sum_j exp(r_ij - max_q[i])
#                w[i]     = sum_j exp(z_ij - max_p[i]) * ((z_ij - max_p[i]) - (r_ij - max_q[i]))
#     combined (global maxes M_p, M_q; S = rescaled sums; W the rescaled w, see logprob_kl.py):
#                KL[i] = W[i] / S_p[i] - log S_p[i] + log S_q[i]
#     grad:      log p_ij = (z_ij - M_p[i]) - lse_p[i],  log q_ij = (r_ij - M_q[i]) - lse_q[i]
#                d z_ij   = grad_kl[i] * p_ij * (log p_ij - log q_ij - KL[i])
#                (lse_* = log S_*: the log-normalizers relative to the global maxes)
def exact_kl_partials_torch(logits_NV: torch.Tensor, ref_NV: torch.Tensor):
    """Per-rank forward partials (max_p, sum_p, max_q, sum_q, w), each [N] in compute dtype."""
    num_rows, vocab_local = logits_NV.shape
    acc = compute_dtype(logits_NV.dtype)
    out = [torch.empty(num_rows, dtype=acc, device=logits_NV.device) for _ in range(5)]
    max_p, sum_p, max_q, sum_q, w = out
    # two fp32 chunks alive at a time (policy and reference): half the rows of the log-prob op
    step = max(1, _rows_per_chunk(vocab_local, logits_NV.device) // 2)
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        z = logits_NV[r0:r1].to(acc, copy=True)
        r = ref_NV[r0:r1].to(acc, copy=True)
        mp, mq = z.amax(dim=1), r.amax(dim=1)
        z.sub_(safe_max(mp).unsqueeze(1))
        r.sub_(safe_max(mq).unsqueeze(1))
        max_p[r0:r1], max_q[r0:r1] = mp, mq
        sum_q[r0:r1] = torch.exp(r).sum(dim=1)
        r.neg_().add_(z)                          # d = (z - max_p) - (r - max_q)
        infinite = (r == float("inf")).any(dim=1)  # a policy entry where the reference is masked
        e = torch.exp(z)
        sum_p[r0:r1] = e.sum(dim=1)
        wi = e.mul_(r.masked_fill_(e == 0, 0.0)).sum(dim=1)  # p = 0 adds 0 (finite q)...
        w[r0:r1] = wi.masked_fill_(infinite, float("inf"))   # ...and +inf where q = 0
        del z, r, e
    return max_p, sum_p, max_q, sum_q, w


def exact_kl_grad_torch(logits_NV: torch.Tensor, ref_NV: torch.Tensor, max_p: torch.Tensor,
                        lse_p: torch.Tensor, max_q: torch.Tensor, lse_q: torch.Tensor,
                        kl: torch.Tensor, grad_kl: torch.Tensor,
                        accumulate_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad_logits [N, V_local] in the logits dtype: grad_kl * p * (log p - log q - KL); added
    (in the compute dtype, rounded once) into `accumulate_into` when given, which is returned."""
    num_rows, vocab_local = logits_NV.shape
    acc = compute_dtype(logits_NV.dtype)
    grad = torch.empty_like(logits_NV) if accumulate_into is None else accumulate_into
    step = max(1, _rows_per_chunk(vocab_local, logits_NV.device) // 2)
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        logp = logits_NV[r0:r1].to(acc, copy=True)
        logp.sub_(max_p[r0:r1].unsqueeze(1)).sub_(lse_p[r0:r1].unsqueeze(1))
        coef = ref_NV[r0:r1].to(acc, copy=True)      # becomes log p - log q - KL
        coef.sub_(max_q[r0:r1].unsqueeze(1)).sub_(lse_q[r0:r1].unsqueeze(1))
        coef.neg_().add_(logp).sub_(kl[r0:r1].unsqueeze(1))
        g = torch.exp(logp)
        g.mul_(coef.masked_fill_(g == 0, 0.0)).mul_(grad_kl[r0:r1].unsqueeze(1))  # p = 0: none
        del logp, coef
        if accumulate_into is not None:
            g.add_(grad[r0:r1])
        grad[r0:r1] = g
        del g
    return grad


def naive_exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Full-vocab textbook KL(softmax(logits) || softmax(ref_logits)) per row, in `dtype`
    (default: the logits dtype); the fp64 oracle of the tests (differentiable in both)."""
    dtype = dtype or logits.dtype
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    logq = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)
