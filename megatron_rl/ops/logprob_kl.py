"""Fused vocab-parallel token log-prob + log-ratio + K3 (+ entropy) op.

Every RL step scores every response token under the policy, the old policy and the reference
model. megatron-core's `vocab_parallel_cross_entropy` does it by converting the logits shard to
fp32 and saving a [tokens, vocab/TP] fp32 softmax for backward. This op instead:

- forward: reads each logits row once (online max / sum-exp per row, chunked), producing
  [N]-sized per-rank partials; across the tensor-parallel group it all-reduces the row max
  (MAX), then one stacked [2 or 3, N] tensor (SUM) with the rescaled sum-exp, the target logit
  (only the owning rank contributes a non-zero) and, for entropy, the rescaled sum p*z;
- backward: recomputes softmax from the saved logits and O(N) fp32 statistics and writes
  grad_logits in one read + one write, with no communication (the gradient w.r.t. a vocab
  shard only needs the global max and normalizer, which every rank holds after forward).

Saved for backward: the logits tensor itself (already alive in the caller) and O(N) fp32
vectors (row max, log-normalizer, log-ratio, entropy), nothing of size [N, V].

Gradient conventions:
- ref_logprobs gets no gradient (it is a constant of the KL penalty, coming from a frozen model).
- Incoming gradients must be identical on all ranks of `tp_group` (true when the loss is
  computed redundantly on each TP rank, as Megatron does); each rank then gets the gradient of
  its own shard.

`exact_kl` (bottom of this file) is the exact per-position KL(pi || pi_ref) of the "exact" KL
estimator, from the policy's and the reference's logits shards, built the same way: per-rank
partials (both row maxima and normalizers, and the KL partial sum) in one pass over both logits,
one MAX and one SUM all-reduce, and a backward that recomputes p and q from the saved logits
(no communication, nothing [N, V] saved).

Three kernels compute the same per-rank partials and gradient: "torch" (reference.py, any
device), "cpu" (csrc/logprob_kl_cpu.cpp) and "cuda" (csrc/logprob_kl_cuda.cu). They are
wrapped as `torch.library.custom_op`s with fake implementations, so torch.compile can trace
the local computation; the collectives sit in the autograd.Function between them.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.ops import reference

BACKENDS = ("auto", "torch", "cpu", "cuda")
BACKEND_ENV_VAR = "MEGATRON_RL_LOGPROB_BACKEND"
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

try:  # The compiled extension is optional: without it everything runs on the torch backend.
    from megatron_rl import _C as _ext
except ImportError:  # pragma: no cover - depends on the build
    _ext = None

_warned_fallback: set = set()


def _warn_fallback_once(key: str, message: str) -> None:
    """Warn once per process and `key` that a kernel falls back to the torch backend."""
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        warnings.warn(message, stacklevel=4)


@dataclass
class TokenLogprobOutput:
    """Per-token results, each shaped like `targets` (fp32; fp64 for fp64 logits).

    logprobs:  log pi(target) under the (temperature-scaled) logits.
    log_ratio: ref_logprobs - logprobs, or None without ref_logprobs.
    k3:        exp(log_ratio) - 1 - log_ratio (the K3 estimator of KL(pi || ref)), or None.
    entropy:   entropy of the full (all TP shards) distribution, or None unless requested.
    exact_kl:  the exact per-position KL(pi || pi_ref) from the reference's logits (see
               `exact_kl`), or None without ref_logits.
    """

    logprobs: torch.Tensor
    log_ratio: Optional[torch.Tensor] = None
    k3: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    exact_kl: Optional[torch.Tensor] = None


def extension_backends() -> tuple:
    """Backends whose compiled kernels are present in this build of megatron_rl._C."""
    if _ext is None:
        return ()
    names = ["cpu"] if hasattr(_ext, "logprob_partials_cpu") else []
    if hasattr(_ext, "logprob_partials_cuda"):
        names.append("cuda")
    return tuple(names)


def resolve_backend(backend: str, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> str:
    """Concrete backend ("torch" | "cpu" | "cuda") for `dtype` tensors on `device`.

    `MEGATRON_RL_LOGPROB_BACKEND` replaces "auto" (an explicit argument wins). "auto" picks the
    compiled kernel for the device when the extension has it (the CUDA kernels take no float64:
    "torch" serves it), else "torch". A forced "cpu" or "cuda" whose kernel is missing from the
    build falls back to "torch" with a one-time warning.
    """
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV_VAR, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown logprob backend {backend!r}; valid: {', '.join(BACKENDS)} "
                         f"(argument `backend` or env {BACKEND_ENV_VAR})")
    available = extension_backends()
    if backend == "auto":
        if device.type == "cuda" and dtype == torch.float64:
            return "torch"
        return device.type if device.type in available else "torch"
    if backend == "torch":
        return backend
    if backend != device.type:
        raise ValueError(f"backend {backend!r} cannot run on {device.type} tensors")
    if backend not in available:
        _warn_fallback_once(backend, f"megatron_rl._C has no {backend!r} logprob kernel "
                            "(extension not built or built without it); using the 'torch' "
                            "backend")
        return "torch"
    return backend


# --------------------------------------------------------------------------------------------
# Per-rank kernels as custom ops (no collectives inside).
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("megatron_rl::logprob_partials", mutates_args=())
def logprob_partials(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                     inv_temperature: float, with_entropy: bool, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_max, sum_exp, target_z, ent_w) for a contiguous [N, V_local] shard; see reference.py."""
    if backend == "cpu":
        return _ext.logprob_partials_cpu(logits, targets, vocab_start, inv_temperature,
                                         with_entropy)
    if backend == "cuda":
        return _ext.logprob_partials_cuda(logits, targets, vocab_start, inv_temperature,
                                          with_entropy)
    return reference.logprob_partials_torch(logits, targets, vocab_start, inv_temperature,
                                            with_entropy)


@logprob_partials.register_fake
def _(logits, targets, vocab_start, inv_temperature, with_entropy, backend):
    acc = reference.compute_dtype(logits.dtype)
    n = logits.shape[0]
    vec = lambda size: logits.new_empty(size, dtype=acc)  # noqa: E731
    return vec(n), vec(n), vec(n), vec(n if with_entropy else 0)


@torch.library.custom_op("megatron_rl::logprob_grad", mutates_args=())
def logprob_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 inv_temperature: float, row_max: torch.Tensor, shifted_lse: torch.Tensor,
                 grad_coef: torch.Tensor, entropy_grad: Optional[torch.Tensor],
                 entropy: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """grad_logits [N, V_local] (logits dtype); see reference.py for the formula."""
    args = (logits, targets, vocab_start, inv_temperature, row_max, shifted_lse, grad_coef,
            entropy_grad, entropy)
    if backend == "cpu":
        return _ext.logprob_grad_cpu(*args)
    if backend == "cuda":
        return _ext.logprob_grad_cuda(*args)
    return reference.logprob_grad_torch(*args)


@logprob_grad.register_fake
def _(logits, targets, vocab_start, inv_temperature, row_max, shifted_lse, grad_coef,
      entropy_grad, entropy, backend):
    return torch.empty_like(logits)


# --------------------------------------------------------------------------------------------
# Combination across the TP group (O(N) work) and the autograd.Function.
# --------------------------------------------------------------------------------------------
def _combine_partials(row_max, sum_exp, target_z, ent_w, owned, tp_group, with_entropy):
    """Global (row_max, shifted_lse, logprobs, entropy|None) from this rank's partials."""
    if tp_group is None:
        global_max = row_max
        target_shifted = torch.where(owned, target_z - row_max, torch.zeros_like(target_z))
        total_exp, total_w = sum_exp, (ent_w if with_entropy else None)
    else:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        delta = reference.safe_delta(row_max, global_max)  # <= 0
        scale = torch.exp(delta)
        parts = [sum_exp * scale,
                 torch.where(owned, target_z - global_max, torch.zeros_like(target_z))]
        if with_entropy:
            # sum_j e^(z-M) (z-M) = e^(m-M) * (ent_w + (m-M) * sum_exp) for this shard's max m.
            parts.append((ent_w + delta * sum_exp) * scale)
        stacked = torch.stack(parts)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        total_exp, target_shifted = stacked[0], stacked[1]
        total_w = stacked[2] if with_entropy else None
    shifted_lse = torch.log(total_exp)
    logprobs = target_shifted - shifted_lse
    entropy = shifted_lse - total_w / total_exp if with_entropy else None
    return global_max, shifted_lse, logprobs, entropy


def token_outputs(partials, targets_N, vocab_start: int, vocab_local: int, tp_group,
                  with_entropy: bool, ref_N):
    """(global_max, shifted_lse, logprobs, entropy | None, log_ratio | None, k3 | None) [N] from
    this rank's partials (row_max, sum_exp, target_z, ent_w), combined over the TP group."""
    owned = (targets_N >= vocab_start) & (targets_N < vocab_start + vocab_local)
    global_max, shifted_lse, logprobs, entropy = _combine_partials(
        *partials, owned=owned, tp_group=tp_group, with_entropy=with_entropy)
    log_ratio = k3 = None
    if ref_N is not None:
        log_ratio = ref_N - logprobs
        k3 = torch.expm1(log_ratio) - log_ratio      # exp(r) - 1 - r, accurate near r = 0
    return global_max, shifted_lse, logprobs, entropy, log_ratio, k3


def incoming_coefficients(g_logprobs, g_log_ratio, g_k3, g_entropy, log_ratio, like):
    """(grad_coef [N], entropy_grad [N] | None) in `like`'s dtype: the per-row coefficients the
    gradient kernels take. Everything flows through log p: d log_ratio / d log p = -1,
    dK3 / d log p = 1 - exp(log_ratio); the entropy has its own term."""
    grad_coef = torch.zeros_like(like)
    if g_logprobs is not None:
        grad_coef = grad_coef + g_logprobs
    if g_log_ratio is not None:
        grad_coef = grad_coef - g_log_ratio
    if g_k3 is not None:
        grad_coef = grad_coef - g_k3 * torch.expm1(log_ratio)
    entropy_grad = None if g_entropy is None else g_entropy.to(like.dtype).contiguous()
    return grad_coef.to(like.dtype).contiguous(), entropy_grad


class _TokenLogprobKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, ref_N, inv_temperature, vocab_start, tp_group,
                with_entropy, backend, ref_logits_NV=None):
        row_max, sum_exp, target_z, ent_w = logprob_partials(
            logits_NV, targets_N, vocab_start, inv_temperature, with_entropy, backend)
        global_max, shifted_lse, logprobs, entropy, log_ratio, k3 = token_outputs(
            (row_max, sum_exp, target_z, ent_w), targets_N, vocab_start, logits_NV.shape[1],
            tp_group, with_entropy, ref_N)
        exact_stats, kl = (None,) * 5, None
        ctx.exact_backend = None
        if ref_logits_NV is not None:  # the exact KL (temperature 1), sharing backward's buffer
            ctx.exact_backend = _exact_backend(backend)
            exact_stats = _combine_exact_partials(
                *exact_kl_partials(logits_NV, ref_logits_NV, ctx.exact_backend),
                tp_group=tp_group)
            kl = exact_stats[-1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_NV, targets_N, global_max, shifted_lse, log_ratio, entropy,
                              ref_logits_NV, *exact_stats)
        ctx.inv_temperature, ctx.vocab_start, ctx.backend = inv_temperature, vocab_start, backend
        return logprobs, log_ratio, k3, entropy, kl

    @staticmethod
    def backward(ctx, g_logprobs, g_log_ratio, g_k3, g_entropy, g_kl=None):
        (logits_NV, targets_N, global_max, shifted_lse, log_ratio, entropy, ref_logits_NV,
         *exact_stats) = ctx.saved_tensors
        exact_grad = None
        if g_kl is not None and ref_logits_NV is not None:
            exact_grad = (ref_logits_NV, *exact_stats,
                          g_kl.to(exact_stats[-1].dtype).contiguous(), ctx.exact_backend)
        if g_logprobs is None and g_log_ratio is None and g_k3 is None and g_entropy is None:
            if exact_grad is None:
                return (None,) * 9
            return (exact_kl_grad(logits_NV, *exact_grad),) + (None,) * 8
        grad_coef, entropy_grad = incoming_coefficients(g_logprobs, g_log_ratio, g_k3, g_entropy,
                                                        log_ratio, shifted_lse)
        grad_logits = logprob_grad(logits_NV, targets_N, ctx.vocab_start, ctx.inv_temperature,
                                   global_max, shifted_lse, grad_coef, entropy_grad,
                                   entropy if entropy_grad is not None else None, ctx.backend)
        if exact_grad is not None:  # added in place: one [N, V] gradient buffer for both terms
            exact_kl_grad_accumulate_(grad_logits, logits_NV, *exact_grad)
        return grad_logits, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------------------------
def token_arguments(targets: torch.Tensor, lead_shape: tuple, what: str, last_dim: str,
                    ref_logprobs: Optional[torch.Tensor], temperature: float, vocab_start: int,
                    vocab_local: int, tp_group, device: torch.device, dtype: torch.dtype):
    """(targets_N long, ref_N in the compute dtype or None): the per-token arguments shared by
    the logits and the hidden-state ops, checked (a ValueError naming the argument)."""
    if tuple(targets.shape) != lead_shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal {what} shape without "
                         f"{last_dim} {lead_shape}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets_N = targets.reshape(-1).to(torch.long).contiguous()
    ref_N = None
    if ref_logprobs is not None:
        if tuple(ref_logprobs.shape) != lead_shape:
            raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} must equal targets "
                             f"shape {lead_shape}")
        ref_N = ref_logprobs.detach().reshape(-1).to(reference.compute_dtype(dtype)).contiguous()
    if tp_group is None and device.type == "cpu" and targets_N.numel() > 0:
        # Cheap on CPU (no device sync): out-of-range ids would silently give log p = -lse.
        if bool(((targets_N < vocab_start) | (targets_N >= vocab_start + vocab_local)).any()):
            raise ValueError(f"targets must lie in [{vocab_start}, {vocab_start + vocab_local}) "
                             f"when tp_group is None")
    return targets_N, ref_N


def token_logprobs_and_kl(logits: torch.Tensor, targets: torch.Tensor, *,
                          ref_logprobs: Optional[torch.Tensor] = None, temperature: float = 1.0,
                          vocab_start: int = 0, tp_group=None, return_entropy: bool = False,
                          backend: str = "auto",
                          ref_logits: Optional[torch.Tensor] = None) -> TokenLogprobOutput:
    """Token log-probs of `targets`, and optionally log-ratio / K3 to a reference and entropy.

    Args:
        logits: [..., V_local] bf16/fp16/fp32 (fp64 for testing): this rank's vocab shard
            [vocab_start, vocab_start + V_local). -inf masks an entry (probability 0, no
            gradient); a NaN makes its row's outputs NaN. Non-contiguous logits (e.g.
            `logits[:, :-1]`) are copied once, and that copy is what backward keeps: to avoid
            it, pass contiguous logits with shifted targets and mask the last position.
        targets: [...] global token ids (any integer dtype); each must lie in exactly one
            rank's shard. Masked positions should hold any valid id and be masked in the loss.
        ref_logprobs: [...] reference-model log-probs (no gradient flows into them).
        temperature: logits are divided by it before the softmax.
        vocab_start: first global vocab id of this shard (Megatron: tp_rank * V_local).
        tp_group: tensor-parallel process group over which the vocab is sharded
            (Megatron: parallel_state.get_tensor_model_parallel_group()); None = full vocab.
        return_entropy: also return the per-token entropy (differentiable).
        backend: "auto" | "torch" | "cpu" | "cuda"; see `resolve_backend`.
        ref_logits: [..., V_local] the reference model's logits over the same shard: also
            return `exact_kl`, the exact per-position KL(pi || pi_ref) at temperature 1 (see
            `exact_kl`; the same numbers), differentiable in `logits`. Its backward adds its
            gradient into the log-prob op's gradient buffer in place (peak memory: one [N, V]
            gradient, as without it), where calling `exact_kl` separately makes a second one
            and autograd a third for the sum.

    Returns:
        TokenLogprobOutput with [...]-shaped fp32 tensors (fp64 for fp64 logits).
    """
    if logits.dim() < 1:
        raise ValueError("logits must have shape [..., V_local]")
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} not supported; use one of "
                         f"{[str(d) for d in _SUPPORTED_DTYPES]}")
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocab dim")
    lead_shape = tuple(targets.shape)
    vocab_local = logits.shape[-1]
    logits_NV = logits.reshape(-1, vocab_local).contiguous()
    targets_N, ref_N = token_arguments(targets, tuple(logits.shape[:-1]), "logits",
                                       "the vocab dim", ref_logprobs, temperature, vocab_start,
                                       vocab_local, tp_group, logits.device, logits.dtype)
    concrete = resolve_backend(backend, logits.device, logits.dtype)
    ref_logits_NV = None
    if ref_logits is not None:
        if tuple(ref_logits.shape) != tuple(logits.shape):
            raise ValueError(f"ref_logits shape {tuple(ref_logits.shape)} must equal logits "
                             f"shape {tuple(logits.shape)}")
        if temperature != 1.0:
            raise ValueError("the exact KL (ref_logits) is defined at temperature 1")
        ref_logits_NV = ref_logits.detach().to(logits.dtype).reshape(-1, vocab_local).contiguous()

    logprobs, log_ratio, k3, entropy, kl = _TokenLogprobKL.apply(
        logits_NV, targets_N, ref_N, 1.0 / float(temperature), int(vocab_start), tp_group,
        bool(return_entropy), concrete, ref_logits_NV)
    reshape = lambda t: None if t is None else t.reshape(lead_shape)  # noqa: E731
    return TokenLogprobOutput(reshape(logprobs), reshape(log_ratio), reshape(k3), reshape(entropy),
                              reshape(kl))


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                            vocab_start: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """[...] fp32 log-probs of `targets` under vocab-sharded `logits` [..., V_local].

    The one vocab-parallel log-prob used by training, reference scoring and evaluation.
    With Megatron: tp_group=parallel_state.get_tensor_model_parallel_group(),
    vocab_start=parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1].
    """
    return token_logprobs_and_kl(logits, targets, temperature=temperature,
                                 vocab_start=vocab_start, tp_group=tp_group).logprobs


# --------------------------------------------------------------------------------------------
# The exact per-position KL(pi || pi_ref) from both full distributions ("exact" estimator).
# --------------------------------------------------------------------------------------------
def _exact_backend(backend: str) -> str:
    """`backend` (concrete, from resolve_backend), or "torch" when the extension was built
    before the exact-KL kernels existed (a stale build: warned once)."""
    if backend in ("cpu", "cuda") and not hasattr(_ext, f"exact_kl_partials_{backend}"):
        _warn_fallback_once(f"exact:{backend}", f"megatron_rl._C has no {backend!r} exact-KL "
                            "kernel (rebuild the extension); using the 'torch' backend")
        return "torch"
    return backend


@torch.library.custom_op("megatron_rl::exact_kl_partials", mutates_args=())
def exact_kl_partials(logits: torch.Tensor, ref_logits: torch.Tensor, backend: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor]:
    """(max_p, sum_p, max_q, sum_q, w) for contiguous [N, V_local] shards; see reference.py."""
    if backend == "cpu":
        return _ext.exact_kl_partials_cpu(logits, ref_logits)
    if backend == "cuda":
        return _ext.exact_kl_partials_cuda(logits, ref_logits)
    return reference.exact_kl_partials_torch(logits, ref_logits)


@exact_kl_partials.register_fake
def _(logits, ref_logits, backend):
    acc = reference.compute_dtype(logits.dtype)
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=acc) for _ in range(5))


@torch.library.custom_op("megatron_rl::exact_kl_grad", mutates_args=())
def exact_kl_grad(logits: torch.Tensor, ref_logits: torch.Tensor, max_p: torch.Tensor,
                  lse_p: torch.Tensor, max_q: torch.Tensor, lse_q: torch.Tensor,
                  kl: torch.Tensor, grad_kl: torch.Tensor, backend: str) -> torch.Tensor:
    """grad w.r.t. the policy logits [N, V_local] (logits dtype); see reference.py."""
    args = (logits, ref_logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, None)
    if backend == "cpu":
        return _ext.exact_kl_grad_cpu(*args)
    if backend == "cuda":
        return _ext.exact_kl_grad_cuda(*args)
    return reference.exact_kl_grad_torch(*args)


@exact_kl_grad.register_fake
def _(logits, ref_logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, backend):
    return torch.empty_like(logits)


@torch.library.custom_op("megatron_rl::exact_kl_grad_accumulate_", mutates_args=("grad",))
def exact_kl_grad_accumulate_(grad: torch.Tensor, logits: torch.Tensor, ref_logits: torch.Tensor,
                              max_p: torch.Tensor, lse_p: torch.Tensor, max_q: torch.Tensor,
                              lse_q: torch.Tensor, kl: torch.Tensor, grad_kl: torch.Tensor,
                              backend: str) -> None:
    """grad += the exact-KL gradient, in place (shares the log-prob op's gradient buffer)."""
    args = (logits, ref_logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, grad)
    if backend == "cpu":
        _ext.exact_kl_grad_cpu(*args)
    elif backend == "cuda":
        _ext.exact_kl_grad_cuda(*args)
    else:
        reference.exact_kl_grad_torch(*args)


@exact_kl_grad_accumulate_.register_fake
def _(grad, logits, ref_logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, backend):
    return None


def _combine_exact_partials(max_p, sum_p, max_q, sum_q, w, tp_group):
    """Global (max_p, lse_p, max_q, lse_q, kl) from this rank's partials: one MAX all-reduce of
    the two row maxima, one SUM all-reduce of the three rescaled sums."""
    if tp_group is not None:
        maxes = torch.stack([max_p, max_q])
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=tp_group)
        delta_p = reference.safe_delta(max_p, maxes[0])  # <= 0
        delta_q = reference.safe_delta(max_q, maxes[1])
        scale_p = torch.exp(delta_p)
        # sum_j e^(z-M_p) ((z-M_p) - (r-M_q)) = e^(m_p-M_p) (w + (delta_p - delta_q) sum_p)
        # w = +inf (a policy entry where the reference is masked) stays +inf, also where
        # scale_p underflows to 0; as in the kernels' merges
        w_scaled = torch.where(w == float("inf"), w, (w + (delta_p - delta_q) * sum_p) * scale_p)
        stacked = torch.stack([sum_p * scale_p, sum_q * torch.exp(delta_q), w_scaled])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
        max_p, max_q = maxes[0], maxes[1]
        sum_p, sum_q, w = stacked[0], stacked[1], stacked[2]
    lse_p, lse_q = torch.log(sum_p), torch.log(sum_q)
    kl = w / sum_p - lse_p + lse_q
    return max_p, lse_p, max_q, lse_q, kl


class _ExactKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, ref_NV, tp_group, backend):
        partials = exact_kl_partials(logits_NV, ref_NV, backend)
        max_p, lse_p, max_q, lse_q, kl = _combine_exact_partials(*partials, tp_group=tp_group)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_NV, ref_NV, max_p, lse_p, max_q, lse_q, kl)
        ctx.backend = backend
        return kl

    @staticmethod
    def backward(ctx, g_kl):
        if g_kl is None:
            return None, None, None, None
        logits_NV, ref_NV, max_p, lse_p, max_q, lse_q, kl = ctx.saved_tensors
        grad = exact_kl_grad(logits_NV, ref_NV, max_p, lse_p, max_q, lse_q, kl,
                             g_kl.to(kl.dtype).contiguous(), ctx.backend)
        return grad, None, None, None


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor, *, tp_group=None,
             backend: str = "auto") -> torch.Tensor:
    """The exact per-position KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v), p = softmax(logits),
    q = softmax(ref_logits), over the full (all TP shards) vocabulary, without sampling noise.

    Args:
        logits: [..., V_local] policy logits (bf16/fp16/fp32; fp64 for testing), this rank's vocab
            shard. -inf masks an entry (p_v = 0 adds 0, whatever q_v; a policy entry that is
            not masked where the reference's is makes the KL +inf, however small p_v); a NaN
            makes its row's KL NaN. Differentiable: d KL / d z_v = p_v (log p_v - log q_v - KL).
        ref_logits: the reference model's logits over the same shard, same shape; frozen (no
            gradient flows into them). Cast to the logits dtype if it differs (a copy).
        tp_group: tensor-parallel group over which the vocab is sharded; None = full vocab.
            Forward does one MAX all-reduce ([2, N]: both row maxima) and one SUM all-reduce
            ([3, N]: both normalizers and the KL partial sum); backward communicates nothing.
        backend: as in token_logprobs_and_kl ("auto" | "torch" | "cpu" | "cuda").

    Returns: [...] KL per row, fp32 (fp64 for fp64 logits). Rounding can make it -O(1e-7) where
    the two distributions coincide. Saved for backward: both logits tensors (alive in the
    caller anyway: the reference's are its forward output) and five [N] statistics; nothing of
    size [N, V] is computed in forward or kept, backward recomputes p and q from the logits.
    Non-contiguous inputs are copied once (pass contiguous logits and slice the result).
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError("logits must have shape [..., V_local] with V_local > 0")
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} not supported; use one of "
                         f"{[str(d) for d in _SUPPORTED_DTYPES]}")
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(f"ref_logits shape {tuple(ref_logits.shape)} must equal logits shape "
                         f"{tuple(logits.shape)}")
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits on {ref_logits.device}, logits on {logits.device}")
    lead_shape = tuple(logits.shape[:-1])
    vocab_local = logits.shape[-1]
    logits_NV = logits.reshape(-1, vocab_local).contiguous()
    ref_NV = ref_logits.detach().to(logits.dtype).reshape(-1, vocab_local).contiguous()
    concrete = _exact_backend(resolve_backend(backend, logits.device, logits.dtype))
    kl = _ExactKL.apply(logits_NV, ref_NV, tp_group, concrete)
    return kl.reshape(lead_shape)
