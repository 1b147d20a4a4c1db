"""HF <-> Megatron: logits equal transformers, round trips bit-exact, bad input named."""
import json
import os
import shutil

import pytest
import torch

from megatron_rl.models import ModelArgs, hf_mapping


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(1, 1))


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("ckpt", ["tiny_qwen2", "tiny_qwen3", "tiny_llama_tied"])
def test_megatron_logits_equal_transformers(ckpt, request, single_rank):
    from megatron_rl.models.policy import Policy

    path = request.getfixturevalue(ckpt)
    args = ModelArgs.from_pretrained(path)
    policy = Policy(args, trainable=False)
    policy.load_hf(path)
    tokens = torch.randint(0, args.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(21).expand(3, 21)
    with torch.no_grad():
        ours = policy.module(tokens, pos, None)
        ref = _hf_model(path)(tokens).logits
    assert ours.shape == ref.shape == (3, 21, args.vocab_size)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("ckpt", ["tiny_qwen2", "tiny_qwen3", "tiny_llama_tied"])
def test_hf_megatron_hf_round_trip_is_bit_exact(ckpt, request):
    path = request.getfixturevalue(ckpt)
    args = ModelArgs.from_pretrained(path)
    hf = hf_mapping.load_hf_state_dict(path)
    back = hf_mapping.megatron_to_hf(hf_mapping.hf_to_megatron(hf, args), args)
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 4)])
def test_shard_then_gather_is_identity(tiny_qwen2, tp, pp):
    args = ModelArgs.from_pretrained(tiny_qwen2)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(tiny_qwen2), args)
    shards = {(r, s): hf_mapping.shard_for_rank(full, args, tp_size=tp, tp_rank=r, pp_size=pp,
                                                pp_rank=s)
              for r in range(tp) for s in range(pp)}
    # fc1 under TP holds [gate_r; up_r], not a contiguous slice of [gate; up]
    f = args.intermediate_size
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    last = shards[(tp - 1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(last[: f // tp], fc1[:f].chunk(tp)[tp - 1])
    assert torch.equal(last[f // tp:], fc1[f:].chunk(tp)[tp - 1])
    back = hf_mapping.gather_shards(shards, args, tp, pp)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_qkv_layout_groups_queries_with_their_kv_head(tiny_qwen2):
    args = ModelArgs.from_pretrained(tiny_qwen2)
    hf = hf_mapping.load_hf_state_dict(tiny_qwen2)
    qkv = hf_mapping.hf_to_megatron(hf, args)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = args.head_dim, args.num_attention_heads // args.num_key_value_heads
    rows_per_group = (per_group + 2) * d
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    g = 1  # second query group: its queries, then its k head, then its v head
    block = qkv[g * rows_per_group:(g + 1) * rows_per_group]
    assert torch.equal(block[: per_group * d], q[g * per_group * d:(g + 1) * per_group * d])
    assert torch.equal(block[per_group * d: (per_group + 1) * d], k[g * d:(g + 1) * d])
    assert torch.equal(block[(per_group + 1) * d:], v[g * d:(g + 1) * d])


def test_unsupported_architecture_is_named(tmp_path):
    cfg = {"architectures": ["MistralForCausalLM"], "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json.*MistralForCausalLM.*LlamaForCausalLM"):
        ModelArgs.from_pretrained(str(tmp_path))


def test_missing_tensor_and_shape_mismatch_are_named(tiny_qwen2):
    args = ModelArgs.from_pretrained(tiny_qwen2)
    hf = hf_mapping.load_hf_state_dict(tiny_qwen2)
    missing = dict(hf)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.weight' "
                                         r"\(expected shape \[32, 64\]\)"):
        hf_mapping.hf_to_megatron(missing, args, source="ckpt-dir")
    bad = dict(hf)
    bad["model.layers.2.mlp.up_proj.weight"] = torch.zeros(7, 64)
    with pytest.raises(ValueError, match=r"ckpt-dir: tensor 'model.layers.2.mlp.up_proj.weight': "
                                         r"expected shape \[160, 64\], found \[7, 64\]"):
        hf_mapping.hf_to_megatron(bad, args, source="ckpt-dir")


def test_failed_export_leaves_nothing_half_written(tiny_qwen2, tmp_path):
    args = ModelArgs.from_pretrained(tiny_qwen2)
    hf = hf_mapping.load_hf_state_dict(tiny_qwen2)
    target = tmp_path / "export"
    hf_mapping.save_hf_checkpoint(hf, args, str(target))
    before = (target / "model.safetensors").read_bytes()
    broken = dict(hf)
    broken["model.norm.weight"] = "not a tensor"
    with pytest.raises(AttributeError, match="detach"):  # the str has no tensor methods
        hf_mapping.save_hf_checkpoint(broken, args, str(target))
    # the previous complete export is untouched and no temporary directory is left behind
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_sharded_hf_checkpoint_round_trip(tiny_qwen2, tmp_path):
    args = ModelArgs.from_pretrained(tiny_qwen2)
    hf = hf_mapping.load_hf_state_dict(tiny_qwen2)
    hf_mapping.save_hf_checkpoint(hf, args, str(tmp_path / "sharded"), max_shard_bytes=200_000)
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors")
                                                           for f in files) > 1
    back = hf_mapping.load_hf_state_dict(str(tmp_path / "sharded"))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    os.remove(tmp_path / "sharded" / sorted(f for f in files if f.startswith("model-"))[0])
    with pytest.raises(FileNotFoundError, match="lists shard"):
        hf_mapping.load_hf_state_dict(str(tmp_path / "sharded"))
    shutil.rmtree(tmp_path / "sharded")


# On the GPU: tests/gpu/test_gpu_hf_mapping.py (fp32 and bf16).


@pytest.mark.parametrize("ckpt", ["tiny_qwen2", "tiny_llama_tied"])
def test_a_pipeline_stage_reads_only_its_tensors(ckpt, request):
    """Each stage loads only its layers (+ embedding first, norm/output last, the embedding
    also last when tied), and converts them exactly as the full conversion does."""
    path = request.getfixturevalue(ckpt)
    args = ModelArgs.from_pretrained(path)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path), args)
    hf_names = hf_mapping.hf_expected_shapes(args)
    seen = set()
    for pp_rank in range(2):
        names = hf_mapping.stage_names(hf_names, args, pp_size=2, pp_rank=pp_rank)
        hf = hf_mapping.load_hf_state_dict(path, names)
        assert set(hf) == names
        seen |= names
        stage = hf_mapping.hf_to_megatron(hf, args, pp_size=2, pp_rank=pp_rank)
        assert set(stage) == hf_mapping.stage_names(full, args, pp_size=2, pp_rank=pp_rank)
        assert all(torch.equal(stage[k], full[k]) for k in stage)
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(hf_mapping.pp_layer_range(args, 2, pp_rank))
        assert ("model.embed_tokens.weight" in names) == (pp_rank == 0 or args.tie_word_embeddings)
        assert ("model.norm.weight" in names) == (pp_rank == 1)
    assert seen == set(hf_names)
