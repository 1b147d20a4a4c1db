"""The CUDA kernel of the exact per-position KL (megatron_rl.ops.exact_kl, `--kl-estimator exact`)
against an fp64 oracle, at odd shapes up to Qwen's V = 152064, in fp32 and bf16: values and
gradients w.r.t. the policy logits; its memory claim (nothing of size [N, V] kept for backward,
nothing made besides grad_logits); and vocab shards that do not start 16-byte aligned.

Accuracy rule, as in test_gpu_kernel.py: the kernel's largest error against fp64 (log_softmax in
float64 of the same input values, differentiated by autograd; gradients cast back to the input
dtype) is at most twice that of PyTorch computing in fp32 from the same inputs, plus a floor
relative to the largest exact value: 4e-6 for values and fp32 gradients (the __expf intrinsic),
one bf16 ulp (2**-8) for bf16 gradients.
"""
import pytest
import torch

from gpu_helpers import max_err, require_cuda_kernel
from megatron_rl.ops import exact_kl
from megatron_rl.ops.reference import naive_exact_kl

pytestmark = pytest.mark.gpu

VALUE_FLOOR = 4e-6
GRAD_FLOOR = {torch.float32: 4e-6, torch.bfloat16: 2 ** -8}
SHAPES = [  # (rows, vocab, policy logit scale, reference noise)
    (1, 152064, 3.0, 1.0),
    (129, 152064, 3.0, 0.3),
    (37, 151936, 5.0, 1.0),       # Qwen2.5's padded vocabulary
    (65, 50257, 3.0, 2.0),        # odd vocab (GPT-2)
    (17, 32001, 1e4, 1.0),        # logits of +-1e4
    (5, 7, 2.0, 1.0),
    (1, 1, 1.0, 1.0),
    (33, 76032, 3.0, 1.0),        # one TP2 shard of 152064
]


def _pair(rows, vocab, dtype, scale, noise, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * scale
    r = z + torch.randn(rows, vocab, generator=gen) * noise * scale
    return z.to(dtype), r.to(dtype)


def _run(fn, z, r, weights):
    x = z.detach().clone().requires_grad_(True)
    kl = fn(x, r)
    (grad,) = torch.autograd.grad((kl.double() * weights.to(kl.device)).sum(), x)
    return kl.detach().double().cpu(), grad.double().cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,vocab,scale,noise", SHAPES)
def test_cuda_exact_kl_matches_fp64(dtype, rows, vocab, scale, noise):
    require_cuda_kernel()
    z, r = _pair(rows, vocab, dtype, scale, noise)
    w = torch.randn(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    exact, exact_grad = _run(lambda x, y: naive_exact_kl(x, y, torch.float64), z, r, w)
    zc, rc = z.cuda(), r.cuda()
    fp32, fp32_grad = _run(lambda x, y: naive_exact_kl(x, y, torch.float32), zc, rc, w)
    ours, ours_grad = _run(lambda x, y: exact_kl(x, y, backend="cuda"), zc, rc, w)
    assert torch.isfinite(ours).all() and ours_grad.shape == z.shape
    floor = VALUE_FLOOR * max(1.0, exact.abs().max().item())
    assert max_err(ours, exact) <= 2 * max_err(fp32, exact) + floor, (
        max_err(ours, exact), max_err(fp32, exact))
    floor = GRAD_FLOOR[dtype] * max(1.0, exact_grad.abs().max().item())
    assert max_err(ours_grad, exact_grad) <= 2 * max_err(fp32_grad, exact_grad) + floor, (
        max_err(ours_grad, exact_grad), max_err(fp32_grad, exact_grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_torch_backend_on_unaligned_rows(dtype):
    """Rows that start off a 16-byte boundary (vocab 1031) and a reference that is a view at an
    odd offset (the kernels' scalar paths) give the torch backend's values and gradients."""
    require_cuda_kernel()
    z, r = _pair(19, 1031 + 1, dtype, 3.0, 1.0)
    zc, rc = z.cuda()[:, :1031].contiguous(), r.cuda()
    rc = rc.flatten()[1:].view(-1)[: 19 * 1031].view(19, 1031)  # contiguous, misaligned start
    assert rc.is_contiguous()
    w = torch.randn(19, dtype=torch.float64)
    a, ga = _run(lambda x, y: exact_kl(x, y, backend="cuda"), zc, rc, w)
    b, gb = _run(lambda x, y: exact_kl(x, y, backend="torch"), zc, rc, w)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    # __expf vs exp: a few fp32 ulps; bf16: one rounding step of the output
    scale = float(gb.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(ga, gb, rtol=1e-2, atol=2 ** -8 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_exact_kl_peak_memory_is_one_logits_gradient(dtype):
    """Forward + backward at N=4096, V=152064 keeps only O(N) statistics (both logits are the
    caller's) and allocates grad_logits plus O(N) vectors."""
    require_cuda_kernel()
    n, v = 4096, 152064
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(dtype).requires_grad_(True)
    r = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kl = exact_kl(z, r, backend="cuda")
    kept = torch.cuda.memory_allocated() - base
    kl.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grad_bytes = z.numel() * z.element_size()
    assert kept < 64 * n * 4, kept
    assert peak <= grad_bytes + 16 * 2**20, (peak / 2**20, grad_bytes / 2**20)
