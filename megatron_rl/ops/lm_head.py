"""Token log-probs, entropy, K1/K3 and the exact KL straight from hidden states: the output
layer fused into the scoring op, so that no [N, V] (nor [N, V/TP]) logits tensor ever exists.

Scoring a response token needs one row of the logits z = h W^T (h [N, H] final hidden states,
W [V/TP, H] this rank's output-layer shard, the embedding when tied). At V = 151936 a row is
0.3 MB in bf16: the logits of 16k tokens are ~5 GB per model, their gradient as much again.
This op computes them a block at a time and keeps only O(N) statistics:

- forward: for each chunk c of `chunk_tokens` tokens, z_c = h_c W^T (in the hidden dtype, as
  the output layer computes it), then the per-rank partial kernels of logprob_kl.py (row max,
  sum-exp, target logit, entropy and exact-KL sums; backends "torch", "cpu", "cuda") on z_c;
  z_c is dropped. The chunks' partials are combined across the tensor-parallel group exactly as
  the logits op does (one MAX and one SUM all-reduce per call, not per chunk).
- backward: for each block v of `vocab_block` vocabulary entries, over all N tokens, z_v =
  h W_v^T is recomputed (and the reference's r_v = h' W'_v^T for the exact KL), the same
  gradient kernels give dz_v from the saved row statistics, then dW_v = dz_v^T h (one matmul,
  rounded once, as the output layer's own weight gradient) and dh += dz_v W_v (fp32, [N, H]).
  Blocking the vocabulary here, not the tokens, avoids adding a [V, H] product into the weight
  gradient once per token chunk, which costs more than the matmuls on a CPU.
Peak extra memory: one block of logits and its gradient (128 MiB each on CPU, 512 MiB on
GPUs, in the hidden dtype; with the exact KL the reference's block too), the fp32 [N, H] hidden
gradient and the weight gradient itself: `lm_head_peak_bytes` computes it.

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
from megatron_rl.ops.logprob_kl import (_SUPPORTED_DTYPES, TokenLogprobOutput,
                                        _combine_exact_partials, _exact_backend, exact_kl_grad,
                                        exact_kl_grad_accumulate_,
                                        exact_kl_partials, incoming_coefficients, logprob_grad,
                                        logprob_partials, resolve_backend, token_arguments,
                                        token_outputs)

CHUNK_ENV_VAR = "MEGATRON_RL_LM_HEAD_CHUNK_TOKENS"
# Bytes of one logits block (in the hidden dtype) computed at a time: large enough for the
# matmuls to run at full speed, small next to the [N, V] logits it replaces.
CPU_BLOCK_BYTES = 128 << 20
GPU_BLOCK_BYTES = 512 << 20


def _block_bytes(device: torch.device) -> int:
    return CPU_BLOCK_BYTES if device.type == "cpu" else GPU_BLOCK_BYTES


def default_chunk_tokens(vocab_local: int, itemsize: int, device: torch.device) -> int:
    """Forward's tokens per chunk: `MEGATRON_RL_LM_HEAD_CHUNK_TOKENS` when set, else as many
    rows of [V_local] logits as fit in the device's block (at least 1)."""
    env = os.environ.get(CHUNK_ENV_VAR)
    if env:
        return max(1, int(env))
    return max(1, _block_bytes(device) // max(1, vocab_local * itemsize))


def default_vocab_block(num_tokens: int, vocab_local: int, itemsize: int,
                        device: torch.device) -> int:
    """Backward's vocabulary entries per block: as many [N] columns as fit in the block (at
    least 64, at most V_local)."""
    cols = _block_bytes(device) // max(1, num_tokens * itemsize)
    return int(min(vocab_local, max(64, cols)))


# Per-token [N] vectors of the accumulation dtype that one forward+backward holds at most at
# its peak, beyond the blocks: the outputs (log-probs, log-ratio, K3, entropy, exact KL), the
# saved row statistics (2, + 5 for the exact KL), the incoming gradients and their coefficients.
PEAK_TOKEN_VECTORS = 24


def lm_head_peak_bytes(num_tokens: int, hidden_size: int, vocab_local: int, dtype: torch.dtype,
                       device: torch.device | str, *, exact_kl: bool = False,
                       hidden_grad: bool = True, weight_grad: bool = True,
                       chunk_tokens: Optional[int] = None,
                       vocab_block: Optional[int] = None) -> int:
    """Peak bytes one forward + backward of `lm_head_logprobs_and_kl` allocates on top of its
    inputs (hidden, weight, targets, the reference's), with the compiled kernels ("cpu" /
    "cuda" backends, which allocate only their outputs) and the block sizes the op picks on
    `device` (unless given): the gradients it returns and the outputs are counted.

    With N = num_tokens, H = hidden_size, V = vocab_local, s = dtype's bytes, a = the
    accumulation dtype's bytes (4; 8 for float64), k = 2 with the exact KL (the reference's
    logits block too) else 1, c = chunk_tokens, b = vocab_block:

        forward   k c V s                                   (a chunk's logits)
        backward  W + G + max((k + 1) N b s,                (a block's logits and gradient)
                              N b s + N H s [hidden_grad],  (the block's hidden-gradient term)
                              N H s [hidden_grad, s < a])   (the hidden gradient's cast)
        W = V H s [weight_grad], G = N H a [hidden_grad]
        peak      max(forward, backward) + PEAK_TOKEN_VECTORS N a

    E.g. on a GPU at N = 8192, H = 896, V = 151936 in bf16 with the exact KL: b = 32768
    (512 MiB blocks), 3 x 512 MiB + W 260 MiB + G 28 MiB = 1.78 GiB, against the logits path's
    three [N, V] tensors (logits, reference logits, their gradient) of 2.3 GiB each.

    Not counted: the workspace a CPU matmul's library allocates while it runs (one matmul at a
    time). For 16-bit dtypes it depends on the CPU's oneDNN path: none below AVX-512, per-thread
    blocks under brgemm (AVX-512 with bf16, AMX), and an fp32 copy of the whole output on
    AVX-512 without bf16 (Skylake/Cascade Lake servers: 4 x the largest block's element count,
    e.g. 256 MiB beside a 128 MiB bf16 block). tests/ops/test_lm_head.py bounds it per path.
    """
    device = torch.device(device)
    n, h, v = int(num_tokens), int(hidden_size), int(vocab_local)
    s = torch.empty(0, dtype=dtype).element_size()
    a = torch.empty(0, dtype=reference.compute_dtype(dtype)).element_size()
    k = 2 if exact_kl else 1
    c = min(max(n, 1), chunk_tokens or default_chunk_tokens(v, s, device))
    b = min(v, vocab_block or default_vocab_block(n, v, s, device))
    forward = k * c * v * s if n else 0
    kept = (v * h * s if weight_grad else 0) + (n * h * a if hidden_grad else 0)
    phases = [(k + 1) * n * b * s]
    if hidden_grad:
        phases.append(n * b * s + n * h * s)
        if s < a:
            phases.append(n * h * s)
    backward = kept + max(phases) if (hidden_grad or weight_grad) else 0
    return max(forward, backward) + PEAK_TOKEN_VECTORS * n * a


def _chunks(n: int, size: int):
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[c, V_local] = h [c, H] @ w[V_local, H]^T, contiguous, in h's dtype."""
    return torch.matmul(h, w.t())


class _LMHeadLogprobKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, ref_N, inv_temperature, vocab_start,
                tp_group, with_entropy, backend, ref_hidden_NH, ref_weight_VH, chunk, vocab_block):
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
        global_max, shifted_lse, logprobs, entropy, log_ratio, k3 = token_outputs(
            (row_max, sum_exp, target_z, ent_w), targets_N, vocab_start, weight_VH.shape[0],
            tp_group, with_entropy, ref_N)
        exact_stats, kl = (None,) * 5, None
        if exact:
            if exact_parts:
                stats = [cat(exact_parts, i) for i in range(5)]
            else:
                stats = [row_max.clone() for _ in range(5)]
            exact_stats = _combine_exact_partials(*stats, tp_group=tp_group)
            kl = exact_stats[-1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, global_max, shifted_lse,
                              log_ratio, entropy, ref_hidden_NH, ref_weight_VH, *exact_stats)
        ctx.inv_temperature, ctx.vocab_start, ctx.backend = inv_temperature, vocab_start, backend
        ctx.vocab_block = vocab_block or default_vocab_block(hidden_NH.shape[0], weight_VH.shape[0],
                                                             hidden_NH.element_size(),
                                                             hidden_NH.device)
        return logprobs, log_ratio, k3, entropy, kl

    @staticmethod
    def backward(ctx, g_logprobs, g_log_ratio, g_k3, g_entropy, g_kl=None):
        (hidden_NH, weight_VH, targets_N, global_max, shifted_lse, log_ratio, entropy,
         ref_hidden_NH, ref_weight_VH, *exact_stats) = ctx.saved_tensors
        none = (None,) * 11
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_exact = g_kl is not None and ref_hidden_NH is not None
        use_lp = not (g_logprobs is None and g_log_ratio is None and g_k3 is None
                      and g_entropy is None)
        if not (use_exact or use_lp) or not (want_h or want_w):
            return (None, None) + none
        grad_coef = entropy_grad = None
        if use_lp:
            grad_coef, entropy_grad = incoming_coefficients(g_logprobs, g_log_ratio, g_k3,
                                                            g_entropy, log_ratio, shifted_lse)
        g_kl_N = g_kl.to(exact_stats[-1].dtype).contiguous() if use_exact else None
        acc = reference.compute_dtype(hidden_NH.dtype)
        grad_h = (torch.zeros(hidden_NH.shape, dtype=acc, device=hidden_NH.device) if want_h
                  else None)
        grad_w = torch.empty_like(weight_VH) if want_w else None
        # Vocabulary blocks over all tokens: each block's weight gradient is one matmul,
        # rounded once (no [V, H] accumulation over token chunks); the hidden-state gradient,
        # [N, H], is accumulated over blocks in fp32.
        for v0, v1 in _chunks(weight_VH.shape[0], ctx.vocab_block):
            z = _logits(hidden_NH, weight_VH[v0:v1])
            gz = None
            if use_lp:
                gz = logprob_grad(z, targets_N, ctx.vocab_start + v0, ctx.inv_temperature,
                                  global_max, shifted_lse, grad_coef, entropy_grad,
                                  entropy if entropy_grad is not None else None, ctx.backend)
            if use_exact:
                r = _logits(ref_hidden_NH, ref_weight_VH[v0:v1])
                if gz is None:
                    gz = exact_kl_grad(z, r, *exact_stats, g_kl_N, ctx.exact_backend)
                else:
                    exact_kl_grad_accumulate_(gz, z, r, *exact_stats, g_kl_N, ctx.exact_backend)
                del r
            del z
            if want_h:
                grad_h.add_(torch.matmul(gz, weight_VH[v0:v1]))
            if want_w:
                torch.matmul(gz.t(), hidden_NH, out=grad_w[v0:v1])
            del gz
        if grad_h is not None:
            grad_h = grad_h.to(hidden_NH.dtype)
        return (grad_h, grad_w) + none


def lm_head_logprobs_and_kl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            ref_logprobs: Optional[torch.Tensor] = None, temperature: float = 1.0,
                            vocab_start: int = 0, tp_group=None, return_entropy: bool = False,
                            backend: str = "auto", ref_hidden: Optional[torch.Tensor] = None,
                            ref_weight: Optional[torch.Tensor] = None,
                            chunk_tokens: Optional[int] = None,
                            vocab_block: Optional[int] = None) -> TokenLogprobOutput:
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
        chunk_tokens: forward's rows of logits computed at a time (default:
            `default_chunk_tokens`).
        vocab_block: backward's vocabulary entries computed at a time, over all N tokens
            (default: `default_vocab_block`).

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
        raise ValueError("hidden and weight need one dtype of "
                         f"{[str(d) for d in _SUPPORTED_DTYPES]}; got {hidden.dtype} and "
                         f"{weight.dtype}")
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("the exact KL needs both ref_hidden and ref_weight")
    lead_shape = tuple(targets.shape)
    H, vocab_local = hidden.shape[-1], weight.shape[0]
    hidden_NH = hidden.reshape(-1, H).contiguous()
    targets_N, ref_N = token_arguments(targets, tuple(hidden.shape[:-1]), "hidden",
                                       "the hidden dim", ref_logprobs, temperature, vocab_start,
                                       vocab_local, tp_group, hidden.device, hidden.dtype)
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
    chunk = chunk_tokens or default_chunk_tokens(vocab_local, hidden.element_size(), hidden.device)
    logprobs, log_ratio, k3, entropy, kl = _LMHeadLogprobKL.apply(
        hidden_NH, weight, targets_N, ref_N, 1.0 / float(temperature), int(vocab_start),
        tp_group, bool(return_entropy), concrete, ref_hidden_NH, ref_weight_VH, int(chunk),
        vocab_block)
    reshape = lambda t: None if t is None else t.reshape(lead_shape)  # noqa: E731
    return TokenLogprobOutput(reshape(logprobs), reshape(log_ratio), reshape(k3), reshape(entropy),
                              reshape(kl))


def lm_head_exact_kl(hidden: torch.Tensor, weight: torch.Tensor, ref_hidden: torch.Tensor,
                     ref_weight: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[...] exact per-position KL(pi || pi_ref) from both models' hidden states and output
    layers (`exact_kl` without the logits), differentiable in hidden and weight."""
    import torch.distributed as dist

    # token 0 as a placeholder target (owned by TP rank 0): only the KL is returned
    targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]
    out = lm_head_logprobs_and_kl(hidden, weight, targets, vocab_start=vocab_start,
                                  tp_group=tp_group, ref_hidden=ref_hidden, ref_weight=ref_weight)
    assert out.exact_kl is not None  # given ref_hidden and ref_weight
    return out.exact_kl
