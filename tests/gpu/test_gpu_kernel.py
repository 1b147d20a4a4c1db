"""The CUDA kernel of the fused log-prob / log-ratio / K3 / entropy op against an fp64 oracle, at
odd shapes up to Qwen's V = 152064, in fp32 and bf16: values and gradients; and its memory claim
(nothing of size [N, V] is kept or made besides grad_logits).

Accuracy rule: the kernel's largest error against fp64 (log_softmax in float64 of the same input
values; gradients cast back to the input dtype, as autograd does) is at most twice that of
PyTorch computing in fp32 from the same inputs, plus a floor. This is stricter for bf16 values
than tests/ops/test_logprob_kl.py, whose bar is PyTorch computing in bf16: the kernel accumulates
in fp32 whatever the input dtype. Floors, relative to the largest exact value: 4e-6 for fp32
(the kernel's exp is the __expf intrinsic, ~1e-6 relative error, csrc/logprob_kl_cuda.cu) and,
for bf16 gradients, one bf16 ulp (2**-8): rounding to bf16 an fp32 value that differs from
PyTorch's in its last bits can flip to the neighbouring bf16 value. A real error (temperature,
normalisation, entropy term, shard offset) is orders of magnitude larger.
"""
import pytest
import torch

from gpu_helpers import max_err, require_cuda_kernel
from megatron_rl.ops import token_logprobs_and_kl
from megatron_rl.ops.reference import naive_token_logprobs_and_kl

pytestmark = pytest.mark.gpu

VALUE_FLOOR = 4e-6
GRAD_FLOOR = {torch.float32: 4e-6, torch.bfloat16: 2 ** -8}
SHAPES = [  # (rows, vocab, logit scale, temperature, vocab_start)
    (1, 152064, 3.0, 1.0, 0),
    (3, 152064, 3.0, 0.7, 0),
    (129, 152064, 3.0, 1.0, 0),
    (37, 151936, 5.0, 1.3, 0),       # Qwen2.5's padded vocabulary
    (65, 50257, 3.0, 1.0, 0),        # odd vocab (GPT-2)
    (17, 32001, 1e4, 1.0, 0),        # logits of +-1e4
    (5, 7, 2.0, 1.0, 0),
    (1, 1, 1.0, 1.0, 0),
    (33, 76032, 3.0, 1.0, 76032),    # the second TP2 shard of 152064, without a group
]


def _inputs(rows, vocab, dtype, scale, vocab_start, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen) + vocab_start
    return logits, targets


def _run(fn, logits, targets, ref, weights):
    """fn's four outputs and the gradient of sum_k w_k * out_k w.r.t. the logits."""
    x = logits.detach().clone().requires_grad_(True)
    outs = fn(x, targets, ref)
    loss = sum((w.to(o.device) * o.double()).sum() for w, o in zip(weights, outs))
    (grad,) = torch.autograd.grad(loss, x)
    return [o.detach().double().cpu() for o in outs], grad.double().cpu()


def _naive(dtype, temperature, vocab_start):
    def fn(x, t, ref):
        return naive_token_logprobs_and_kl(x, t - vocab_start, ref, temperature=temperature,
                                           dtype=dtype)
    return fn


def _kernel(temperature, vocab_start):
    def fn(x, t, ref):
        o = token_logprobs_and_kl(x, t, ref_logprobs=ref, temperature=temperature,
                                  vocab_start=vocab_start, return_entropy=True, backend="cuda")
        return o.logprobs, o.log_ratio, o.k3, o.entropy
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,vocab,scale,temperature,vocab_start", SHAPES)
def test_cuda_kernel_matches_fp64(dtype, rows, vocab, scale, temperature, vocab_start):
    require_cuda_kernel()
    logits, targets = _inputs(rows, vocab, dtype, scale, vocab_start)
    oracle_lp = naive_token_logprobs_and_kl(logits, targets - vocab_start, temperature=temperature,
                                            dtype=torch.float64)[0]
    # a reference policy near the current one, as in RL (log-ratios of order 0.1 - 1)
    ref = (oracle_lp + 0.3 * torch.randn(rows, generator=torch.Generator().manual_seed(1))).float()
    weights = [torch.randn(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(2 + k))
               for k in range(4)]
    exact, exact_grad = _run(_naive(torch.float64, temperature, vocab_start), logits, targets,
                             ref, weights)
    dev = [t.cuda() for t in (logits, targets, ref)]
    fp32, fp32_grad = _run(_naive(torch.float32, temperature, vocab_start), *dev, weights)
    ours, ours_grad = _run(_kernel(temperature, vocab_start), *dev, weights)
    for name, o, t, e in zip(("logprobs", "log_ratio", "k3", "entropy"), ours, fp32, exact):
        assert torch.isfinite(o).all(), name
        floor = VALUE_FLOOR * max(1.0, e.abs().max().item())
        assert max_err(o, e) <= 2 * max_err(t, e) + floor, (name, max_err(o, e), max_err(t, e))
    assert ours_grad.shape == logits.shape
    floor = GRAD_FLOOR[dtype] * max(1.0, exact_grad.abs().max().item())
    assert max_err(ours_grad, exact_grad) <= 2 * max_err(fp32_grad, exact_grad) + floor, (
        max_err(ours_grad, exact_grad), max_err(fp32_grad, exact_grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kernel_peak_memory_is_one_logits_gradient(dtype):
    """Forward + backward at N=4096, V=152064 allocates grad_logits and O(N) vectors only."""
    require_cuda_kernel()
    n, v = 4096, 152064
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    ref = -torch.rand(n, device="cuda", generator=gen) * 10
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = token_logprobs_and_kl(logits, targets, ref_logprobs=ref, return_entropy=True,
                                backend="cuda")
    kept = torch.cuda.memory_allocated() - base
    (out.logprobs.sum() + 0.1 * out.k3.sum() + 0.01 * out.entropy.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grad_bytes = logits.numel() * logits.element_size()
    assert kept < 64 * n * 4, kept  # O(N) statistics, no [N, V] tensor saved for backward
    assert peak <= grad_bytes + 16 * 2**20, (peak / 2**20, grad_bytes / 2**20)
