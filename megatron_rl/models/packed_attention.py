"""Causal attention within each sequence of a packed row, the THD format: sequences laid end to
end in one row of t tokens, delimited by cu_seqlens (see models/gpt.py, make_packed_seq_params).

Two ways to compute it, for SDPAttention (models/gpt.py) on the local layer spec:

- `segment_loop_attention`: one `scaled_dot_product_attention` call per segment. The fastest on
  the CPU (measured, see SDPAttention), but on a GPU each segment costs its own kernel launches
  in every layer, forward and backward: a row of 64 short sequences launches 64 times what a row
  of one sequence does.
- `varlen_packed_attention`: one call of a variable-length attention function over the whole
  row, torch's `torch.nn.attention.varlen.varlen_attn` (flash attention, torch >= 2.10), whose
  launches do not depend on the number of sequences.

`packed_attention_fn` chooses: varlen_attn for fp16/bf16 tensors on a CUDA device where torch
has it and flash attention takes the head size, else None (the loop). Tests substitute it with
`reference_varlen_attn`, varlen_attn's contract computed by one masked SDPA call, to run the
one-call path on the CPU.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

CAUSAL_WINDOW = (-1, 0)  # varlen_attn's window_size for causal attention (a tuple: it compares ==)


@functools.lru_cache(maxsize=1)
def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.lru_cache(maxsize=16)
def _flash_capable(device: torch.device) -> bool:
    """This torch has flash attention's kernels, and `device` can run them (compute capability
    8.0, Ampere, or later)."""
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def packed_attention_fn(query: torch.Tensor) -> Callable | None:
    """The variable-length attention function for a packed row of `query` [t, np, hn]:
    torch's varlen_attn where flash attention can run (a CUDA device of compute capability 8.0
    or later, a torch built with flash attention, >= 2.10; fp16 or bf16; hn a multiple of 8 up
    to 256), else None: then SDPAttention runs `segment_loop_attention` (the CPU; fp32 on a
    GPU)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256 or not _flash_capable(query.device):
        return None
    return _torch_varlen_attn()


@functools.lru_cache(maxsize=16)
def _parameters(attn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(attn).parameters)


def varlen_packed_attention(attn: Callable, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, cu_seqlens: torch.Tensor, bounds: Sequence[int],
                            scale: float | None = None) -> torch.Tensor:
    """Causal attention within each segment of a packed row, in one call of `attn`, a function
    with varlen_attn's signature.

    query [t, np, hn], key/value [t, ng, hn] (np a multiple of ng); cu_seqlens [segments + 1],
    the segment boundaries on the device (passed as int32, for queries and keys alike); bounds:
    the same values on the host, from which the longest segment (max_q = max_k) is read, so
    nothing is read back from the device. scale: the softmax scale, None for 1 / sqrt(hn).
    Returns [t, np * hn].

    The call follows the keywords `attn` takes, which differ between torch releases:
    causality as window_size=(-1, 0) (torch 2.13) or is_causal=True (torch 2.10); grouped KV
    heads as they are with enable_gqa, else repeated
    to the query heads; `scale` as a keyword where there is one, else folded into the query
    (scaled by scale * sqrt(hn), so that the default 1 / sqrt(hn) makes it `scale`).
    """
    t, n_heads, head_dim = query.shape
    takes = _parameters(attn)
    kwargs: dict = {}
    if "window_size" in takes:
        kwargs["window_size"] = CAUSAL_WINDOW
    elif "is_causal" in takes:
        kwargs["is_causal"] = True
    else:
        raise TypeError(f"{attn!r} takes neither window_size nor is_causal: no causal mask")
    if n_heads != key.shape[1]:
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:
            rep = n_heads // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if scale is not None:
        if "scale" in takes:
            kwargs["scale"] = scale
        else:
            query = query * (scale * head_dim ** 0.5)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    out = attn(query, key, value, cu, cu, longest, longest, **kwargs)
    return out.reshape(t, n_heads * head_dim)


def segment_loop_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           bounds: Sequence[int], scale: float | None = None) -> torch.Tensor:
    """Causal attention within each segment of a packed row, one SDPA call per segment.

    query [t, np, hn], key/value [t, ng, hn]; bounds: the segment boundaries on the host
    (0, ..., t; an empty segment is skipped). Returns [t, np * hn].

    Grouped KV heads go to SDPA as they are (enable_gqa), except on CUDA in fp32, where flash
    attention cannot run and the memory-efficient kernel, which does not take grouped heads,
    can: there they are repeated to the query heads, so that SDPA does not fall back to its
    math path."""
    t, n_heads, head_dim = query.shape
    gqa = n_heads != key.shape[1]
    if gqa and query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        rep = n_heads // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        gqa = False
    lens = [b - a for a, b in itertools.pairwise(bounds)]
    outs = []
    # split (not slicing) so that backward concatenates the segments' gradients once
    for q, k, v in zip(query.split(lens), key.split(lens), value.split(lens)):
        if q.shape[0] == 0:
            continue
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, len, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))  # [len, np, hn]
    return torch.cat(outs).reshape(t, n_heads * head_dim)


def reference_varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None, max_q: int,
                          max_k: int, *, return_aux=None, scale: float | None = None,
                          window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                          seqused_k: torch.Tensor | None = None,
                          block_table: torch.Tensor | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """varlen_attn's contract (torch.nn.attention.varlen, the signature of torch 2.13) on any
    device, for self-attention: one `scaled_dot_product_attention` call over the whole row with
    a block-diagonal mask built from cu_seq_q, so that its operators do not depend on the number
    of segments. A stand-in for tests, not a fast path: the mask is [t, t].

    query [t, np, hn], key/value [t, ng, hn] (ng < np with enable_gqa only); cu_seq_q
    [segments + 1] int32 on query's device, cu_seq_k the same tensor or None; window_size
    (-1, -1) (within each segment) or (-1, 0) (causal within each segment). max_q and max_k are
    not read (checking them would read cu_seq_q back). Returns [t, np, hn]."""
    if return_aux is not None or seqused_k is not None or block_table is not None:
        raise NotImplementedError("reference_varlen_attn computes the output only, without a "
                                  "KV cache")
    if cu_seq_k is not None and cu_seq_k is not cu_seq_q:
        raise NotImplementedError("reference_varlen_attn is self-attention: cu_seq_k must be "
                                  "cu_seq_q")
    if cu_seq_q.dtype != torch.int32 or cu_seq_q.device != query.device:
        raise ValueError(f"cu_seq_q must be int32 on {query.device}, got {cu_seq_q.dtype} on "
                         f"{cu_seq_q.device}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads, key/value {key.shape[1]}: pass "
                         "enable_gqa=True")
    if tuple(window_size) not in ((-1, -1), CAUSAL_WINDOW):
        raise NotImplementedError(f"window_size {window_size}: (-1, -1) or (-1, 0) only")
    token = torch.arange(query.shape[0], device=query.device, dtype=cu_seq_q.dtype)
    segment = torch.searchsorted(cu_seq_q[1:], token, right=True)  # [t]
    mask = segment[:, None] == segment[None, :]  # [t, t], True = attend
    if tuple(window_size) == CAUSAL_WINDOW:
        mask = mask.tril()
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [heads, t, hn]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.transpose(0, 1)
