"""Token log-probs, entropy, K1/K3 and the exact KL straight from hidden states: the output
layer fused into the scoring op, so that no [N, V] (nor [N, V/TP]) logits tensor ever exists.

Scoring a response token needs one row of the logits z = h W^T (h [N, H] final hidden states,
W [V/TP, H] this rank's output-layer shard, the embedding when tied). At V = 151936 a row is
0.3 MB in bf16: the logits of 16k tokens are ~5 GB per model, their gradient as much again.
This op computes them `chunk_tokens` rows at a time and keeps only O(N) statistics:

- forward: for each token chunk c, z_c = h_c W^T (in the hidden dtype, as the output layer
  computes it), then the per-rank partial kernels of logprob_kl.py (row max, sum-exp, target
  logit, entropy and exact-KL sums; backends "torch", "cpu", "cuda") on z_c; z_c is dropped.
  The chunks' partials are combined across the tensor-parallel group exactly as the logits op
  does (one MAX and one SUM all-reduce per call, not per chunk).
- backward: for each chunk, z_c is recomputed (and the reference's r_c = h'_c W'^T for the
  exact KL), the same gradient kernels give dz_c, then dh_c = dz_c W and dW += dz_c^T h_c
  (accumulated in fp32). Peak extra memory: O(chunk_tokens * V/TP) plus the fp32 dW.

The cost is the recompute: one extra h W^T matmul in backward (two with the exact KL, where the
reference's logits are recomputed too), against megatron's output layer + cross entropy, which
keeps the [N, V/TP] logits, an fp32 softmax of the same size and a gradient of that size.

Tensor parallelism: the vocab is sharded, `hidden` is the same on every rank of `tp_group`.
The gradient returned for `hidden` is this rank's partial (its vocab shard's contribution),
exactly like megatron's ColumnParallelLinear computes it: the caller sums it over the TP group
(megatron's copy_to_tensor_model_parallel_region, or gather_from_sequence_parallel_region under
sequence parallelism, placed before the op as the output layer places them before its matmul).
`weight` gets this rank's shard gradient; the reference's hidden states and weight get none.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_rl.ops import reference
from megatron_rl.ops.logprob_kl import (_SUPPORTED_DTYPES, TokenLogprobOutput, _combine_exact_partials,
                                        _combine_partials, _exact_backend, exact_kl_grad,
                                        exact_kl_grad_accumulate_, exact_kl_partials, logprob_grad,
                                        logprob_partials, resolve_backend)

CHUNK_ENV_VAR = "MEGATRON_RL_LM_HEAD_CHUNK_TOKENS"
# Logits elements per token chunk: 8M on CPU (32 MiB in fp32), 64M on GPUs (256 MiB), where
# a chunk also has to be large enough for the matmuls to run at full speed.
CPU_CHUNK_ELEMENTS = 1 << 23
GPU_CHUNK_ELEMENTS = 1 << 26


def default_chunk_tokens(vocab_local: int, device: torch.device) -> int:
    """Tokens per chunk: `MEGATRON_RL_LM_HEAD_CHUNK_TOKENS` when set, else as many rows as fit in
    the device's logits budget (at least 1)."""
    env = os.environ.get(CHUNK_ENV_VAR)
    if env:
        return max(1, int(env))
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return max(1, budget // max(1, vocab_local))


def _chunks(n: int, size: int):
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[c, V_local] = h [c, H] @ w[V_local, H]^T, contiguous, in h's dtype."""
    return torch.matmul(h, w.t())


class _LMHeadLogprobKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, ref_N, inv_temperature, vocab_start,
                tp_group, with_entropy, backend, ref_hidden_NH, ref_weight_VH, chunk):
        n = hidden_NH.shape[0]
        exact = ref_hidden_NH is not None
        ctx.exact_backend = _exact_backend(backend) if exact else None
        parts: list[tuple] = []
        exact_parts: list[tuple] = []
        for a, b in _chunks(n, chunk):
            z = _logits(hidden_NH[a:b], weight_VH)
            parts.append(logprob_partials(z, targets_N[a:b], vocab_start, inv_temperature,
                                          with_entropy, backend))
            if exact:
                r = _logits(ref_hidden_NH[a:b], ref_weight_VH)
                exact_parts.append(exact_kl_partials(z, r, ctx.exact_backend))
                del r
            del z
        cat = lambda ps, i: torch.cat([p[i] for p in ps]) if ps else None  # noqa: E731
        row_max, sum_exp, target_z, ent_w = (cat(parts, i) for i in range(4))
        if row_max is None:  # no rows: empty statistics of the right dtype
            acc = reference.compute_dtype(hidden_NH.dtype)
            row_max = sum_exp = target_z = hidden_NH.new_empty(0, dtype=acc)
            ent_w = row_max if with_entropy else row_max.new_empty(0)
        vocab_local = weight_VH.shape[0]
        owned = (targets_N >= vocab_start) & (targets_N < vocab_start + vocab_local)
        global_max, shifted_lse, logprobs, entropy = _combine_partials(
            row_max, sum_exp, target_z, ent_w, owned, tp_group, with_entropy)
        log_ratio = k3 = None
        if ref_N is not None:
            log_ratio = ref_N - logprobs
            k3 = torch.expm1(log_ratio) - log_ratio
        exact_stats, kl = (None,) * 5, None
        if exact:
            if exact_parts:
                stats = [cat(exact_parts, i) for i in range(5)]
            else:
                stats = [row_max.clone() for _ in range(5)]
            exact_stats = _combine_exact_partials(*stats, tp_group)
            kl = exact_stats[-1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, global_max, shifted_lse,
                              log_ratio, entropy, ref_hidden_NH, ref_weight_VH, *exact_stats)
        ctx.inv_temperature, ctx.vocab_start, ctx.backend = inv_temperature, vocab_start, backend
        ctx.chunk = chunk
        return logprobs, log_ratio, k3, entropy, kl

    @staticmethod
    def backward(ctx, g_logprobs, g_log_ratio, g_k3, g_entropy, g_kl=None):
        (hidden_NH, weight_VH, targets_N, global_max, shifted_lse, log_ratio, entropy,
         ref_hidden_NH, ref_weight_VH, *exact_stats) = ctx.saved_tensors
        none = (None,) * 10
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_exact = g_kl is not None and ref_hidden_NH is not None
        use_lp = not (g_logprobs is None and g_log_ratio is None and g_k3 is None
                      and g_entropy is None)
        if not (use_exact or use_lp) or not (want_h or want_w):
            return (None, None) + none
        grad_coef = entropy_grad = None
        if use_lp:  # everything flows through log p: d log_ratio = -1, dK3 = 1 - exp(r)
            grad_coef = torch.zeros_like(shifted_lse)
            if g_logprobs is not None:
                grad_coef = grad_coef + g_logprobs
            if g_log_ratio is not None:
                grad_coef = grad_coef - g_log_ratio
            if g_k3 is not None:
                grad_coef = grad_coef - g_k3 * torch.expm1(log_ratio)
            grad_coef = grad_coef.to(shifted_lse.dtype).contiguous()
            if g_entropy is not None:
                entropy_grad = g_entropy.to(shifted_lse.dtype).contiguous()
        g_kl_N = g_kl.to(exact_stats[-1].dtype).contiguous() if use_exact else None
        grad_h = torch.empty_like(hidden_NH) if want_h else None
        grad_w = (torch.zeros(weight_VH.shape, dtype=reference.compute_dtype(weight_VH.dtype),
                              device=weight_VH.device) if want_w else None)
        for a, b in _chunks(hidden_NH.shape[0], ctx.chunk):
            z = _logits(hidden_NH[a:b], weight_VH)
            gz = None
            if use_lp:
                gz = logprob_grad(z, targets_N[a:b], ctx.vocab_start, ctx.inv_temperature,
                                  global_max[a:b], shifted_lse[a:b], grad_coef[a:b],
                                  None if entropy_grad is None else entropy_grad[a:b],
                                  None if entropy_grad is None else entropy[a:b], ctx.backend)
            if use_exact:
                r = _logits(ref_hidden_NH[a:b], ref_weight_VH)
                st = [s[a:b] for s in exact_stats]
                if gz is None:
                    gz = exact_kl_grad(z, r, *st, g_kl_N[a:b], ctx.exact_backend)
                else:
                    exact_kl_grad_accumulate_(gz, z, r, *st, g_kl_N[a:b], ctx.exact_backend)
                del r
            del z
            if want_h:
                torch.matmul(gz, weight_VH, out=grad_h[a:b])
            if want_w:
                grad_w.add_(torch.matmul(gz.t(), hidden_NH[a:b]))
            del gz
        if grad_w is not None:
            grad_w = grad_w.to(weight_VH.dtype)
        return (grad_h, grad_w) + none


def lm_head_logprobs_and_kl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            ref_logprobs: Optional[torch.Tensor] = None, temperature: float = 1.0,
                            vocab_start: int = 0, tp_group=None, return_entropy: bool = False,
                            backend: str = "auto", ref_hidden: Optional[torch.Tensor] = None,
                            ref_weight: Optional[torch.Tensor] = None,
                            chunk_tokens: Optional[int] = None) -> TokenLogprobOutput:
    """`token_logprobs_and_kl(hidden @ weight.T, targets, ...)` without the logits.

    Args:
        hidden: [..., H] final hidden states (after the final norm), bf16/fp16/fp32 (fp64 for
            testing); the same on every rank of `tp_group`.
        weight: [V_local, H] this rank's output-layer shard, rows [vocab_start, vocab_start +
            V_local) of the vocabulary (the word embedding when tied), hidden's dtype.
        targets: [...] global token ids; ref_logprobs, temperature, vocab_start, tp_group,
            return_entropy, backend: as in `token_logprobs_and_kl`.
        ref_hidden, ref_weight: the reference model's hidden states [..., H] and output-layer
            shard [V_local, H]: also return `exact_kl`, the exact per-position KL(pi || pi_ref)
            at temperature 1 (as `exact_kl` computes it from both logits), differentiable in
            `hidden` and `weight`; neither reference tensor gets a gradient.
        chunk_tokens: rows of logits computed at a time (default: `default_chunk_tokens`).

    Returns: TokenLogprobOutput with [...]-shaped fp32 tensors (fp64 for fp64 input). Gradients:
    `hidden` gets this rank's partial (sum it over the TP group, see the module docstring),
    `weight` its shard's gradient (in its dtype, accumulated over chunks in fp32).
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"need hidden [..., H] and weight [V_local, H]; got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocab dim")
    if hidden.dtype not in _SUPPORTED_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight need one dtype of {[str(d) for d in _SUPPORTED_DTYPES]}"
                         f"; got {hidden.dtype} and {weight.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden shape without "
                         f"the hidden dim {tuple(hidden.shape[:-1])}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("the exact KL needs both ref_hidden and ref_weight")
    lead_shape = tuple(targets.shape)
    H, vocab_local = hidden.shape[-1], weight.shape[0]
    hidden_NH = hidden.reshape(-1, H).contiguous()
    targets_N = targets.reshape(-1).to(torch.long).contiguous()
    acc = reference.compute_dtype(hidden.dtype)
    ref_N = None
    if ref_logprobs is not None:
        if tuple(ref_logprobs.shape) != lead_shape:
            raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} must equal targets "
                             f"shape {lead_shape}")
        ref_N = ref_logprobs.detach().reshape(-1).to(acc).contiguous()
    if tp_group is None and hidden.device.type == "cpu" and targets_N.numel() > 0:
        if bool(((targets_N < vocab_start) | (targets_N >= vocab_start + vocab_local)).any()):
            raise ValueError(f"targets must lie in [{vocab_start}, {vocab_start + vocab_local}) "
                             f"when tp_group is None")
    ref_hidden_NH = ref_weight_VH = None
    if ref_hidden is not None:
        if tuple(ref_hidden.shape) != tuple(hidden.shape) or tuple(ref_weight.shape) != tuple(
                weight.shape):
            raise ValueError(f"reference shapes {tuple(ref_hidden.shape)}, "
                             f"{tuple(ref_weight.shape)} must equal the policy's "
                             f"{tuple(hidden.shape)}, {tuple(weight.shape)}")
        if temperature != 1.0:
            raise ValueError("the exact KL (ref_hidden) is defined at temperature 1")
        ref_hidden_NH = ref_hidden.detach().to(hidden.dtype).reshape(-1, H).contiguous()
        ref_weight_VH = ref_weight.detach().to(hidden.dtype).contiguous()
    concrete = resolve_backend(backend, hidden.device, hidden.dtype)
    chunk = chunk_tokens or default_chunk_tokens(vocab_local, hidden.device)
    logprobs, log_ratio, k3, entropy, kl = _LMHeadLogprobKL.apply(
        hidden_NH, weight, targets_N, ref_N, 1.0 / float(temperature), int(vocab_start),
        tp_group, bool(return_entropy), concrete, ref_hidden_NH, ref_weight_VH, int(chunk))
    reshape = lambda t: None if t is None else t.reshape(lead_shape)  # noqa: E731
    return TokenLogprobOutput(reshape(logprobs), reshape(log_ratio), reshape(k3), reshape(entropy),
                              reshape(kl))


def lm_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     tp_group=None, vocab_start: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """[...] fp32 log-probs of `targets` from hidden states [..., H] and the output-layer shard
    [V_local, H]: `vocab_parallel_logprobs` without the logits."""
    return lm_head_logprobs_and_kl(hidden, weight, targets, temperature=temperature,
                                   vocab_start=vocab_start, tp_group=tp_group).logprobs


def lm_head_exact_kl(hidden: torch.Tensor, weight: torch.Tensor, ref_hidden: torch.Tensor,
                     ref_weight: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[...] exact per-position KL(pi || pi_ref) from both models' hidden states and output
    layers (`exact_kl` without the logits), differentiable in hidden and weight."""
    import torch.distributed as dist

    # token 0 as a placeholder target (owned by TP rank 0): only the KL is returned
    targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]
    return lm_head_logprobs_and_kl(hidden, weight, targets, vocab_start=vocab_start,
                                   tp_group=tp_group, ref_hidden=ref_hidden,
                                   ref_weight=ref_weight).exact_kl
