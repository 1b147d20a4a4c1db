"""The fused LM-head op (megatron_rl.ops.lm_head_logprobs_and_kl) on a GPU: from hidden states
and the output weight at Qwen2.5's head (H 896, V 151936), values and gradients (hidden and
weight) against an fp64 oracle, and its memory claim: the peak extra memory of forward+backward
stays a small fraction of the logits path's (which holds [N, V] logits and their gradient).

Accuracy rule: the op's error against fp64 is at most twice that of the logits path in the same
dtype (logits = hidden @ weight.T, then the fused log-prob op), plus a floor relative to the
largest exact value.
"""
import pytest
import torch

from gpu_helpers import require_cuda_kernel
from megatron_rl.ops import lm_head_logprobs_and_kl, token_logprobs_and_kl
from megatron_rl.ops.reference import naive_exact_kl, naive_token_logprobs_and_kl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
H, V = 896, 151936


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


def test_peak_memory_a_fraction_of_the_logits_path():
    """At N = 8192 tokens in bf16 the logits path holds [N, V] logits, the reference's and
    their gradient (~7.5 GB); the fused op's peak extra must stay under a fifth of that."""
    require_cuda_kernel()
    h, w, rh, rw, t, coefs = _inputs(8192, torch.bfloat16)

    def peak(kind):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grads(kind, h, w, rh, rw, t, coefs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    fused, logits = peak("fused"), peak("logits")
    assert fused < logits / 5, (fused, logits)
