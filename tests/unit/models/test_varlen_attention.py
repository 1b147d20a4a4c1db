"""The one-call attention of a packed row (models/packed_attention.py) against the per-segment
loop, on the CPU.

The CUDA path calls torch's varlen_attn once per layer; here `reference_varlen_attn` (one masked
SDPA call, varlen_attn's contract) stands in for it, through the same argument preparation
(`varlen_packed_attention`). Checked in fp32, on rows of unequal segments with a padding segment
(and an empty one):
- outputs and gradients equal the loop's, with grouped KV heads and without, with the default
  softmax scale and another one, for torch 2.13's signature (window_size, enable_gqa, scale as
  keywords) and torch 2.10's (is_causal; no enable_gqa, no scale);
- the arguments the function receives: cu_seqlens int32 on the query's device for queries and
  keys, max_q = max_k = the longest segment, read from the host bounds (no host
  synchronisation), causality, the KV heads (grouped with enable_gqa, else repeated), the scale;
  and the call binds to the installed torch's varlen_attn;
- a tiny model's packed logits and gradients are the same through either path, and the CPU
  keeps the loop.
"""
import inspect

import pytest
import torch

from megatron_rl.hostsync import HostSyncCounter
from megatron_rl.models import packed_attention as pa

BOUNDS = [0, 5, 16, 19, 27, 32]  # four sequences of unequal lengths, then a padding segment
WITH_EMPTY = [0, 5, 5, 16, 19, 27, 32]  # an empty slot (cu_seqlens_q_padded may hold one)
HEADS = {"gqa": (4, 2), "mha": (4, 4)}


def torch_2_10_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                      return_aux=None):
    """torch 2.10's varlen_attn signature (no scale, no enable_gqa), computed by the reference."""
    if key.shape[1] != query.shape[1]:
        raise ValueError("torch 2.10's varlen_attn takes as many KV heads as query heads")
    return pa.reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                    return_aux=return_aux,
                                    window_size=pa.CAUSAL_WINDOW if is_causal else (-1, -1))


SIGNATURES = {"torch_2_13": pa.reference_varlen_attn, "torch_2_10": torch_2_10_varlen}


def _qkv(heads, t=32, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_q, n_kv = heads
    q = torch.randn(t, n_q, head_dim, generator=g)
    k = torch.randn(t, n_kv, head_dim, generator=g)
    v = torch.randn(t, n_kv, head_dim, generator=g)
    return [x.requires_grad_() for x in (q, k, v)]


def _out_and_grads(fn, qkv, seed=1):
    out = fn(*qkv)
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = [x.grad.clone() for x in qkv]
    for x in qkv:
        x.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("bounds", [BOUNDS, WITH_EMPTY], ids=["padding", "empty_slot"])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_one_call_equals_the_loop_in_outputs_and_gradients(signature, heads, scale, bounds):
    attn = SIGNATURES[signature]
    qkv = _qkv(HEADS[heads])
    cu = torch.tensor(bounds, dtype=torch.int32)
    one, one_grads = _out_and_grads(
        lambda q, k, v: pa.varlen_packed_attention(attn, q, k, v, cu, bounds, scale), qkv)
    loop, loop_grads = _out_and_grads(
        lambda q, k, v: pa.segment_loop_attention(q, k, v, bounds, scale), qkv)
    assert one.shape == loop.shape == (32, HEADS[heads][0] * 8)
    torch.testing.assert_close(one, loop, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", one_grads, loop_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")


class Recorder:
    """A varlen function that records its arguments, then computes with `inner`."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.__signature__ = inspect.signature(inner)

    def __call__(self, *args, **kwargs):
        self.calls.append(inspect.signature(self.inner).bind(*args, **kwargs).arguments)
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_varlen_call_arguments(signature):
    rec = Recorder(SIGNATURES[signature])
    q, k, v = (x.detach() for x in _qkv(HEADS["gqa"]))
    cu = torch.tensor(BOUNDS, dtype=torch.int64)  # any integer dtype: passed on as int32
    with HostSyncCounter(device_type="cpu") as syncs:
        out = pa.varlen_packed_attention(rec, q, k, v, cu, BOUNDS, 0.3)
    assert syncs.total == 0, syncs.report()  # max_q from the host bounds, not from cu
    assert out.shape == (32, 32)
    (call,) = rec.calls
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].device == q.device
    assert call["cu_seq_k"] is call["cu_seq_q"] and call["cu_seq_q"].tolist() == BOUNDS
    assert call["max_q"] == call["max_k"] == 11  # the longest segment, an int
    assert type(call["max_q"]) is int
    if signature == "torch_2_13":
        assert call["window_size"] == (-1, 0) and isinstance(call["window_size"], tuple)
        assert call["enable_gqa"] is True
        assert call["key"] is k and call["value"] is v  # grouped heads as they are
        assert call["scale"] == 0.3 and call["query"] is q
    else:
        assert call["is_causal"] is True
        assert torch.equal(call["key"], k.repeat_interleave(2, dim=1))
        assert torch.equal(call["value"], v.repeat_interleave(2, dim=1))
        # scaled so that the default 1 / sqrt(8) makes 0.3
        torch.testing.assert_close(call["query"], q * (0.3 * 8 ** 0.5))


def test_the_call_binds_to_the_installed_varlen_attn():
    """What varlen_packed_attention passes is what the installed torch's varlen_attn takes."""
    varlen = pytest.importorskip("torch.nn.attention.varlen",
                                 reason="torch < 2.10 has no varlen_attn").varlen_attn

    def checked(*args, **kwargs):
        bound = inspect.signature(varlen).bind(*args, **kwargs)
        if "window_size" in bound.arguments:
            assert bound.arguments["window_size"] == (-1, 0)
        else:
            assert bound.arguments["is_causal"] is True
        calls.append(bound.arguments)
        return pa.reference_varlen_attn(*args, scale=kwargs.get("scale"),
                                        enable_gqa=kwargs.get("enable_gqa", False),
                                        window_size=pa.CAUSAL_WINDOW)

    calls = []
    checked.__signature__ = inspect.signature(varlen)
    q, k, v = (x.detach() for x in _qkv(HEADS["gqa"]))
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out = pa.varlen_packed_attention(checked, q, k, v, cu, BOUNDS, 0.3)
    assert len(calls) == 1
    torch.testing.assert_close(out, pa.segment_loop_attention(q, k, v, BOUNDS, 0.3),
                               rtol=1e-5, atol=1e-6)


def test_the_cpu_keeps_the_loop():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert pa.packed_attention_fn(torch.zeros(4, 2, 8, dtype=dtype)) is None


# -- through the model ---------------------------------------------------------------------------
QWEN2 = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, qkv_bias=True, max_position_embeddings=64)
LENS, TOTAL = (5, 11, 3, 8), 32  # then a padding segment of 5


@pytest.mark.distributed
def test_model_logits_and_gradients_equal_through_either_path(dist_env, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.gpt import build_gpt_model, make_packed_seq_params

    torch.manual_seed(0)
    model = build_gpt_model(ModelArgs(**QWEN2), use_te=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN2["vocab_size"], (1, TOTAL), generator=g)
    pos = torch.cat([torch.arange(n) for n in (*LENS, TOTAL - sum(LENS))])[None]
    weights = torch.randn(1, TOTAL, QWEN2["vocab_size"], generator=g)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos, None, packed_seq_params=make_packed_seq_params(LENS, TOTAL))
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loop_logits, loop_grads = run()
    rec = Recorder(pa.reference_varlen_attn)
    monkeypatch.setattr(pa, "packed_attention_fn", lambda query: rec)
    one_logits, one_grads = run()
    assert len(rec.calls) == QWEN2["num_hidden_layers"]  # one call per layer
    torch.testing.assert_close(one_logits, loop_logits, rtol=1e-5, atol=1e-5)
    assert one_grads.keys() == loop_grads.keys()
    for name in loop_grads:
        torch.testing.assert_close(one_grads[name], loop_grads[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
