"""The policy: a megatron-core `GPTModel` for Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoints.

Layer spec: TransformerEngine layers when TE is installed (GPU), otherwise megatron-core's local
spec with the core attention replaced by `SDPAttention`, a `scaled_dot_product_attention` module
that runs on CPU and GPU alike (megatron-core's own DotProductAttention needs CUDA buffers).
`ModelOptions.attention_backend` (--attention-backend) chooses between them. Mixture-of-experts
models (Qwen3-MoE) are built on the local spec only: megatron-core's MoELayer (router,
allgather dispatcher, SequentialMLP experts) in the sparse layers, the dense MLP in the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.models import packed_attention
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


def make_packed_seq_params(seq_lens: Sequence[int], total_len: int,
                           device: torch.device | str | None = None):
    """megatron-core PackedSeqParams for one packed row: sequences of `seq_lens` tokens laid end
    to end from position 0, then padding up to `total_len` tokens.

    The padding, when there is any, is a segment of its own, so cu_seqlens ends at `total_len`
    (cu_seqlens [n + 1] or [n + 2], int32, on `device`, by default this rank's: TE's attention
    reads it on the GPU). max_seqlen is the longest segment, the
    padding's included: megatron builds the RoPE table with that many positions
    (rotary_pos_embedding.py:241), and its unfused THD RoPE reads a table exactly as long as the
    row as absolute positions (rope_utils.py:211), which would continue positions across
    sequences.
    """
    from megatron_rl.parallel import device as rank_device

    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"seq_lens must be positive lengths, got {lens}")
    if sum(lens) > total_len:
        raise ValueError(f"the sequences take {sum(lens)} tokens, more than total_len={total_len}")
    if total_len > sum(lens):
        lens.append(total_len - sum(lens))
    bounds = [0, *itertools.accumulate(lens)]
    return thd_params(torch.tensor(bounds, dtype=torch.int32), max(lens),
                      rank_device() if device is None else device, bounds=bounds)


def thd_params(cu_seqlens: torch.Tensor, max_seqlen: int, device,
               bounds: Sequence[int] | None = None):
    """PackedSeqParams (qkv_format "thd") for self-attention over the segments `cu_seqlens`
    (int32 on `device`), whose longest is `max_seqlen` tokens (see make_packed_seq_params).
    bounds: the values of cu_seqlens, when the caller has them on the host; SDPAttention then
    reads nothing back from the device (else it reads cu_seqlens once per forward, see
    `packed_segment_bounds`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    m = int(max_seqlen)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=m, max_seqlen_kv=m)
    if bounds is not None:
        _host_values(params, cu, [int(b) for b in bounds])
    return params


def _host_values(params, cu: torch.Tensor, known: list[int] | None = None) -> list[int]:
    """The values of `cu` (a cu_seqlens tensor of `params`) on the host, read from the device
    at most once per params object: every layer's attention in a forward gets the same
    PackedSeqParams, so the read (a host synchronisation on a GPU) happens in the first layer
    only. Kept on the object itself with the tensor's version counter, so an in-place change of
    the tensor is read again. `known`: the values, from a caller that has them on the host."""
    cache = params.__dict__.setdefault("_megatron_rl_host_values", {})
    hit = cache.get(id(cu))
    if known is None and hit is not None and hit[0] is cu and hit[1] == cu._version:
        return hit[2]
    values = known if known is not None else [int(b) for b in cu.tolist()]
    cache[id(cu)] = (cu, cu._version, values)
    return values


def _segment_cu_seqlens(params) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (query, key) boundaries a THD row's segments are attended within: the padded
    cu_seqlens where set, else the plain ones (see `packed_segment_bounds`)."""
    def chosen(padded, plain):
        return padded if padded is not None else plain

    return (chosen(params.cu_seqlens_q_padded, params.cu_seqlens_q),
            chosen(params.cu_seqlens_kv_padded, params.cu_seqlens_kv))


def packed_segment_bounds(params, num_tokens: int, *, check_rope: bool = True) -> list[int]:
    """Segment boundaries of a THD row of `num_tokens` tokens: cu_seqlens_q_padded where set,
    else cu_seqlens_q, the same boundaries megatron's RoPE restarts positions at
    (attention.py:1081-1089), read to the host once per `params` (`_host_values`). Raises
    ValueError for boundaries that do not cover the row and, with `check_rope`, for a max_seqlen
    equal to the row length with several segments (megatron's unfused RoPE then continues
    positions across them, rope_utils.py:211); NotImplementedError for key boundaries other than
    the query's (cross-attention)."""
    cu_q, cu_kv = _segment_cu_seqlens(params)
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for the thd format")
    bounds = list(_host_values(params, cu_q))
    if cu_kv is not None and cu_kv is not cu_q and _host_values(params, cu_kv) != bounds:
        raise NotImplementedError("SDPAttention packs self-attention only: cu_seqlens_kv must "
                                  "equal cu_seqlens_q")
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens
            or any(b < a for a, b in itertools.pairwise(bounds))):
        raise ValueError(f"cu_seqlens must rise from 0 to the {num_tokens} tokens of the packed "
                         f"row (padding is a last segment of its own), got {bounds}")
    segments = sum(b > a for a, b in itertools.pairwise(bounds))
    rope_len = max(int(params.max_seqlen_q or 0), int(params.max_seqlen_kv or 0))
    if check_rope and segments > 1 and rope_len == num_tokens:
        raise ValueError(f"max_seqlen_q/kv = {rope_len} is the whole packed row: megatron's RoPE "
                         "would then continue positions across its sequences; set it to the "
                         "longest segment (make_packed_seq_params does)")
    return bounds


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

        Packed rows (`packed_seq_params`, qkv_format "thd"): megatron's SelfAttention squeezes
        the batch of one away (attention.py:1066-1069) and has already applied RoPE from 0 in
        every segment, so query is [t, np, hn], key/value [t, ng, hn]; the output is
        [t, np * hn] (megatron views it as [t, 1, np * hn], attention.py:1189-1194). Each
        segment of cu_seqlens (cu_seqlens_q_padded where set, see `packed_segment_bounds`) is
        attended causally on its own. Tokens of a padded slot after its sequence only see keys
        before them, so the sequence's outputs are those of the sequence alone. Two
        implementations (models/packed_attention.py), chosen by `packed_attention_fn`:
        - fp16/bf16 on a CUDA device (flash attention's): one call of torch's `varlen_attn`
          per layer over the whole row, the cu_seqlens tensor as it is on the device and the
          longest segment from the boundaries on the host. Its launches do not depend on the
          number of sequences, and with host boundaries (make_packed_seq_params) nothing is
          read back from the device;
        - elsewhere (the CPU; fp32 on a GPU): one SDPA call per segment, a Python loop.

        Why a loop on the CPU and not one call with a block-diagonal causal mask: per segment,
        the work is sum(len_i^2) instead of t^2, the call stays maskless and causal (the CPU's
        flash kernel), and no [t, t] mask is built. Measured
        on this 2-core CPU (torch 2.13, one thread), 16 segments of long-tailed lengths (1400
        down to 34) summing to 4096 tokens, 14 query heads and 2 KV heads of 64 dims, best of
        3; memory is the extra peak RSS of the first call:

            dtype  pass      loop            block-diagonal mask
            fp32   fwd        77 ms,  32 MiB   591 ms, 101 MiB
            fp32   fwd+bwd   258 ms,  85 MiB  1759 ms, 189 MiB
            bf16   fwd        28 ms,  14 MiB   249 ms,  58 MiB
            bf16   fwd+bwd   222 ms, 135 MiB  1166 ms, 136 MiB

        The loop is 4-9x faster (a second run on the shared machine gave the same but for the
        fp32 loop's fwd+bwd, 436 ms) and needs no more memory: the CPU's flash kernel takes the
        mask block by block, so the mask's cost is its own [t, t] bytes (three temporaries to
        build it) and the work on blocks that the loop skips.

        Kernels on CUDA, unpacked and in the loop: nothing here pins a backend, so SDPA
        dispatches to flash attention for fp16/bf16 causal calls without a mask (flash takes
        grouped KV heads as they are). Where flash cannot run (fp32, or an explicit mask), the
        memory-efficient kernel can, but it does not take grouped KV heads: there the KV heads
        are repeated to the query heads so that SDPA does not fall back to its math path.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if attention_bias is not None:
                raise NotImplementedError("SDPAttention does not support attention bias")
            if packed_seq_params is not None:
                return self._forward_packed(query, key, value, attention_mask, packed_seq_params)
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

        def _forward_packed(self, query, key, value, attention_mask, params):
            """Causal attention within each segment of a THD row (see the class docstring)."""
            if params.qkv_format != "thd":
                raise NotImplementedError("SDPAttention takes packed sequences in the thd format "
                                          f"only, got qkv_format={params.qkv_format!r}")
            if attention_mask is not None:
                raise ValueError("a packed row takes no attention_mask: its cu_seqlens delimit "
                                 "the sequences")
            bounds = packed_segment_bounds(params, query.shape[0],
                                           check_rope=not self.config.apply_rope_fusion)
            attn = packed_attention.packed_attention_fn(query)
            if attn is None:
                return packed_attention.segment_loop_attention(query, key, value, bounds,
                                                               self.softmax_scale)
            return packed_attention.varlen_packed_attention(
                attn, query, key, value, _segment_cu_seqlens(params)[0], bounds,
                self.softmax_scale)

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
            setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


class HeadRMSNorm(RMSNorm):
    """Qwen3's per-head q/k RMSNorm: it runs after the column-parallel QKV projection, on the
    whole sequence and this rank's heads; finalize_model_grads sums its gradient over TP for
    every qk_layernorm model (finalize_model_grads.py:355), so it carries no SP mark."""

    mark_sequence_parallel = False


def layer_spec(args: ModelArgs, use_te: bool | None = None, *, moe: bool = False):
    """megatron-core layer spec for `args` (TE on GPU when available, else local + SDPA); with
    `moe`, that of a mixture-of-experts layer (local spec only: its pre-MLP norm stays a
    module of its own, `pre_mlp_layernorm`, as in the dense local layer)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = use_transformer_engine(None) and not args.num_experts
    if moe and not args.num_experts:
        raise ValueError(f"{args.architecture} has no experts: no mixture-of-experts layer spec")
    if use_te:
        if args.num_experts:
            raise ValueError("mixture-of-experts models are built on the local layer spec only: "
                             "use --attention-backend auto or local")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=args.num_experts if moe else None, moe_grouped_gemm=False,
        normalization="RMSNorm", qk_layernorm=args.qk_norm)
    layer: Any = spec.submodules  # a TransformerLayerSubmodules (megatron types it `object`)
    attention = layer.self_attention.submodules
    attention.core_attention = _sdpa_attention_class()
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    if args.qk_norm:
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return spec


def build_gpt_model(args: ModelArgs, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    options: ModelOptions | None = None, pre_process: bool | None = None,
                    post_process: bool | None = None, use_te: bool | None = None,
                    expert_parallel: int = 1, **overrides):
    """Build this rank's stage of the GPT policy (model-parallel groups must be initialised).
    expert_parallel: the expert-model-parallel size megatron's groups were initialised with
    (this rank builds its num_experts / expert_parallel experts of each sparse layer).

    Returns a megatron-core GPTModel whose forward(input_ids [b, s], position_ids [b, s],
    attention_mask=None) returns vocab-parallel logits [b, s, V/TP] on the last pipeline stage
    (hidden states [s, b, h] elsewhere; [s/TP, b, h] under sequence parallelism, where s must
    be a multiple of TP).

    Packed rows: forward(input_ids [1, T], position_ids, None,
    packed_seq_params=make_packed_seq_params(seq_lens, T)) runs the sequences laid end to end in
    the row (then padding, a segment of its own) as if each ran alone: attention stays within
    a segment and RoPE restarts at 0 in each (megatron derives the rotary positions from
    cu_seqlens; position_ids are not read with RoPE). Logits [1, T, V/TP]; the padding's are
    meaningless. T must be a multiple of TP under sequence parallelism. Both specs take it:
    TE's attention natively, the local one through SDPAttention.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.parallel import device, use_cuda

    if use_te is None:  # mixture-of-experts models: the local spec (see layer_spec)
        use_te = use_transformer_engine(options) and not args.num_experts
    from megatron_rl.compat import apply_rope_thd_compat, apply_without_te_compat

    apply_rope_thd_compat()  # packed rows' RoPE without host synchronisations
    if args.num_experts:  # megatron-core's router without TransformerEngine
        apply_without_te_compat()
    config = transformer_config(args, tensor_parallel=tensor_parallel,
                                pipeline_parallel=pipeline_parallel, params_dtype=params_dtype,
                                sequence_parallel=sequence_parallel, options=options,
                                use_te=use_te, expert_parallel=expert_parallel, **overrides)
    spec = layer_spec(args, use_te)
    if not use_te:  # the final norm too (megatron picks WrappedTorchNorm without apex)
        from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                                 get_num_layers_to_build)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        n = get_num_layers_to_build(config)
        layers = [spec] * n
        if args.num_experts:  # this stage's layers, each sparse or dense (args.is_moe_layer)
            moe_spec = layer_spec(args, use_te, moe=True)
            offset = get_transformer_layer_offset(config)
            layers = [moe_spec if args.is_moe_layer(offset + i) else spec for i in range(n)]
        spec = TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)
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
    if use_cuda():
        model = model.to(device())
    return model
