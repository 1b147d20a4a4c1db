"""The policy: a megatron-core `GPTModel` for Qwen2 / Qwen3 / Llama checkpoints.

Layer spec: TransformerEngine layers when TE is installed (GPU), otherwise megatron-core's local
spec with the core attention replaced by `SDPAttention`, a `scaled_dot_product_attention` module
that runs on CPU and GPU alike (megatron-core's own DotProductAttention needs CUDA buffers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.models.config import ModelArgs, transformer_config


def _transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
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


def layer_spec(args: ModelArgs, use_te: bool | None = None):
    """megatron-core layer spec for `args` (TE on GPU when available, else local + SDPA)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = _transformer_engine_available()
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm",
                                                    qk_layernorm=args.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec


def build_gpt_model(args: ModelArgs, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    params_dtype: torch.dtype = torch.float32, pre_process: bool | None = None,
                    post_process: bool | None = None, use_te: bool | None = None, **overrides):
    """Build this rank's stage of the GPT policy (model-parallel groups must be initialised).

    Returns a megatron-core GPTModel whose forward(input_ids [b, s], position_ids [b, s],
    attention_mask=None) returns vocab-parallel logits [b, s, V/TP] on the last pipeline stage
    (hidden states [s, b, h] elsewhere).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(args, tensor_parallel=tensor_parallel,
                                pipeline_parallel=pipeline_parallel, params_dtype=params_dtype,
                                **overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, use_te),
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
    if torch.cuda.is_available():
        model = model.cuda()
    return model
