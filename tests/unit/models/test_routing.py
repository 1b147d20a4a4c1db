"""Routing replay (megatron_rl.models.routing) on a tiny Qwen3-MoE (4 experts, top-2, layers 0, 2
and 3 sparse) in one process.

Checked: the engine's record covers every forwarded token (prompt + response - 1) of every
sequence; replaying a forward's own routes changes nothing, replaying other routes changes the
output (so replay acts); packed and padded microbatches replay the same routes token for token;
and the property replay exists for: when the trainer's router disagrees with the engine's at
near-ties, the trainer's log-probs of the rollout equal the engine's to float rounding with
replay and differ without it, and the routing/* metrics count the tokens that moved.
"""
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.models import ModelArgs, routing  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_moe_routing")), "qwen3_moe",
                                   seed=3, norm_topk_prob=True, mlp_only_layers=[1],
                                   decoder_sparse_step=1)


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.parallel import ParallelConfig, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(ParallelConfig(1, 1))


def _policy(path):
    from megatron_rl.models.policy import Policy

    policy = Policy(ModelArgs.from_pretrained(path), trainable=False)
    policy.load_hf(path)
    return policy


def _rollout(policy, seed=1, max_new_tokens=7):
    """(batch, completions) of 2 samples per prompt from the local engine, routes recorded."""
    from megatron_rl.batch import pack_rollouts
    from megatron_rl.rollout.single_turn import single_turn_groups
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    engine = LocalEngine(policy)
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=max_new_tokens, seed=seed,
                                                        return_routed_experts=True))
    batch = pack_rollouts(single_turn_groups(PROMPTS, groups, [0.0] * 6), pad_token_id=0)
    return batch, [c for g in groups for c in g]


def _masked_max(a, b, mask):
    return float(((a - b).abs() * mask).max())


def test_engine_records_every_forwarded_token(moe_path, single_rank):
    policy = _policy(moe_path)
    batch, completions = _rollout(policy)
    args = policy.args
    for i, c in enumerate(completions):
        p = len(PROMPTS[i // 2])
        assert c.routed_experts.shape == (p + len(c.token_ids) - 1, 3, args.num_experts_per_tok)
        r = c.routed_experts.long()
        assert int(r.min()) >= 0 and int(r.max()) < args.num_experts
        assert bool((r[..., 0] != r[..., 1]).all())  # k distinct experts per token
    assert batch.routed_experts.shape == (6, batch.tokens.shape[1], 3, 2)
    # the record is the trainer's own routing (same weights, fp32): a forward that records
    # the teacher-forced batch picks the same experts at every forwarded position
    rec: list = []
    policy.forward_backward([{"tokens": batch.tokens, "record_routes": rec}], None,
                            forward_only=True, collect=lambda b, out: out[:, :1])
    own = rec[0]
    for i, c in enumerate(completions):
        n = c.routed_experts.shape[0]
        same = (own[i, :n].long().sort(-1).values == c.routed_experts.long().sort(-1).values)
        assert float(same.all(-1).float().mean()) == 1.0, i


def test_replay_acts_and_own_routes_change_nothing(moe_path, single_rank):
    from megatron_rl.packing import Layout

    policy = _policy(moe_path)
    batch, _ = _rollout(policy)
    lay = Layout(packed=False, micro_batch_size=4)
    mask = batch.loss_mask
    free = policy.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths)
    own = policy.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths,
                                routes=batch.routed_experts)
    assert _masked_max(own, free, mask) < 1e-6
    other = (batch.routed_experts + 1) % policy.args.num_experts  # every token elsewhere
    moved = policy.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths, routes=other)
    assert _masked_max(moved, free, mask) > 1e-2
    # packed microbatches carry the same routes to the same tokens as padded ones
    packed = policy.token_logprobs(batch.tokens, Layout(packed=True, max_tokens=24),
                                   seq_lengths=batch.seq_lengths, routes=other)
    assert _masked_max(packed, moved, mask) < 1e-5


def test_router_order_matches_what_the_router_sees():
    routes = torch.arange(2 * 5 * 1 * 2).reshape(2, 5, 1, 2)  # [b, s, M, k]
    flat = routing.router_order(routes, 6)
    assert flat.shape == (12, 1, 2)
    assert torch.equal(flat[1], routes[1, 0]) and torch.equal(flat[2], routes[0, 1])
    assert torch.equal(flat[10, 0], torch.tensor([0, 1]))  # padding routes to experts 0..k-1
    half = routing.router_order(routes, 6, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert torch.equal(half, flat[6:])


def test_replay_gives_the_engines_logprobs_after_a_router_step(moe_path, single_rank):
    """After an optimizer step that changes the router, the engine's rollout (sampled before
    it) and the trainer disagree at near-ties, as engines with other kernels or weights an
    update apart do: two experts of the first sparse layer share one router row while the
    engine samples, so the engine breaks their ties one way; the step (Adam, lr 1e-5, a loss of
    that row alone, so no other weight moves) changes the second expert's row, and the trainer
    sends part of those tokens to it. Gate values move by ~1e-5 only, the chosen experts'
    outputs by far more: with replay the trainer's log-probs equal the engine's to that, without
    they do not."""
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy

    policy = Policy(ModelArgs.from_pretrained(moe_path), optim=OptimConfig(lr=1e-5))
    policy.load_hf(moe_path)
    router = routing.moe_layers(policy.module)[0][1]
    w = router.weight
    w.data[1] = w.data[0]
    batch, _ = _rollout(policy, seed=2, max_new_tokens=10)
    engine_lp = batch.rollout_logprobs
    mask = batch.loss_mask
    before = {k: v.detach().clone() for k, v in policy.module.state_dict().items()
              if v is not None and torch.is_tensor(v)}
    direction = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))

    def row_loss(mb, logits):  # depends on router row 1 only (the logits term is 0)
        loss = (w[1] * direction).sum() + 0.0 * logits.float().sum()
        return loss, {}

    policy.forward_backward([{"tokens": batch.tokens[:1]}], row_loss)
    assert policy.step()[0]
    after = policy.module.state_dict()
    moved = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert moved == [k for k in before if k.endswith("layers.0.mlp.router.weight")], moved
    from megatron_rl.packing import Layout

    lay = Layout(packed=True)
    rec: list = []
    policy.forward_backward([{"tokens": batch.tokens, "record_routes": rec}], None,
                            forward_only=True, collect=lambda b, out: out[:, :1])
    changed = (rec[0][:, :, 0].sort(-1).values
               != batch.routed_experts[:, :, 0].long().sort(-1).values).any(-1)
    valid = torch.zeros_like(changed)
    for i, n in enumerate(batch.seq_lengths):
        valid[i, :n - 1] = True
    assert 0 < int((changed & valid).sum()), "no token changed experts: the test lost its point"
    without = policy.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths)
    own: list = []
    with_replay = policy.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths,
                                        routes=batch.routed_experts, own_routes=own)
    assert _masked_max(with_replay, engine_lp, mask) < 1e-4
    assert _masked_max(without, engine_lp, mask) > 1e-2
    # while replaying, the routers' own choice is noted: the routing/* metrics count the moves
    from megatron_rl.metrics import routing_metrics

    L = batch.tokens.shape[1]
    assert own[0].shape == (6, L - 1, 3, 2)
    m = routing_metrics(own[0], batch.routed_experts, batch.seq_lengths)
    moved = int((changed & valid)[:, :L - 1].sum())
    assert m["routing/differ_tokens"] == pytest.approx(moved / int(valid.sum()))
    assert m["routing/differ_token_layers"] == pytest.approx(moved / (3 * int(valid.sum())))


def test_routes_of_a_dense_model_are_refused(tiny_qwen2, single_rank):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LocalEngine(_policy(tiny_qwen2)).generate(
            PROMPTS, 1, SamplingParams(max_new_tokens=2, return_routed_experts=True))
