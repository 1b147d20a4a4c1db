"""The policy: a megatron-core `GPTModel` for Qwen2 / Qwen3 / Llama checkpoints.

Layer spec: TransformerEngine layers when TE is installed (GPU), otherwise megatron-core's local
spec with the core attention replaced by `SDPAttention`, a `scaled_dot_product_attention` module
that runs on CPU and GPU alike (megatron-core's own DotProductAttention needs CUDA buffers).
`ModelOptions.attention_backend` (--attention-backend) chooses between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.models.config import ModelArgs, ModelOptions, te_available, transformer_config


def use_transformer_engine(options: ModelOptions | None) -> bool:
    """The layer spec --attention-backend asks for: TE (True) or local + SDPA (False)."""
    backend = (options or ModelOptions()).attention_backend
    if backend == "local":
        return False
    if backend == "auto":
        return te_available()
    if not te_available():
        raise ValueError(f"--attention-backend {backend} is a TransformerEngine backend, and TE is "
                         "not installed on a CUDA machine here; use auto or local")
    return True


def _sdpa_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Core attention on `F.scaled_dot_product_attention`.

        Inputs: query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng query groups, this TP rank's
        heads); output [sq, b, np * hn]. Grouped-query attention: query head i reads KV group
        i // (np / ng) (SDPA's enable_gqa, no copy of the keys). The
        causal mask is aligned bottom-right so that a query block at the end of the keys
        (KV-cache decoding, sq < sk) attends to every earlier key. An explicit boolean
        `attention_mask` (True = masked out, megatron's convention) is honoured as well.

        Kernels on CUDA: nothing here pins a backend, so SDPA dispatches to flash attention for
        fp16/bf16 causal calls without a mask (flash takes grouped KV heads as they are). Where
        flash cannot run (fp32, or an explicit mask), the memory-efficient kernel can, but it
        does not take grouped KV heads: there the KV heads are repeated to the query heads so
        that SDPA does not fall back to its math path.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("SDPAttention supports neither packed sequences nor "
                                          "attention bias")
            sq, b, n_heads, head_dim = query.shape
            sk, gqa = key.shape[0], n_heads != key.shape[2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            mask = None
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                mask = ~attention_mask[..., -sq:, -sk:]
            flash_ok = mask is None and sq == sk and q.dtype in (torch.float16, torch.bfloat16)
            if gqa and q.is_cuda and not flash_ok:
                rep = n_heads // key.shape[2]
                k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
            if mask is None and sq == sk:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
            else:
                causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
                mask = causal if mask is None else (mask & causal)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)

    return SDPAttention


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for the local spec: megatron-core's WrappedTorchNorm (the same module,
    torch_norm.py:36-51) without its refusal of sequence parallelism (torch_norm.py:32), and
    with its weight in the model's parameter dtype, like megatron's other norms (the wrapped
    one is always fp32, which makes bf16 activations miss the fused kernel).

    Under sequence parallelism each TP rank normalises its own slice of the sequence, so the
    weight's gradient is a partial sum: the weight is marked `sequence_parallel`, and
    megatron's finalize_model_grads sums it over the TP ranks (finalize_model_grads.py:354), as
    it does for TransformerEngine's and apex's norms."""

    mark_sequence_parallel = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm=False,
                 zero_centered_gamma=False, normalization="RMSNorm"):
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError("megatron_rl's local norm is a plain RMSNorm")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        if self.mark_sequence_parallel:
            self.weight.sequence_parallel = bool(config.sequence_parallel)


class HeadRMSNorm(RMSNorm):
    """Qwen3's per-head q/k RMSNorm: it runs after the column-parallel QKV projection, on the
    whole sequence and this rank's heads; finalize_model_grads sums its gradient over TP for
    every qk_layernorm model (finalize_model_grads.py:355), so it carries no SP mark."""

    mark_sequence_parallel = False


def layer_spec(args: ModelArgs, use_te: bool | None = None):
    """megatron-core layer spec for `args` (TE on GPU when available, else local + SDPA)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = use_transformer_engine(None)
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm",
                                                    qk_layernorm=args.qk_norm)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = _sdpa_attention_class()
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if args.qk_norm:
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return spec


def build_gpt_model(args: ModelArgs, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    options: ModelOptions | None = None, pre_process: bool | None = None,
                    post_process: bool | None = None, use_te: bool | None = None, **overrides):
    """Build this rank's stage of the GPT policy (model-parallel groups must be initialised).

    Returns a megatron-core GPTModel whose forward(input_ids [b, s], position_ids [b, s],
    attention_mask=None) returns vocab-parallel logits [b, s, V/TP] on the last pipeline stage
    (hidden states [s, b, h] elsewhere; [s/TP, b, h] under sequence parallelism, where s must
    be a multiple of TP).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.config import cuda_present

    if use_te is None:
        use_te = use_transformer_engine(options)
    config = transformer_config(args, tensor_parallel=tensor_parallel,
                                pipeline_parallel=pipeline_parallel, params_dtype=params_dtype,
                                sequence_parallel=sequence_parallel, options=options,
                                use_te=use_te, **overrides)
    spec = layer_spec(args, use_te)
    if not use_te:  # the final norm too (megatron picks WrappedTorchNorm without apex)
        from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                                 get_num_layers_to_build)

        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                          layer_norm=RMSNorm)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=args.rope_theta,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
    )
    if cuda_present():
        from megatron_rl.parallel import device

        model = model.to(device())
    return model
