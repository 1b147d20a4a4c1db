"""KVDecoder (megatron_rl.models.decode) against megatron-core's own forward of the same model.

A left-padded batch of unequal prompts is prefilled, then decoded one token at a time; at every
step the decoder's last-position logits must equal megatron-core's full forward of the whole
prefix (same masks, same positions) to float32 rounding. Models: tiny Qwen2 (GQA, qkv bias,
untied output), a tiny Qwen3 (q/k norms, head_dim != hidden / heads), a tiny tied Llama with
Llama-3.1 RoPE scaling and no GQA, and a tiny Qwen3-MoE (the experts each position is routed to
as well). Also: the decoder
reads the live weights, so an optimizer step is seen without any sync.
"""


import pytest
import torch

pytest.importorskip("megatron.core")

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _policy(path, lr=1e-6):
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy

    pol = Policy(ModelArgs.from_pretrained(path), trainable=True, optim=OptimConfig(lr=lr))
    pol.load_hf(path)
    return pol


def _left_padded(vocab, lens, new, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lens)
    tokens = torch.zeros(len(lens), P + new, dtype=torch.long)
    valid = torch.zeros(len(lens), P + new, dtype=torch.bool)
    for i, n in enumerate(lens):
        tokens[i, P - n:P] = torch.randint(3, vocab, (n,), generator=g)
        valid[i, P - n:] = True
    tokens[:, P:] = torch.randint(3, vocab, (len(lens), new), generator=g)
    return tokens, valid, P


def _max_decode_error(policy, lens=(1, 4, 9, 6), new=6):
    """Largest |decoder - megatron-core| logit difference over the prefill and `new` steps."""
    from megatron_rl.models.decode import KVDecoder

    tokens, valid, P = _left_padded(policy.args.vocab_size, lens, new)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    eye = torch.eye(P + new, dtype=torch.bool)
    decoder = KVDecoder(policy, len(lens), P + new)
    worst = 0.0
    for t in range(new + 1):
        s = P + t
        allowed = (torch.ones(s, s, dtype=torch.bool).tril() & valid[:, None, :s]) | eye[:s, :s]
        ref = policy.last_token_logits(tokens[:, :s], ~allowed[:, None], pos[:, :s])
        if t == 0:
            got = decoder.forward(tokens[:, :s], pos[:, :s], allowed[:, None])
        else:
            got = decoder.forward(tokens[:, s - 1:s], pos[:, s - 1:s], allowed[:, None, -1:])
        assert got.shape == (len(lens), policy.args.vocab_size) and got.dtype == torch.float32
        worst = max(worst, float((ref - got).abs().max()))
    return worst, float(ref.abs().max())


@pytest.mark.distributed
def test_decoder_matches_megatron_forward_qwen2(dist_env, tiny_qwen2):
    err, scale = _max_decode_error(_policy(tiny_qwen2))
    assert scale > 0.1 and err < 1e-5


@pytest.mark.distributed
def test_decoder_matches_megatron_forward_qwen3(dist_env, tiny_qwen3):
    policy = _policy(tiny_qwen3)
    assert policy.args.qk_norm and not policy.args.qkv_bias
    err, scale = _max_decode_error(policy)
    assert scale > 0.1 and err < 1e-5


@pytest.mark.distributed
def test_decoder_matches_megatron_forward_tied_llama_rope_scaling(dist_env, tmp_path):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(str(tmp_path / "llama31"), "llama", tie_word_embeddings=True,
                                   seed=3, num_key_value_heads=4, rope_scaling=LLAMA31_ROPE)
    policy = _policy(path)
    assert policy.args.rope_scaling_factor == 8.0 and policy.args.tie_word_embeddings
    err, scale = _max_decode_error(policy, lens=(30, 2), new=40)
    assert scale > 0.1 and err < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "pre-softmax"])
def test_decoder_matches_megatron_forward_qwen3_moe(dist_env, tmp_path, norm_topk_prob):
    """Mixture-of-experts layers (4 experts, top-2; layer 1 dense): the decoder's logits equal
    megatron-core's, and the experts it reports for every position are those megatron-core's
    router picks in the full forward of the same prefix."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint
    from megatron_rl.models.decode import KVDecoder

    path = make_tiny_hf_checkpoint(str(tmp_path / "moe"), "qwen3_moe", seed=3,
                                   norm_topk_prob=norm_topk_prob, mlp_only_layers=[1],
                                   decoder_sparse_step=1)
    policy = _policy(path)
    err, scale = _max_decode_error(policy)
    assert scale > 0.1 and err < 1e-5
    lens, new = (1, 4, 9, 6), 5
    tokens, valid, P = _left_padded(policy.args.vocab_size, lens, new, seed=1)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    S = P + new
    allowed = (torch.ones(S, S, dtype=torch.bool).tril() & valid[:, None, :S]) | torch.eye(S, dtype=torch.bool)
    decoder = KVDecoder(policy, len(lens), S)
    got: list = []
    decoder.forward(tokens[:, :P], pos[:, :P], allowed[:, None, :P, :P], routes=got)
    for s in range(P + 1, S + 1):
        decoder.forward(tokens[:, s - 1:s], pos[:, s - 1:s], allowed[:, None, s - 1:s, :s],
                        routes=got)
    kv_routes = torch.cat(got, dim=1)  # [B, S, M, k]
    ref: list = []
    policy.last_token_logits(tokens, ~allowed[:, None], pos, routes_out=ref)
    assert kv_routes.shape == ref[0].shape == (len(lens), S, 3, 2)
    # each position's set of experts (the order within the k may differ)
    assert torch.equal(kv_routes.sort(-1).values, ref[0].sort(-1).values)


@pytest.mark.distributed
def test_decoder_reads_live_weights(dist_env, tiny_qwen2):
    """After an optimizer step the next decoder (and the megatron forward) see the new weights."""
    from megatron_rl.models.decode import KVDecoder

    policy = _policy(tiny_qwen2, lr=1e-2)
    tokens = torch.tensor([[5, 6, 7, 8]])
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    pos = torch.arange(4)[None]
    before = KVDecoder(policy, 1, 4).forward(tokens, pos, allowed)
    policy.forward_backward([{"tokens": tokens}], lambda b, logits: (logits.float().pow(2).mean(),
                                                                     {}))
    assert policy.step()[0]
    after = KVDecoder(policy, 1, 4).forward(tokens, pos, allowed)
    ref = policy.last_token_logits(tokens, ~allowed, pos)
    assert float((after - before).abs().max()) > 1e-4
    torch.testing.assert_close(after, ref, rtol=0, atol=1e-5)


def test_unsupported_layout_is_named():
    from types import SimpleNamespace

    from megatron_rl.models.decode import unsupported_reason

    pp2 = SimpleNamespace(pp_size=2, config=None)
    assert "pipeline-parallel size 1" in unsupported_reason(pp2)
