"""HF -> Megatron mapping on the GPU: the megatron-core policy's logits equal transformers' for
tiny Qwen2 (qkv bias, GQA), Qwen3 (q/k norms, head_dim != hidden / heads) and tied Llama,
in fp32 (to float rounding) and in bf16 (within a small multiple of transformers' own bf16
error, both measured against transformers in fp32)."""
import pytest
import torch

from gpu_helpers import single_gpu_rank

pytestmark = pytest.mark.gpu
CHECKPOINTS = ["tiny_qwen2", "tiny_qwen3", "tiny_llama_tied"]


def _hf_logits(path, tokens, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _megatron_logits(path, tokens, dtype):
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy

    args = ModelArgs.from_pretrained(path)
    policy = Policy(args, trainable=False, params_dtype=dtype)
    policy.load_hf(path)
    assert next(policy.parameters()).is_cuda, "the policy was not built on the GPU"
    b, s = tokens.shape
    pos = torch.arange(s, device="cuda").expand(b, s)
    with torch.no_grad():
        return policy.module(tokens, pos, None).float()


def _tokens(path, b=3, s=37):
    from megatron_rl.models import ModelArgs

    vocab = ModelArgs.from_pretrained(path).vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, vocab, (b, s), device="cuda", generator=gen)


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_fp32_logits_equal_transformers_on_gpu(ckpt, request):
    single_gpu_rank()
    path = request.getfixturevalue(ckpt)
    tokens = _tokens(path)
    ours = _megatron_logits(path, tokens, torch.float32)
    ref = _hf_logits(path, tokens, torch.float32)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_bf16_logits_track_transformers_on_gpu(ckpt, request):
    single_gpu_rank()
    path = request.getfixturevalue(ckpt)
    tokens = _tokens(path)
    exact = _hf_logits(path, tokens, torch.float32)
    hf_err = (_hf_logits(path, tokens, torch.bfloat16) - exact).abs()
    ours_err = (_megatron_logits(path, tokens, torch.bfloat16) - exact).abs()
    # a mapping error gives O(1) differences; bf16 rounding gives ~1e-2
    assert ours_err.max() <= 4 * hf_err.max() + 1e-3, (ours_err.max(), hf_err.max())
    assert ours_err.mean() <= 2 * hf_err.mean() + 1e-4, (ours_err.mean(), hf_err.mean())
