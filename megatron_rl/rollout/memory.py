"""A rollout server's GPU memory budget: its share of the GPU split into weights, a reserve, and
the KV cache that is left, and whether that KV cache holds one request of full length.

    share     = utilization x GPU total                  (--rollout-gpu-memory-utilization)
    weights   = parameters x dtype bytes / TP
    kv        = share - weights - reserve
    per token = 2 (K and V) x layers x ceil(KV heads / TP) x head_dim x dtype bytes
    tokens    = kv // per token       (must be >= context: one request of full length)

`share` is what vLLM's --gpu-memory-utilization means: the whole server's part of the GPU's
total memory (weights, KV cache, activations, CUDA graphs); vLLM sizes its KV cache as the share
less what its profiling run measured, and refuses to start when one request of --max-model-len
tokens does not fit. SGLang counts differently (factory.py converts: its --mem-fraction-static
is weights + KV cache over the memory free when it starts, which it caps with
--max-total-tokens). The reserve is an estimate of what a server holds besides weights and KV
cache for a 4-8 B model at the servers' default batch sizes: the CUDA context with cuBLAS and
NCCL workspaces (~0.5 GiB), the activation and sampler peak of the profiling forward (~1.5 GiB),
and CUDA graphs (~1 GiB).
"""

from __future__ import annotations

import dataclasses
import math

GiB = 1 << 30
SERVER_RESERVE_BYTES = 3 * GiB


@dataclasses.dataclass(frozen=True)
class ServerMemory:
    """One server's budget on one GPU (bytes; see the module docstring).

    share_bytes: utilization x the GPU's total memory. weights_bytes: its weights on this GPU.
    reserve_bytes: what it holds besides weights and KV cache. kv_bytes_per_token: one token's
    keys and values over all layers. context_len: tokens of one full-length request.
    """

    share_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_bytes_per_token: int
    context_len: int

    @property
    def kv_bytes(self) -> int:
        """The KV cache the share leaves (negative: not even the weights and reserve fit)."""
        return self.share_bytes - self.weights_bytes - self.reserve_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return max(0, self.kv_bytes) // self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        """The KV cache holds one request of context_len tokens."""
        return self.kv_tokens >= self.context_len

    def sglang_args(self) -> tuple[float, int]:
        """(--mem-fraction-static, --max-total-tokens) that make an SGLang server keep to this
        budget. SGLang sizes its KV pool as mem_fraction_static x (memory free when it starts)
        - weights, capped at max_total_tokens; with the fraction = (weights + KV cache) / share
        and the cap = kv_tokens, the pool is kv_tokens whenever the share was free at its start
        (shared with the trainer or not). At least one request of context_len tokens."""
        tokens = max(self.kv_tokens, self.context_len)
        static = self.weights_bytes + tokens * self.kv_bytes_per_token
        return math.ceil(1e4 * static / self.share_bytes) / 1e4, tokens

    def describe(self) -> str:
        return (f"share {self.share_bytes / GiB:.1f} GiB = weights {self.weights_bytes / GiB:.1f}"
                f" + reserve {self.reserve_bytes / GiB:.1f} (CUDA context, activations, CUDA "
                f"graphs) + KV cache {self.kv_bytes / GiB:.2f} GiB ({self.kv_bytes_per_token} "
                f"B per token: {self.kv_tokens} tokens, {self.kv_tokens // self.context_len} "
                f"requests of {self.context_len} tokens at a time)")


def server_memory(*, num_layers: int, num_kv_heads: int, head_dim: int, num_params: int,
                  dtype_bytes: int, gpu_bytes: int, utilization: float, context_len: int,
                  tp_size: int = 1, reserve_bytes: int = SERVER_RESERVE_BYTES) -> ServerMemory:
    """The budget of a server that takes `utilization` of a GPU of `gpu_bytes`, serving a model
    of `num_params` parameters and `num_layers` attention layers of `num_kv_heads` KV heads of
    `head_dim`, weights and KV cache in a dtype of `dtype_bytes`, split over `tp_size` GPUs
    (each holds 1/tp of the weights and ceil(heads / tp) KV heads), for requests of up to
    `context_len` tokens."""
    heads = -(-num_kv_heads // tp_size)
    return ServerMemory(share_bytes=int(utilization * gpu_bytes),
                        weights_bytes=-(-num_params * dtype_bytes // tp_size),
                        reserve_bytes=reserve_bytes,
                        kv_bytes_per_token=2 * num_layers * heads * head_dim * dtype_bytes,
                        context_len=context_len)


def model_server_memory(args, *, dtype_bytes: int, gpu_bytes: int, utilization: float,
                        context_len: int, tp_size: int = 1,
                        reserve_bytes: int = SERVER_RESERVE_BYTES) -> ServerMemory:
    """`server_memory` for the model `args` (a models.ModelArgs): its layers, KV heads, head dim
    and parameter count (the HF checkpoint's tensors)."""
    from megatron_rl.models.hf_mapping import hf_expected_shapes

    num_params = sum(math.prod(s) for s in hf_expected_shapes(args).values())
    return server_memory(num_layers=args.num_hidden_layers, num_kv_heads=args.num_key_value_heads,
                         head_dim=args.head_dim, num_params=num_params, dtype_bytes=dtype_bytes,
                         gpu_bytes=gpu_bytes, utilization=utilization, context_len=context_len,
                         tp_size=tp_size, reserve_bytes=reserve_bytes)
