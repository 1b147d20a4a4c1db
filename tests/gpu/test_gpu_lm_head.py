"""The fused LM-head op (megatron_rl.ops.lm_head_logprobs_and_kl) on a GPU: from hidden states
and the output weight at Qwen2.5's head (H 896, V 151936), values and gradients (hidden and
weight) against an fp64 oracle, and its memory claim: the peak extra memory of forward+backward
is the op's own arithmetic (megatron_rl.ops.lm_head.lm_head_peak_bytes at the GPU block size),
below one [N, V] logits tensor, while the logits path holds three (logits, the reference's and
their gradient).

Accuracy rule: the op's error against fp64 is at most twice that of the logits path in the same
dtype (logits = hidden @ weight.T, then the fused log-prob op), plus a floor relative to the
largest exact value.
"""
import pytest
import torch

from gpu_helpers import require_cuda_kernel
from megatron_rl.ops import lm_head_logprobs_and_kl, token_logprobs_and_kl
from megatron_rl.ops.lm_head import lm_head_peak_bytes
from megatron_rl.ops.reference import naive_exact_kl, naive_token_logprobs_and_kl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
H, V = 896, 151936
# The CUDA caching allocator hands out whole blocks (an allocation may hold up to ~2 MiB more
# than it asked for) and the op holds about a dozen tensors at its peak: the measured peak may
# differ from the arithmetic by this much.
ALLOCATOR_SLACK = 64 << 20


def _inputs(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.02
    rh = h + 0.2 * torch.randn(n, H, generator=gen)
    rw = w + 0.002 * torch.randn(V, H, generator=gen)
    t = torch.randint(0, V, (n,), generator=gen)
    coefs = torch.randn(3, n, generator=gen, dtype=torch.float64)
    return [x.to("cuda") for x in (h.to(dtype), w.to(dtype), rh.to(dtype), rw.to(dtype), t,
                                   coefs)]


def _grads(kind, h, w, rh, rw, t, coefs):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    if kind == "fused":
        o = lm_head_logprobs_and_kl(hh, ww, t, return_entropy=True, ref_hidden=rh, ref_weight=rw)
        outs = [o.logprobs, o.entropy, o.exact_kl]
    elif kind == "logits":
        o = token_logprobs_and_kl(hh @ ww.t(), t, return_entropy=True, ref_logits=rh @ rw.t())
        outs = [o.logprobs, o.entropy, o.exact_kl]
    else:  # fp64 oracle
        z = hh.double() @ ww.double().t()
        lp, _, _, ent = naive_token_logprobs_and_kl(z, t, None, dtype=torch.float64)
        outs = [lp, ent, naive_exact_kl(z, rh.double() @ rw.double().t(), dtype=torch.float64)]
    sum((c * o.double()).sum() for c, o in zip(coefs, outs)).backward()
    return [o.detach().double() for o in outs], hh.grad.double(), ww.grad.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_against_fp64(dtype):
    require_cuda_kernel()
    args = _inputs(1000, dtype)
    fused, base, exact = (_grads(k, *args) for k in ("fused", "logits", "oracle"))
    err = lambda a, b: float((a - b).abs().max())  # noqa: E731
    for i, name in enumerate(["logprobs", "entropy", "exact_kl"]):
        floor = 4e-6 * max(1.0, float(exact[0][i].abs().max()))
        assert err(fused[0][i], exact[0][i]) <= 2 * err(base[0][i], exact[0][i]) + floor, name
    for j in (1, 2):
        floor = (4e-6 if dtype == torch.float32 else 2 ** -8) * float(exact[j].abs().max())
        assert err(fused[j], exact[j]) <= 2 * err(base[j], exact[j]) + floor, ("grad", j)


def _peak_bytes(kind, h, w, rh, rw, t, coefs) -> int:
    """Peak CUDA memory one forward+backward allocates beyond its inputs (the gradients it
    leaves included), measured on a second run: the first creates cuBLAS's workspaces."""
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

    def run():
        if kind == "fused":
            o = lm_head_logprobs_and_kl(hh, ww, t, return_entropy=True, ref_hidden=rh,
                                        ref_weight=rw)
        else:
            o = token_logprobs_and_kl(hh @ ww.t(), t, return_entropy=True, ref_logits=rh @ rw.t())
        outs = [o.logprobs, o.entropy, o.exact_kl]
        torch.stack([(c * x.double()).sum() for c, x in zip(coefs, outs)]).sum().backward()

    run()
    hh.grad = ww.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_peak_memory_is_the_analytic_peak():
    """At N = 8192 tokens in bf16 with the exact KL: the fused op's measured peak is
    lm_head_peak_bytes (three 512 MiB blocks, the weight and hidden gradients: 1.78 GiB) within
    the allocator's slack, under one [N, V] logits tensor (2.3 GiB); the logits path holds at
    least three of those at once."""
    require_cuda_kernel()
    n = 8192
    args = _inputs(n, torch.bfloat16)
    analytic = lm_head_peak_bytes(n, H, V, torch.bfloat16, "cuda", exact_kl=True)
    logits_bytes = n * V * torch.bfloat16.itemsize
    assert analytic < logits_bytes
    fused, logits = _peak_bytes("fused", *args), _peak_bytes("logits", *args)
    assert abs(fused - analytic) <= ALLOCATOR_SLACK, (fused, analytic)
    assert logits >= 3 * logits_bytes, (logits, logits_bytes)
