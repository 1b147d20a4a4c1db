"""The CUDA path of a packed row's attention (models/packed_attention.py): one varlen_attn call
(flash attention) per layer, against the per-segment SDPA loop, in bf16.

- Attention alone, rows of unequal segments with a padding segment (and one with an empty slot),
  grouped KV heads (8 query heads, 2 KV heads, 64 dims) and not (4 and 4, 128 dims): outputs
  and the gradients of query, key and value. Each bf16 path is compared with an fp32 loop on the
  same inputs: varlen's largest error may be at most twice the loop's plus one bf16 rounding
  step at the tensor's largest magnitude (2^-8 of it: both are bf16 flash attention, so their
  errors are of one size), and varlen and the loop agree within 2% of the largest magnitude of
  each tensor.
- A tiny bf16 model (local spec, 2 layers): the varlen path is taken, once per layer; logits and
  parameter gradients agree with the loop's within 2% (logits) and 5% (each gradient) of the
  loop's largest magnitude; the forward with host bounds and the backward make no host
  synchronisation; the operators dispatched by a forward and backward are as many at 4, 16 and
  64 sequences in the row.
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_helpers import max_err, single_gpu_rank

pytestmark = pytest.mark.gpu

ROWS = {
    # unequal sequences, then a padding segment: 1024 tokens
    "padding": [0, 37, 337, 342, 470, 471, 561, 1024],
    # an empty slot (cu_seqlens_q_padded may hold one)
    "empty_slot": [0, 37, 337, 337, 342, 470, 471, 561, 1024],
}
HEADS = {"gqa": (8, 2, 64), "mha": (4, 4, 128)}


def _varlen_attn():
    """torch's varlen_attn, which packed_attention_fn must choose for bf16 on this GPU."""
    from megatron_rl.models import packed_attention as pa

    varlen = pytest.importorskip("torch.nn.attention.varlen",
                                 reason="torch < 2.10 has no varlen_attn").varlen_attn
    if (torch.cuda.get_device_capability() < (8, 0)
            or not torch.backends.cuda.is_flash_attention_available()):
        pytest.skip("flash attention needs compute capability 8.0 or later, and a torch built "
                    "with it")
    attn = pa.packed_attention_fn(torch.empty(1, 8, 64, dtype=torch.bfloat16, device="cuda"))
    assert attn is varlen
    return attn


def _run(fn, inputs, grad_out):
    qkv = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*qkv)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in qkv)]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("row", list(ROWS))
def test_varlen_equals_the_loop_in_bf16(heads, row):
    from megatron_rl.models import packed_attention as pa

    attn = _varlen_attn()
    bounds = ROWS[row]
    t, (n_q, n_kv, d) = bounds[-1], HEADS[heads]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(t, n, d, generator=g).cuda() for n in (n_q, n_kv, n_kv)]
    grad_out = torch.randn(t, n_q * d, generator=g).cuda()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    bf16 = [x.bfloat16() for x in inputs]

    varlen = _run(lambda q, k, v: pa.varlen_packed_attention(attn, q, k, v, cu, bounds), bf16,
                  grad_out)
    loop = _run(lambda q, k, v: pa.segment_loop_attention(q, k, v, bounds), bf16, grad_out)
    ref = _run(lambda q, k, v: pa.segment_loop_attention(q, k, v, bounds), inputs, grad_out)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), varlen, loop, ref):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape == r.shape, name
        scale = r.abs().max().item()
        err_varlen, err_loop = max_err(a, r), max_err(b, r)
        assert err_varlen <= 2 * err_loop + 2 ** -8 * scale, (name, err_varlen, err_loop)
        assert max_err(a, b) <= 0.02 * scale, (name, max_err(a, b), scale)


# -- through a tiny bf16 model ---------------------------------------------------------------
TINY = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, qkv_bias=True, max_position_embeddings=512)
TOTAL = 512


class OpCounter(TorchDispatchMode):
    """The ATen (and custom) operators dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _lengths(n: int) -> list[int]:
    return [3 + (7 * i) % 5 for i in range(n)]  # unequal, 3 to 7 tokens; then padding


@pytest.fixture(scope="module")
def bf16_model():
    """Fusions off: megatron's unfused RoPE (with megatron_rl.compat's host-sync-free THD
    patch), as on the CPU tier, so that what is counted is the attention's."""
    from megatron_rl.models.config import ModelArgs, ModelOptions
    from megatron_rl.models.gpt import build_gpt_model

    single_gpu_rank()
    torch.manual_seed(0)
    options = ModelOptions(bias_swiglu_fusion=False, rope_fusion=False,
                           gradient_accumulation_fusion=False)
    model = build_gpt_model(ModelArgs(**TINY), params_dtype=torch.bfloat16, use_te=False,
                            options=options)
    assert next(model.parameters()).is_cuda
    return model


def _row(n: int):
    """(ids, position_ids, loss weights, PackedSeqParams with host bounds) of a row of n
    sequences then padding."""
    from megatron_rl.models.gpt import make_packed_seq_params

    lens = _lengths(n)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, TINY["vocab_size"], (1, TOTAL), generator=g).cuda()
    pos = torch.cat([torch.arange(k) for k in (*lens, TOTAL - sum(lens))])[None].cuda()
    weights = torch.randn(1, TOTAL, TINY["vocab_size"], generator=g).cuda()
    return ids, pos, weights, make_packed_seq_params(lens, TOTAL, device="cuda")


def _step(model, row):
    """Logits and parameter gradients of one forward and backward of `row`."""
    ids, pos, weights, params = row
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, packed_seq_params=params)
    (logits.float() * weights).sum().backward()
    return logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def test_a_bf16_model_takes_varlen_and_matches_the_loop(bf16_model, monkeypatch):
    from megatron_rl.models import packed_attention as pa

    varlen = _varlen_attn()
    chosen = []
    choose = pa.packed_attention_fn
    monkeypatch.setattr(pa, "packed_attention_fn",
                        lambda query: chosen.append(choose(query)) or chosen[-1])
    row = _row(16)
    logits, grads = _step(bf16_model, row)
    assert chosen == [varlen] * TINY["num_hidden_layers"]
    monkeypatch.setattr(pa, "packed_attention_fn", lambda query: None)
    loop_logits, loop_grads = _step(bf16_model, row)
    n = sum(_lengths(16))  # the real tokens (the padding's logits are meaningless)
    assert max_err(logits[:, :n], loop_logits[:, :n]) <= 0.02 * loop_logits.abs().max().item()
    assert grads.keys() == loop_grads.keys()
    for name, grad in grads.items():
        scale = loop_grads[name].abs().max().item()
        assert max_err(grad, loop_grads[name]) <= 0.05 * scale + 1e-6, name


def test_a_bf16_packed_step_neither_syncs_nor_grows_with_the_sequences(bf16_model):
    from megatron_rl.hostsync import HostSyncCounter

    _varlen_attn()
    ids, pos, _, params = _row(16)
    torch.cuda.synchronize()
    with HostSyncCounter(device_type="cuda") as fwd:
        logits = bf16_model(ids, pos, None, packed_seq_params=params)
    with HostSyncCounter(device_type="cuda") as bwd:
        logits.float().square().mean().backward()
    assert fwd.total == 0, fwd.report()
    assert bwd.total == 0, bwd.report()

    counts = {}
    for n in (4, 16, 64):
        row = _row(n)
        _step(bf16_model, row)  # megatron caches the RoPE table per max_seqlen: count warm
        with OpCounter() as ops:
            _step(bf16_model, row)
        counts[n] = sum(ops.counts.values())
        assert any("varlen" in name for name in ops.counts), sorted(ops.counts)
    assert len(set(counts.values())) == 1, counts
