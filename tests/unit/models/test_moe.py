"""Qwen3-MoE through megatron-core's MoE layers and the package's HF <-> Megatron mapping.

Two tiny random Qwen3-MoE checkpoints (4 experts, top-2), written by transformers:
- "renorm": norm_topk_prob=True (as Qwen3-30B-A3B), layer 1 dense through mlp_only_layers;
- "plain": norm_topk_prob=False, decoder_sparse_step=2 (layers 1 and 3 sparse).
Checked: the config mapping (megatron-core's moe_* fields, the per-layer pattern, export back to
config.json), logits equal to transformers' Qwen3MoeForCausalLM, the HF -> Megatron -> HF round
trip bit-exact and re-loadable by transformers, gradients of the router and of every expert
equal to transformers' autograd, the load-balancing loss off by default and on when asked, and
TP2 + sequence parallelism equal to TP1 and PP2 stages built with their own sparse and dense
layers (two gloo ranks, this file run under torchrun as its own worker). Expert parallelism
across processes: tests/distributed/test_expert_parallel.py.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.models import ModelArgs, hf_mapping  # noqa: E402

CHECKPOINTS = {
    "renorm": dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1),
    "plain": dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),
}
PATTERNS = {"renorm": [1, 0, 1, 1], "plain": [0, 1, 0, 1]}


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return {name: make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp(f"tiny_moe_{name}")),
                                          "qwen3_moe", seed=3, **kw)
            for name, kw in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.parallel import ParallelConfig, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(ParallelConfig(1, 1))


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens(vocab, b=3, s=21, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _megatron(path, **overrides):
    """A megatron-core GPTModel (local spec, TP1) holding the checkpoint's weights."""
    from megatron_rl.models.gpt import build_gpt_model

    args = ModelArgs.from_pretrained(path)
    model = build_gpt_model(args, use_te=False, **overrides)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path), args)
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    return args, model


def _nll(logits, tokens):
    """Summed next-token negative log-likelihood of a [b, s] batch."""
    logp = logits[:, :-1].float().log_softmax(-1)
    return -logp.gather(-1, tokens[:, 1:, None]).sum()


def _fields(args: ModelArgs) -> ModelArgs:
    """`args` without the raw config dict it was parsed from."""
    return dataclasses.replace(args, hf_config={})


def test_config_maps_the_moe_fields(moe_ckpts):
    from megatron_rl.models.config import ModelOptions, transformer_config

    for name, path in moe_ckpts.items():
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        assert raw["model_type"] == "qwen3_moe"
        args = ModelArgs.from_pretrained(path)
        assert args.family == "qwen3_moe" and args.qk_norm and not args.qkv_bias
        assert (args.num_experts, args.num_experts_per_tok,
                args.moe_intermediate_size) == (4, 2, 48)
        assert args.norm_topk_prob == CHECKPOINTS[name]["norm_topk_prob"]
        assert args.moe_layer_pattern == PATTERNS[name]
        cfg = transformer_config(args)
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 48)
        assert cfg.moe_layer_freq == PATTERNS[name]
        assert cfg.moe_router_pre_softmax == (not args.norm_topk_prob)
        assert cfg.moe_router_score_function == "softmax" and not cfg.moe_grouped_gemm
        assert cfg.moe_token_dispatcher_type == "allgather"
        assert cfg.qk_layernorm and cfg.ffn_hidden_size == args.intermediate_size
        # the load-balancing loss: off by default (the checkpoint's 0.001 is not applied)
        assert args.router_aux_loss_coef == pytest.approx(0.001)
        assert cfg.moe_router_load_balancing_type == "aux_loss" and cfg.moe_aux_loss_coeff == 0
        assert transformer_config(args, options=ModelOptions(
            moe_aux_loss_coeff=0.01)).moe_aux_loss_coeff == 0.01
        # export: the same architecture back, under both names of the expert count
        exported = args.to_hf_config()
        assert exported["model_type"] == "qwen3_moe" and exported["num_experts"] == 4
        assert _fields(ModelArgs.from_hf_config(exported)) == _fields(args)
        del raw["num_local_experts"]
        raw["num_experts"] = 4  # as released checkpoints (Qwen3-30B-A3B) name it
        assert _fields(ModelArgs.from_hf_config(raw)) == _fields(args)
    assert transformer_config(ModelArgs.from_pretrained(path)).num_moe_experts == 4


def test_moe_config_errors_are_named(moe_ckpts):
    from megatron_rl.models.config import ModelOptions, transformer_config

    with open(os.path.join(moe_ckpts["renorm"], "config.json")) as f:
        raw = json.load(f)
    bad = dict(raw, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and"):
        ModelArgs.from_hf_config(bad)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelArgs.from_hf_config(dict(raw, num_experts_per_tok=1))
    missing = {k: v for k, v in raw.items() if k != "moe_intermediate_size"}
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelArgs.from_hf_config(missing, source="ckpt/config.json")
    args = ModelArgs.from_hf_config(raw)
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        transformer_config(args, tensor_parallel=2)
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff"):
        ModelOptions(moe_aux_loss_coeff=-1.0).validate()


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_logits_equal_transformers(moe_ckpts, single_rank, name):
    from megatron_rl.models.policy import Policy

    path = moe_ckpts[name]
    args = ModelArgs.from_pretrained(path)
    policy = Policy(args, trainable=False)
    policy.load_hf(path)
    tokens = _tokens(args.vocab_size)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = policy.module(tokens, pos, None)
        ref = _hf_model(path)(tokens).logits
    assert ours.shape == ref.shape == (3, 21, args.vocab_size)
    assert float(ref.abs().max()) > 1.0
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    # the check is sensitive to the routing weights: megatron's other pre-softmax setting (the
    # renormalisation switched) moves the logits far beyond that tolerance
    _, flipped = _megatron(path, moe_router_pre_softmax=args.norm_topk_prob)
    with torch.no_grad():
        other = flipped(tokens, pos, None)
    assert float((other - ref).abs().max()) > 1e-2


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_hf_megatron_hf_round_trip_is_bit_exact(moe_ckpts, tmp_path, name):
    path = moe_ckpts[name]
    args = ModelArgs.from_pretrained(path)
    hf = hf_mapping.load_hf_state_dict(path)
    # the names and shapes on disk are exactly those the mapping expects: per-expert tensors
    hf_mapping.check_state_dict(hf, hf_mapping.hf_expected_shapes(args), path, allow_extra=False)
    assert "model.layers.3.mlp.experts.3.up_proj.weight" in hf
    mg = hf_mapping.hf_to_megatron(hf, args)
    hf_mapping.check_state_dict(mg, hf_mapping.expected_shapes(args), "megatron",
                                allow_extra=False)
    f = args.moe_intermediate_size
    fc1 = mg["decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(fc1[:f], hf["model.layers.3.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(fc1[f:], hf["model.layers.3.mlp.experts.2.up_proj.weight"])
    assert torch.equal(mg["decoder.layers.3.mlp.router.weight"],
                       hf["model.layers.3.mlp.gate.weight"])
    dense = PATTERNS[name].index(0)
    assert f"decoder.layers.{dense}.mlp.linear_fc1.weight" in mg
    assert not any(k.startswith(f"decoder.layers.{dense}.mlp.router") for k in mg)
    back = hf_mapping.megatron_to_hf(mg, args)
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k
    # an export transformers loads into the same model
    hf_mapping.save_hf_checkpoint(back, args, str(tmp_path / "export"))
    tokens = _tokens(args.vocab_size, b=2, s=9, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(_hf_model(str(tmp_path / "export"))(tokens).logits,
                                   _hf_model(path)(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_shard_then_gather_is_identity(moe_ckpts, tp, pp):
    """Each expert's fc1 is split as the dense fc1 ([gate_r; up_r] on rank r), its fc2 by
    columns, the router replicated; pipeline stages take their layers, sparse or dense."""
    args = ModelArgs.from_pretrained(moe_ckpts["renorm"])
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(moe_ckpts["renorm"]), args)
    shards = {(r, s): hf_mapping.shard_for_rank(full, args, tp_size=tp, tp_rank=r, pp_size=pp,
                                                pp_rank=s)
              for r in range(tp) for s in range(pp)}
    f, e = args.moe_intermediate_size, "mlp.experts.local_experts.1."
    fc1 = full[f"decoder.layers.0.{e}linear_fc1.weight"]
    fc2 = full[f"decoder.layers.0.{e}linear_fc2.weight"]
    last = shards[(tp - 1, 0)]
    assert torch.equal(last[f"decoder.layers.0.{e}linear_fc1.weight"],
                       torch.cat([fc1[:f].chunk(tp)[-1], fc1[f:].chunk(tp)[-1]]))
    assert torch.equal(last[f"decoder.layers.0.{e}linear_fc2.weight"], fc2.chunk(tp, dim=1)[-1])
    assert torch.equal(last["decoder.layers.0.mlp.router.weight"],
                       full["decoder.layers.0.mlp.router.weight"])
    back = hf_mapping.gather_shards(shards, args, tp, pp)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_a_pipeline_stage_reads_only_its_tensors(moe_ckpts):
    path = moe_ckpts["renorm"]
    args = ModelArgs.from_pretrained(path)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path), args)
    hf_names = hf_mapping.hf_expected_shapes(args)
    for pp_rank in range(2):
        names = hf_mapping.stage_names(hf_names, args, pp_size=2, pp_rank=pp_rank)
        stage = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path, names), args,
                                          pp_size=2, pp_rank=pp_rank)
        assert set(stage) == hf_mapping.stage_names(full, args, pp_size=2, pp_rank=pp_rank)
        assert all(torch.equal(stage[k], full[k]) for k in stage)


def _unfused(tensors, args) -> dict[str, torch.Tensor]:
    """transformers' in-memory (name, tensor) pairs under the checkpoint's per-expert names:
    transformers 5 holds a layer's experts fused, gate_up_proj [E, 2 f, h] = per expert
    cat(gate, up), and down_proj [E, h, f]."""
    f = args.moe_intermediate_size
    out = {}
    for name, t in tensors:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :f]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_gradients_of_router_and_experts_equal_transformers(moe_ckpts, single_rank, name):
    path = moe_ckpts[name]
    args, model = _megatron(path)
    tokens = _tokens(args.vocab_size, b=2, s=16, seed=2)
    model.train()
    _nll(model(tokens, torch.arange(16).expand_as(tokens), None), tokens).backward()
    ours = {k: p.grad for k, p in model.named_parameters()}
    hf_model = _hf_model(path)
    hf_model.train()
    _nll(hf_model(tokens).logits, tokens).backward()
    params = list(hf_model.named_parameters())
    # the fused in-memory layout that _unfused assumes: the weights are the checkpoint's
    disk = hf_mapping.load_hf_state_dict(path)
    weights = _unfused(((k, p.detach()) for k, p in params), args)
    assert set(weights) == set(disk) and all(torch.equal(weights[k], disk[k]) for k in disk)
    assert all(p.grad is not None for _, p in params)
    ref = hf_mapping.hf_to_megatron(_unfused(((k, p.grad) for k, p in params), args), args)
    assert set(ref) == set(ours)
    for layer, sparse in enumerate(PATTERNS[name]):
        if not sparse:
            continue
        p = f"decoder.layers.{layer}.mlp."
        assert float(ours[p + "router.weight"].abs().max()) > 1e-4
        for e in range(args.num_experts):  # every expert got tokens, and a gradient
            assert float(ours[f"{p}experts.local_experts.{e}.linear_fc1.weight"].abs().max()) > 1e-4
            assert float(ours[f"{p}experts.local_experts.{e}.linear_fc2.weight"].abs().max()) > 1e-4
    for k, g in ours.items():
        scale = max(1.0, float(ref[k].abs().max()))
        torch.testing.assert_close(g, ref[k], rtol=0, atol=2e-5 * scale,
                                   msg=lambda m: f"{k}: {m}")


def test_load_balancing_loss_reaches_the_routers_when_asked(moe_ckpts, single_rank):
    """A training step through the Policy (megatron DDP, the pipeline schedule): with
    --moe-aux-loss-coeff 0 (the default) and 0.1 the routers' gradients differ, while the
    experts of the last layer, which the load-balancing term does not reach, do not."""
    from megatron_rl.models.config import ModelOptions
    from megatron_rl.models.policy import Policy

    path = moe_ckpts["renorm"]
    args = ModelArgs.from_pretrained(path)
    tokens = _tokens(args.vocab_size, b=2, s=16, seed=4)

    def loss_fn(batch, logits):
        loss = _nll(logits, batch["tokens"]) / batch["tokens"].numel()
        return loss, {"loss": loss.detach().clone()}

    grads = {}
    for coeff in (0.0, 0.1):
        policy = Policy(args, options=ModelOptions(moe_aux_loss_coeff=coeff))
        policy.load_hf(path)
        policy.forward_backward([{"tokens": tokens}], loss_fn)
        grads[coeff] = policy.full_grads()
    last = len(PATTERNS["renorm"]) - 1
    for layer in (0, last):
        router = f"decoder.layers.{layer}.mlp.router.weight"
        assert float(grads[0.0][router].abs().max()) > 1e-4
        assert float((grads[0.1][router] - grads[0.0][router]).abs().max()) > 1e-5
    expert = f"decoder.layers.{last}.mlp.experts.local_experts.0.linear_fc2.weight"
    torch.testing.assert_close(grads[0.1][expert], grads[0.0][expert], rtol=0, atol=1e-7)


# -- TP2 + sequence parallelism against TP1, two gloo ranks -------------------------------------

def _tp_worker(path: str, out: str) -> None:
    """Under torchrun with 2 ranks: the same batch at TP1 (both ranks, DP2) and TP2 + sequence
    parallelism; rank 0 saves each layout's full logits and full gradients. Then PP2: each
    stage's model takes its shard of the weights exactly."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, init_distributed

    torch.set_num_threads(1)
    args = ModelArgs.from_pretrained(path)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path), args)
    tokens = _tokens(args.vocab_size, b=2, s=16, seed=5)
    result = {}
    for name, cfg in (("tp1", ParallelConfig()),
                      ("tp2_sp", ParallelConfig(2, sequence_parallel=True))):
        init_distributed(cfg)
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        model = build_gpt_model(args, tensor_parallel=tp, use_te=False,
                                sequence_parallel=cfg.sequence_parallel)
        missing, unexpected = model.load_state_dict(
            hf_mapping.shard_for_rank(full, args, tp_size=tp, tp_rank=tp_rank), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        model.train()
        logits = model(tokens, torch.arange(16).expand_as(tokens), None)
        logits = gather_from_tensor_model_parallel_region(logits)
        _nll(logits, tokens).backward()
        local = {}
        for k, p in model.named_parameters():
            g = p.grad.detach().clone()
            # finalize_model_grads' job in training (finalize_model_grads.py:354-355): sum the
            # partial gradients of the SP-marked weights (norms, routers) and of the q/k norms
            qk_norm = "self_attention" in k and "_layernorm" in k
            if getattr(p, "sequence_parallel", False) or qk_norm:
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            local[k] = g
        shards = [None] * tp
        dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
        result[name] = {"logits": logits.detach(), "grads": hf_mapping.gather_shards(
            {(r, 0): s for r, s in enumerate(shards)}, args, tp_size=tp, pp_size=1)}
        ps.destroy_model_parallel()
    # PP2: each stage builds its own layers, sparse or dense, and takes exactly its shard
    init_distributed(ParallelConfig(1, 2))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = build_gpt_model(args, pipeline_parallel=2, use_te=False)
    missing, unexpected = model.load_state_dict(
        hf_mapping.shard_for_rank(full, args, pp_size=2, pp_rank=pp_rank), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    routers = sorted(k for k in model.state_dict() if k.endswith("router.weight"))
    assert routers == [f"decoder.layers.{i}.mlp.router.weight" for i in range(2)
                       if PATTERNS["renorm"][2 * pp_rank + i]], routers
    ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, "moe_tp.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_sequence_parallel_matches_tp1(moe_ckpts, tmp_path):
    from megatron_rl.rollout.net import free_port

    path = moe_ckpts["renorm"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", os.path.abspath(__file__),
           "--ckpt", path, "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = torch.load(os.path.join(tmp_path, "moe_tp.pt"))
    ref, tp2 = result["tp1"], result["tp2_sp"]
    torch.testing.assert_close(tp2["logits"], ref["logits"], rtol=0, atol=1e-5)
    assert set(tp2["grads"]) == set(ref["grads"])
    assert any(".mlp.router." in k for k in ref["grads"])
    for k, g in ref["grads"].items():
        torch.testing.assert_close(tp2["grads"][k], g, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{k}: {m}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="TP worker of test_tp2_sequence_... (torchrun)")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    _tp_worker(cli.ckpt, cli.out)
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
