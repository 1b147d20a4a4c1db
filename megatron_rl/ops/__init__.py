"""Fused, vocab-parallel token log-prob / log-ratio / K3 op and its backends.

`vocab_parallel_logprobs` is the one vocab-parallel log-prob used by training, reference
scoring and evaluation; `token_logprobs_and_kl` also returns the log-ratio and K3 to reference
log-probs and, on request, the entropy; `exact_kl` is the exact per-position KL(pi || pi_ref)
from the policy's and the reference's logits (the "exact" KL estimator). Backends: "torch"
(reference.py, any device), "cpu" and "cuda" (csrc/, in the optional `megatron_rl._C`
extension); see logprob_kl.py. `lm_head_logprobs_and_kl` computes the same from the final hidden
states and the output-layer weight, chunk by chunk, without the [N, V] logits (lm_head.py).
"""
from megatron_rl.ops.logprob_kl import (
    BACKEND_ENV_VAR,
    BACKENDS,
    TokenLogprobOutput,
    exact_kl,
    extension_backends,
    resolve_backend,
    token_logprobs_and_kl,
    vocab_parallel_logprobs,
)
from megatron_rl.ops.lm_head import lm_head_exact_kl, lm_head_logprobs_and_kl

__all__ = [
    "BACKEND_ENV_VAR",
    "BACKENDS",
    "TokenLogprobOutput",
    "exact_kl",
    "extension_backends",
    "lm_head_exact_kl",
    "lm_head_logprobs_and_kl",
    "resolve_backend",
    "token_logprobs_and_kl",
    "vocab_parallel_logprobs",
]
