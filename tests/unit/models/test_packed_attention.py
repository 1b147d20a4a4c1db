"""Packed sequences (THD) through the policy model on the local layer spec (SDPAttention).

Several sequences share one row, input_ids [1, T], with trailing padding as a segment of its
own, and megatron-core's PackedSeqParams (qkv_format "thd") delimit them. Checked on tiny
Qwen2-shaped models (GQA, qkv bias; tied and untied embeddings) and a Qwen3 (q/k norms):
- every real position's logits equal those of its sequence run alone, to fp32 rounding;
- the gradient of a loss over the real positions equals the sum of the per-sequence gradients;
- RoPE restarts at 0 in every sequence: the queries and keys that core attention receives for
  a sequence placed second are those of the sequence alone (logits alone cannot show this:
  RoPE scores depend only on relative positions, so continued positions would change them
  by rounding only);
- per-slot padding (cu_seqlens_q_padded), and the errors for malformed PackedSeqParams;
- TP2 and TP2 + sequence parallelism give TP1's packed logits and gradients (two gloo ranks,
  this file run under torchrun as its own worker).
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

QWEN2 = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, qkv_bias=True, max_position_embeddings=64,
             rope_theta=1_000_000.0)
QWEN3 = dict(QWEN2, architecture="Qwen3ForCausalLM", head_dim=16, qkv_bias=False, qk_norm=True)
LENS, TOTAL = (5, 11, 3, 8), 32  # 27 tokens, then a padding segment of 5


def _model(seed=0, **kw):
    """A tiny model whose every parameter (qkv biases and norms included) is perturbed away
    from megatron's initialisation, so that each one shapes the logits."""
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.gpt import build_gpt_model

    args = ModelArgs(**{**QWEN2, **kw})
    torch.manual_seed(seed)
    model = build_gpt_model(args, use_te=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return args, model


def _row(vocab, lens=LENS, total=TOTAL, seed=0):
    """Random tokens for the packed row [1, total], next-token targets for it, and per-segment
    positions (padding included): what a packer hands the model."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, total), generator=g)
    targets = torch.randint(0, vocab, (1, total), generator=g)
    pad = [total - sum(lens)] if total > sum(lens) else []
    pos = torch.cat([torch.arange(n) for n in (*lens, *pad)])[None]
    return ids, targets, pos


def _spans(lens):
    start = 0
    for n in lens:
        yield start, start + n
        start += n


def _nll(logits, targets):
    return -logits.float().log_softmax(-1).gather(-1, targets[..., None]).sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["qwen2_untied", "qwen2_tied", "qwen3"])
def test_packed_logits_equal_each_sequence_alone(dist_env, kind):
    from megatron_rl.models.gpt import make_packed_seq_params

    kw = {"qwen2_untied": {}, "qwen2_tied": dict(tie_word_embeddings=True), "qwen3": QWEN3}[kind]
    args, model = _model(**kw)
    assert args.tie_word_embeddings == (kind == "qwen2_tied")
    ids, _, pos = _row(args.vocab_size)
    params = make_packed_seq_params(LENS, TOTAL)
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=params)
        assert packed.shape == (1, TOTAL, args.vocab_size)
        assert torch.isfinite(packed).all()  # the padding segment too
        for a, b in _spans(LENS):
            alone = model(ids[:, a:b], torch.arange(b - a)[None], None)
            assert float(alone.abs().max()) > 0.1
            torch.testing.assert_close(packed[:, a:b], alone, rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("tied", [False, True])
def test_packed_gradient_is_the_sum_of_per_sequence_gradients(dist_env, tied):
    from megatron_rl.models.gpt import make_packed_seq_params

    args, model = _model(tie_word_embeddings=tied)
    ids, targets, pos = _row(args.vocab_size)
    real = torch.zeros(TOTAL, dtype=torch.bool)
    real[:sum(LENS)] = True
    logits = model(ids, pos, None, packed_seq_params=make_packed_seq_params(LENS, TOTAL))
    _nll(logits[:, real], targets[:, real]).backward()
    packed = _grads(model)
    model.zero_grad()
    for a, b in _spans(LENS):
        _nll(model(ids[:, a:b], torch.arange(b - a)[None], None), targets[:, a:b]).backward()
    summed = _grads(model)
    assert set(packed) == set(summed)
    assert all(float(g.abs().max()) > 1e-3 for g in summed.values())  # every parameter is used
    for name, g in summed.items():
        torch.testing.assert_close(packed[name], g, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def _layer0_qk(model, ids, **kw):
    """The query and key (after RoPE) that layer 0's core attention receives, as [t, heads, d]."""
    seen = {}

    def hook(module, args):
        seen["q"], seen["k"] = (t.detach().reshape(t.shape[0], *t.shape[-2:]) for t in args[:2])

    handle = model.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(ids, torch.arange(ids.shape[1])[None], None, **kw)
    finally:
        handle.remove()
    return seen["q"], seen["k"]


@pytest.mark.distributed
def test_rope_restarts_at_zero_in_every_sequence(dist_env):
    """A sequence placed second gets the rotated queries and keys of the sequence alone, and
    its logits; with one segment spanning both (positions continuing) its queries differ."""
    from megatron_rl.models.gpt import make_packed_seq_params

    args, model = _model(rope_theta=10_000.0)
    lens, total = (9, 7), 20
    ids, _, _ = _row(args.vocab_size, lens, total, seed=3)
    second = slice(9, 16)
    q, k = _layer0_qk(model, ids, packed_seq_params=make_packed_seq_params(lens, total))
    q_alone, k_alone = _layer0_qk(model, ids[:, second])
    torch.testing.assert_close(q[second], q_alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(k[second], k_alone, rtol=0, atol=1e-6)
    with torch.no_grad():
        packed = model(ids, None, None, packed_seq_params=make_packed_seq_params(lens, total))
        alone = model(ids[:, second], torch.arange(7)[None], None)
    torch.testing.assert_close(packed[:, second], alone, rtol=0, atol=1e-5)
    # the check above is sensitive: positions continued from 9 rotate the queries elsewhere
    q_continued, _ = _layer0_qk(model, ids, packed_seq_params=make_packed_seq_params([16], total))
    assert float((q_continued[second] - q_alone).abs().max()) > 0.1


@pytest.mark.distributed
def test_padded_slots_cu_seqlens_q_padded(dist_env):
    """cu_seqlens_q_padded (each sequence in a slot padded at its end, as for context
    parallelism) sets the segments; the real tokens at the start of each slot give the
    logits of the sequence alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    args, model = _model()
    lens, slots = (5, 11, 3), (8, 12, 4)
    ids, _, _ = _row(args.vocab_size, slots, sum(slots), seed=5)
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=12, max_seqlen_kv=12)
    with torch.no_grad():
        packed = model(ids, None, None, packed_seq_params=params)
        for (a, _), n in zip(_spans(slots), lens):
            alone = model(ids[:, a:a + n], torch.arange(n)[None], None)
            torch.testing.assert_close(packed[:, a:a + n], alone, rtol=0, atol=1e-5)


def test_make_packed_seq_params_layout():
    from megatron_rl.models.gpt import make_packed_seq_params

    p = make_packed_seq_params([5, 11, 3], 24)
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == [0, 5, 16, 19, 24] and p.cu_seqlens_kv is p.cu_seqlens_q
    assert p.max_seqlen_q == p.max_seqlen_kv == 11
    full = make_packed_seq_params([4, 4], 8)  # no padding: no padding segment
    assert full.cu_seqlens_q.tolist() == [0, 4, 8] and full.max_seqlen_q == 4
    assert make_packed_seq_params([3], 10).max_seqlen_q == 7  # the padding is the longest
    with pytest.raises(ValueError, match="more than total_len"):
        make_packed_seq_params([5, 6], 10)
    with pytest.raises(ValueError, match="positive"):
        make_packed_seq_params([5, 0], 10)


def test_packed_segment_bounds_refuses_malformed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models.gpt import packed_segment_bounds

    def params(cu, m, cu_kv=None):
        cu = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                               cu_seqlens_kv=cu if cu_kv is None else torch.tensor(cu_kv),
                               max_seqlen_q=m, max_seqlen_kv=m)

    assert packed_segment_bounds(params([0, 3, 3, 10], 7), 10) == [0, 3, 3, 10]
    assert packed_segment_bounds(params([0, 10], 10), 10) == [0, 10]
    with pytest.raises(ValueError, match="rise from 0"):
        packed_segment_bounds(params([0, 3, 8], 5), 10)  # padding not a segment of its own
    with pytest.raises(ValueError, match="rise from 0"):
        packed_segment_bounds(params([0, 6, 3, 10], 7), 10)
    with pytest.raises(ValueError, match="continue positions"):
        packed_segment_bounds(params([0, 3, 10], 10), 10)
    assert packed_segment_bounds(params([0, 3, 10], 10), 10, check_rope=False) == [0, 3, 10]
    with pytest.raises(NotImplementedError, match="self-attention"):
        packed_segment_bounds(params([0, 3, 10], 7, cu_kv=[0, 5, 10]), 10)


@pytest.mark.distributed
def test_sdpattention_refuses_other_packed_formats(dist_env):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models.gpt import make_packed_seq_params

    _, model = _model()
    core = model.decoder.layers[0].self_attention.core_attention
    q, kv = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    with pytest.raises(NotImplementedError, match="thd"):
        core(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="no attention_mask"):
        core(q, kv, kv, torch.zeros(1, 1, 10, 10, dtype=torch.bool),
             packed_seq_params=make_packed_seq_params([4], 10))
    out = core(q, kv, kv, None, packed_seq_params=make_packed_seq_params([4], 10))
    assert out.shape == (10, 32)


# -- TP2 and TP2 + sequence parallelism against TP1, two gloo ranks ------------------------------

TP_LENS, TP_TOTAL = (5, 9, 3), 24  # a multiple of TP: sequence parallelism scatters the row


def _tp_worker(out: str) -> None:
    """Under torchrun with 2 ranks: the same packed row at TP1 (both ranks, DP2), TP2 and TP2 +
    sequence parallelism; rank 0 saves each layout's full logits and full gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.models import hf_mapping
    from megatron_rl.models.gpt import build_gpt_model, make_packed_seq_params
    from megatron_rl.parallel import ParallelConfig, init_distributed

    torch.set_num_threads(1)
    result, full = {}, None
    for name, cfg in (("tp1", ParallelConfig()), ("tp2", ParallelConfig(2)),
                      ("tp2_sp", ParallelConfig(2, sequence_parallel=True))):
        init_distributed(cfg)
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if full is None:
            args, model = _model(seed=7)
            full = {k: v.detach().clone() for k, v in model.state_dict().items()
                    if torch.is_tensor(v) and not k.endswith("_extra_state")}
        else:
            model = build_gpt_model(args, tensor_parallel=tp, use_te=False,
                                    sequence_parallel=cfg.sequence_parallel)
            missing, unexpected = model.load_state_dict(
                hf_mapping.shard_for_rank(full, args, tp_size=tp, tp_rank=tp_rank), strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        assert model.config.sequence_parallel == cfg.sequence_parallel
        ids, targets, pos = _row(args.vocab_size, TP_LENS, TP_TOTAL, seed=11)
        logits = model(ids, pos, None, packed_seq_params=make_packed_seq_params(TP_LENS,
                                                                                TP_TOTAL))
        logits = gather_from_tensor_model_parallel_region(logits)
        n = sum(TP_LENS)
        _nll(logits[:, :n], targets[:, :n]).backward()
        local = {}
        for k, p in model.named_parameters():
            g = p.grad.detach().clone()
            if getattr(p, "sequence_parallel", False):  # finalize_model_grads' job in training
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            local[k] = g
        shards = [None] * tp
        dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
        result[name] = {"logits": logits.detach(), "grads": hf_mapping.gather_shards(
            {(r, 0): s for r, s in enumerate(shards)}, args, tp_size=tp, pp_size=1)}
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, "packed_tp.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_packed_tp2_and_sequence_parallel_match_tp1(tmp_path):
    from megatron_rl.rollout.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", os.path.abspath(__file__),
           "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = torch.load(os.path.join(tmp_path, "packed_tp.pt"))
    ref = result["tp1"]
    assert ref["logits"].shape == (1, TP_TOTAL, QWEN2["vocab_size"])
    for name in ("tp2", "tp2_sp"):
        torch.testing.assert_close(result[name]["logits"], ref["logits"], rtol=0, atol=1e-5)
        assert set(result[name]["grads"]) == set(ref["grads"])
        for k, g in ref["grads"].items():
            torch.testing.assert_close(result[name]["grads"][k], g, rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"{name} {k}: {m}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="TP worker of test_packed_tp2_... (torchrun)")
    parser.add_argument("--out", required=True)
    _tp_worker(parser.parse_args().out)
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
