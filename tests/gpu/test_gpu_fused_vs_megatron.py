"""The fused op `megatron_rl.ops.token_logprobs_and_kl` at TP1 on the GPU against megatron-core's
`vocab_parallel_cross_entropy` (log p = -CE): per-token log-probs and their gradients, with the
CUDA kernel and the pure-PyTorch backend, in fp32 and bf16."""
import pytest
import torch

from gpu_helpers import require_cuda_kernel, single_gpu_rank
from megatron_rl.ops import token_logprobs_and_kl

pytestmark = pytest.mark.gpu


def _megatron_logprobs_and_grad(logits, targets, weights):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    n, v = logits.shape
    x = logits.detach().clone().requires_grad_(True)
    lp = -vocab_parallel_cross_entropy(x.view(n, 1, v), targets.view(n, 1)).view(n)
    (lp * weights).sum().backward()
    return lp.detach().float(), x.grad


def _ours_logprobs_and_grad(logits, targets, weights, backend):
    x = logits.detach().clone().requires_grad_(True)
    lp = token_logprobs_and_kl(x, targets, backend=backend).logprobs
    (lp * weights).sum().backward()
    return lp.detach().float(), x.grad


@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,vocab", [(257, 152064), (33, 32001), (1, 151936)])
def test_fused_op_matches_megatron_cross_entropy(backend, dtype, rows, vocab):
    if backend == "cuda":
        require_cuda_kernel()
    single_gpu_rank()
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    weights = torch.randn(rows, device="cuda", generator=gen)
    mc_lp, mc_grad = _megatron_logprobs_and_grad(logits, targets, weights)
    lp, grad = _ours_logprobs_and_grad(logits, targets, weights, backend)
    assert grad.dtype == mc_grad.dtype == dtype
    torch.testing.assert_close(lp, mc_lp, rtol=1e-6, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(grad, mc_grad, rtol=1e-5, atol=1e-7)
    else:  # both round an fp32 gradient to bf16: at most an ulp or two apart
        torch.testing.assert_close(grad.float(), mc_grad.float(), rtol=2 ** -7, atol=1e-6)
