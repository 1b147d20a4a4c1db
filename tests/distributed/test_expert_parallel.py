"""Expert parallelism (--expert-model-parallel-size 2) on a tiny Qwen3-MoE (4 experts, top-2, one
dense layer): two gloo ranks, each holding two experts of every sparse layer, give the logits,
loss and gradients (router and every expert, gathered) of a single process holding all four,
also when the ranks hold unequal data (other microbatch counts and shapes, packed or padded)
and replay given routes;
the weights loaded from the HF checkpoint at EP2 export back to it exactly. The shard/gather
mapping of experts over expert-parallel ranks is checked without processes too.

This file is also the torchrun worker: `python -m torch.distributed.run ... this_file --ep N`.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.models import ModelArgs, hf_mapping  # noqa: E402

ROWS, SEQ = 4, 16


def _setup(path: str, cfg):
    """(the trainable Policy holding the checkpoint in layout `cfg`, this data-parallel rank's
    rows of the ROWS x SEQ test tokens), after initialising megatron's groups."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import init_distributed

    torch.set_num_threads(1)
    dp = init_distributed(cfg)
    policy = Policy(ModelArgs.from_pretrained(path), parallel=cfg)
    policy.load_hf(path)
    tokens = torch.randint(0, policy.args.vocab_size, (ROWS, SEQ),
                           generator=torch.Generator().manual_seed(7))
    per = ROWS // dp
    rank = ps.get_data_parallel_rank()
    return policy, tokens[rank * per:(rank + 1) * per]


def _fixed_routes(policy, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, M, 2] experts to replay, unlike the router's own choice: a function of each token
    and its position only, so every layout gives every row the same routes."""
    M = sum(policy.args.moe_layer_pattern)
    first = tokens % 4
    second = (first + 1 + torch.arange(tokens.shape[1]) % 3) % 4  # never equal to first
    return torch.stack([first, second], -1)[:, :, None].expand(-1, -1, M, -1).to(torch.int16)


def _replayed_loss(policy, tokens: torch.Tensor, loss_fn, for_scoring=False) -> torch.Tensor:
    """This rank's share of the loss of one forward that replays _fixed_routes."""
    metrics = policy.forward_backward(
        [{"tokens": tokens, "routed_experts": _fixed_routes(policy, tokens)}], loss_fn,
        forward_only=True, for_scoring=for_scoring)
    return torch.tensor([float(sum(float(m["loss"]) for m in metrics))])


def _worker(path: str, out: str, ep: int) -> None:
    """Under torchrun: a trainable Policy at --expert-model-parallel-size `ep` (the data-parallel
    ranks take ROWS / world rows each) loads the checkpoint, runs forward + backward of the mean
    next-token NLL over all ROWS x (SEQ - 1) tokens, and rank 0 saves the logits of every row,
    the loss, the gathered gradients and the gathered state dict."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import ParallelConfig, destroy_distributed

    policy, mine = _setup(path, ParallelConfig(expert_model_parallel_size=ep))
    args = policy.args
    dp = ps.get_data_parallel_world_size()
    experts = sorted({k.split("local_experts.")[1].split(".")[0]
                      for k in policy.module.state_dict() if "local_experts." in k})
    assert experts == [str(e) for e in range(args.num_experts // ep)], experts
    assert ps.get_expert_model_parallel_world_size() == ep
    total = ROWS * (SEQ - 1)

    def loss_fn(batch, logits):
        logp = logits[:, :-1].float().log_softmax(-1)
        nll = -logp.gather(-1, batch["tokens"][:, 1:, None]).sum() / total
        return nll, {"loss": nll.detach().clone(), "logits": logits.detach().clone()}

    metrics = policy.forward_backward([{"tokens": mine}], loss_fn)
    loss = metrics[0]["loss"].reshape(1)
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    logits = [None] * dp
    dist.all_gather_object(logits, metrics[0]["logits"], group=ps.get_data_parallel_group())
    grads = policy.full_grads(dst=0)
    state = policy.full_state_dict(dst=0)
    replayed = _replayed_loss(policy, mine, loss_fn)
    dist.all_reduce(replayed, group=ps.get_data_parallel_group())
    if dist.get_rank() == 0:
        torch.save({"logits": torch.cat(logits), "loss": float(loss), "grads": grads,
                    "state": state, "replayed_loss": float(replayed)},
                   os.path.join(out, f"ep{ep}.pt"))
    destroy_distributed()


LAYOUTS = {"tp2": (2, 1, 1), "tp2ep2": (2, 1, 2), "pp2": (1, 2, 1)}  # (TP, PP, EP)


def _layout_worker(path: str, out: str, layout: str) -> None:
    """Under torchrun: the mean next-token NLL of ROWS x SEQ tokens and its gradients (gathered
    to full tensors) at LAYOUTS[layout] (sequence parallelism with TP), scored through
    Policy.score as in training; rank 0 saves them. At TP2 (expert-parallel size 1) the KV-cached
    decoder through the TP-split experts is also checked against megatron-core's forward."""
    import torch.distributed as dist

    from megatron_rl.batch import next_token_targets
    from megatron_rl.parallel import ParallelConfig, destroy_distributed

    tp, pp, ep = LAYOUTS[layout]
    policy, mine = _setup(path, ParallelConfig(tp, pp, sequence_parallel=tp > 1,
                                               expert_model_parallel_size=ep))
    total = ROWS * (SEQ - 1)

    def loss_fn(batch, out):
        logp = policy.score(out, next_token_targets(batch["tokens"])).logprobs[:, :-1]
        nll = -logp.sum() / total
        return nll, {"loss": nll.detach().clone()}

    metrics = policy.forward_backward([{"tokens": mine}], loss_fn, for_scoring=True)
    loss = torch.tensor([float(sum(float(m["loss"]) for m in metrics))])
    dist.all_reduce(loss)  # the last stage's TP ranks each hold their DP share's loss
    grads = policy.full_grads(dst=0)
    state = policy.full_state_dict(dst=0) if ep > 1 else None
    kv_error = None
    if ep == 1 and pp == 1:  # this rank's rows (all of them: TP2 has one replica)
        from megatron_rl.models.decode import KVDecoder

        b = mine.shape[0]
        allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None].expand(b, 1, -1, -1)
        pos = torch.arange(SEQ).expand(b, SEQ)
        ref = policy.last_token_logits(mine, ~allowed, pos)
        got = KVDecoder(policy, b, SEQ).forward(mine, pos, allowed)
        kv_error = float((ref - got).abs().max())
    replayed = _replayed_loss(policy, mine, loss_fn, for_scoring=True)
    dist.all_reduce(replayed)
    if dist.get_rank() == 0:
        torch.save({"loss": float(loss) / tp, "grads": grads, "kv_error": kv_error, "state": state,
                    "replayed_loss": float(replayed) / tp}, os.path.join(out, f"{layout}.pt"))
    destroy_distributed()


LENGTHS = [16, 11, 7, 13]  # the uneven test's sequences; EP2: rank 0 takes 3, rank 1 one


def _uneven_worker(path: str, out: str, ep: int) -> None:
    """Under torchrun: the loss and gradients of LENGTHS' sequences (next-token NLL over every
    position, / the total) with replayed routes (a fixed pattern unlike the router's own choice),
    at --expert-model-parallel-size `ep`, packed and then padded. EP2's ranks hold unequal data:
    rank 0 three sequences (three packed microbatches, or two padded ones of 16 positions), rank
    1 one of 13 tokens (one microbatch), so the forward passes of the two must be matched
    (models.runner.match_expert_peers)."""
    import torch.distributed as dist

    from megatron_rl.models.policy import Policy
    from megatron_rl.packing import Layout
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(1)
    cfg = ParallelConfig(expert_model_parallel_size=ep)
    init_distributed(cfg)
    args = ModelArgs.from_pretrained(path)
    policy = Policy(args, parallel=cfg)
    policy.load_hf(path)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, args.vocab_size, (n,), generator=gen) for n in LENGTHS]
    mine = list(range(4)) if ep == 1 else ([0, 1, 2] if dist.get_rank() == 0 else [3])
    L = max(LENGTHS[i] for i in mine)
    tokens = torch.zeros(len(mine), L, dtype=torch.long)
    M = sum(args.moe_layer_pattern)
    routes = torch.zeros(len(mine), L, M, 2, dtype=torch.int16)
    for j, i in enumerate(mine):
        tokens[j, :LENGTHS[i]] = seqs[i]
        pos = torch.arange(L)[:, None] + torch.arange(M)[None, :] + i
        routes[j, :, :, 0] = pos % 4
        routes[j, :, :, 1] = (pos + 1 + i % 3) % 4
    lengths = [LENGTHS[i] for i in mine]
    valid = torch.zeros(len(mine), L - 1)
    for j, n in enumerate(lengths):
        valid[j, :n - 1] = 1.0
    total = float(sum(n - 1 for n in LENGTHS))

    def loss_fn(batch, logits):
        mb = batch["layout"]
        logp = logits.float().log_softmax(-1).gather(-1, mb.targets[..., None])[..., 0]
        nll = -(mb.to_rows(logp) * valid[mb.rows]).sum() / total
        return nll, {"loss": nll.detach().clone()}

    for layout in ("packed", "padded"):
        lay = Layout(packed=layout == "packed", micro_batch_size=2, max_tokens=16)
        mbs = lay.microbatches(tokens, lengths, None, policy.pad_multiple, False, routes)
        metrics = policy.forward_backward([{**m.inputs, "layout": m} for m in mbs], loss_fn)
        assert len(metrics) == len(mbs)  # the padding microbatches return nothing
        loss = torch.stack([m["loss"] for m in metrics]).sum().reshape(1)
        dist.all_reduce(loss)
        grads = policy.full_grads(dst=0)
        if dist.get_rank() == 0:
            torch.save({"loss": float(loss), "grads": grads, "microbatches": len(mbs)},
                       os.path.join(out, f"uneven_ep{ep}_{layout}.pt"))
    destroy_distributed()


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_moe_ep")), "qwen3_moe",
                                   seed=3, norm_topk_prob=True, mlp_only_layers=[1],
                                   decoder_sparse_step=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_shards_gather_back_to_the_full_state_dict(moe_ckpt, tp):
    """shard_for_rank at EP2 gives each rank its half of the experts renumbered from 0 (and the
    other tensors as at EP1); gather_shards puts them back in place."""
    args = ModelArgs.from_pretrained(moe_ckpt)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(moe_ckpt), args)
    shards = {(r, 0, p): hf_mapping.shard_for_rank(full, args, tp_size=tp, tp_rank=r, ep_size=2,
                                                   ep_rank=p)
              for r in range(tp) for p in range(2)}
    e1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in shards[(0, 0, 1)]
    torch.testing.assert_close(shards[(0, 0, 1)][e1], hf_mapping.shard_for_rank(
        {e1: full["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"]}, args,
        tp_size=tp)[e1], rtol=0, atol=0)
    back = hf_mapping.gather_shards(shards, args, tp_size=tp, pp_size=1, ep_size=2)
    assert set(back) == set(full)
    for k, t in full.items():
        assert torch.equal(back[k], t), k


@pytest.fixture(scope="module")
def single_process(moe_ckpt, tmp_path_factory, torchrun):
    """The one-process reference (_worker at EP1): logits, loss, gradients, state dict."""
    out = str(tmp_path_factory.mktemp("ep1"))
    torchrun(1, [os.path.abspath(__file__), "--ckpt", moe_ckpt, "--out", out, "--ep", "1"],
             timeout=120)
    return torch.load(os.path.join(out, "ep1.pt"))


# EP2 against one process (loss, every gradient, the replayed routes, the export): the TP2 x EP2
# layout below; EP2 ranks with unequal data: the next test
@pytest.mark.distributed
@pytest.mark.extended
def test_ep2_matches_a_single_process(moe_ckpt, single_process, tmp_path, torchrun):
    worker = ["--ckpt", moe_ckpt, "--out", str(tmp_path)]
    torchrun(2, [os.path.abspath(__file__), *worker, "--ep", "2"], timeout=120)
    ref = single_process
    got = torch.load(os.path.join(tmp_path, "ep2.pt"))
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-5)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert set(got["grads"]) == set(ref["grads"])
    routers = [k for k in ref["grads"] if k.endswith("mlp.router.weight")]
    experts = [k for k in ref["grads"] if hf_mapping.is_expert_param(k)]
    assert len(routers) == 3 and len(experts) == 3 * 4 * 2, (routers, experts)
    for k in routers + experts:
        assert float(ref["grads"][k].abs().max()) > 0, k  # every expert received tokens
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{k}: {m}")
    # the weights loaded at EP2 export to exactly the checkpoint's
    args = ModelArgs.from_pretrained(moe_ckpt)
    hf = hf_mapping.load_hf_state_dict(moe_ckpt)
    exported = hf_mapping.megatron_to_hf(got["state"], args)
    assert set(exported) == set(hf)
    for k, t in hf.items():
        assert torch.equal(exported[k], t), k


@pytest.mark.distributed
def test_ep2_with_unequal_ranks_and_replayed_routes(moe_ckpt, tmp_path, torchrun):
    """Expert-parallel ranks with different numbers and shapes of microbatches (packed, then
    padded), each replaying given routes: the loss and every gradient equal one process holding
    all the data."""
    worker = ["--ckpt", moe_ckpt, "--out", str(tmp_path), "--uneven"]
    torchrun(1, [os.path.abspath(__file__), *worker, "--ep", "1"], timeout=120)
    torchrun(2, [os.path.abspath(__file__), *worker, "--ep", "2"], timeout=120)
    for layout in ("packed", "padded"):
        ref = torch.load(os.path.join(tmp_path, f"uneven_ep1_{layout}.pt"))
        got = torch.load(os.path.join(tmp_path, f"uneven_ep2_{layout}.pt"))
        assert got["microbatches"] > 1  # rank 0 ran more microbatches than rank 1's one
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), layout
        for k, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{layout} {k}: {m}")


@pytest.mark.distributed
def test_rl_training_under_ep2_with_routing_replay(tmp_path, torchrun, export_hf):
    """`megatron_rl.train` on two ranks at --expert-model-parallel-size 2 with --routing-replay,
    the local engine and prompts of different lengths (so the ranks' batches differ in shape and
    their sequences stop at different steps): 3 steps, finite, every update applied, and the
    trainer's recompute of each rollout (replaying the engine's experts) equal to the engine's
    log-probs to float rounding. The checkpoint exports to HF with every expert, trained."""
    import json

    from megatron_rl.data.records import TaskExample, write_jsonl
    from megatron_rl.experiments.tiny_model import make_char_model

    model = make_char_model(str(tmp_path / "moe"), seed=0, family="qwen3_moe")
    # a reference of other weights: the KL has a gradient from the first step (a random policy
    # earns no reward)
    ref = make_char_model(str(tmp_path / "ref"), seed=1, family="qwen3_moe")
    data = str(tmp_path / "train.jsonl")
    write_jsonl(data, [TaskExample(f"Calculate {a}+{b}." + " " * (3 * a), str(a + b),
                                   "arithmetic") for a in range(8) for b in range(8)])
    save = str(tmp_path / "run")
    torchrun(2, ["-m", "megatron_rl.train", "--hf-checkpoint", model, "--ref-checkpoint", ref,
                 "--kl-coef", "1.0", "--kl-placement", "reward+loss", "--train-data", data,
                 "--save", save, "--train-iters", "3", "--num-prompts-per-step", "4",
                 "--group-size", "2", "--max-new-tokens", "8", "--lr", "1e-2",
                 "--max-tokens-per-microbatch", "48", "--prompt-template", "{prompt}=",
                 "--no-task-instruction", "--seed", "3", "--expert-model-parallel-size", "2",
                 "--routing-replay", "--old-logprobs", "recompute", "--save-interval", "3"],
             timeout=300)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["skipped_update"] == 0 and r["grad_norm"] > 0, r
        assert r["mismatch/abs_delta_max"] < 1e-4, r["mismatch/abs_delta_max"]
        assert r["routing/differ_tokens"] < 0.05, r["routing/differ_tokens"]
    # the checkpoint, each rank holding half of the experts, exports to HF from one process
    init, trained = hf_mapping.load_hf_state_dict(model), export_hf(save, str(tmp_path / "hf"))
    assert set(trained) == set(init)
    experts = [k for k in init if ".mlp.experts." in k]
    assert len(experts) == 4 * 3  # 4 experts x (gate, up, down) of the one sparse layer
    assert all(torch.isfinite(trained[k]).all() for k in init)
    assert any(not torch.equal(trained[k], init[k]) for k in experts)  # trained experts saved


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [  # PP2 alone: tests/distributed/test_parallel_equivalence.py
    pytest.param(name, marks=[pytest.mark.extended] if name == "pp2" else []) for name in LAYOUTS])
def test_tp_pp_and_ep_layouts_match_a_single_process(moe_ckpt, single_process, tmp_path,
                                                     torchrun, layout):
    """TP2 with sequence parallelism (2 ranks), TP2 x EP2 (4 ranks: two data-parallel replicas
    whose experts are split over the pair) and PP2 (2 ranks, sparse and dense layers on
    different stages) give one process's loss and gradients, and its loss when replaying given
    routes; at TP2 the KV-cached decoder through the TP-split experts gives megatron-core's
    logits; the weights loaded with the experts split export to exactly the checkpoint's."""
    tp, pp, ep = LAYOUTS[layout]
    worker = ["--ckpt", moe_ckpt, "--out", str(tmp_path)]
    torchrun(tp * pp * ep, [os.path.abspath(__file__), *worker, "--ep", "1", "--layout", layout],
             timeout=300)
    ref = single_process
    got = torch.load(os.path.join(tmp_path, f"{layout}.pt"))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # replaying given routes (sequence-sharded under SP, per stage under PP) as one process does
    assert got["replayed_loss"] == pytest.approx(ref["replayed_loss"], rel=1e-5)
    assert abs(ref["replayed_loss"] - ref["loss"]) > 1e-3  # the replay changed the routing
    assert set(got["grads"]) == set(ref["grads"])
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{k}: {m}")
    if got["kv_error"] is not None:
        assert got["kv_error"] < 1e-5
    if got["state"] is not None:  # the weights loaded with experts split export to exactly the HF's
        hf = hf_mapping.load_hf_state_dict(moe_ckpt)
        exported = hf_mapping.megatron_to_hf(got["state"], ModelArgs.from_pretrained(moe_ckpt))
        assert set(exported) == set(hf)
        for k, t in hf.items():
            assert torch.equal(exported[k], t), k


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="EP worker of test_expert_parallel (torchrun)")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--uneven", action="store_true",
                        help="run the unequal-ranks replay worker (packed, then padded)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default=None,
                        help="run the TP/PP/EP layout worker for this layout")
    cli = parser.parse_args()
    if cli.layout:
        _layout_worker(cli.ckpt, cli.out, cli.layout)
    elif cli.uneven:
        _uneven_worker(cli.ckpt, cli.out, cli.ep)
    else:
        _worker(cli.ckpt, cli.out, cli.ep)
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
