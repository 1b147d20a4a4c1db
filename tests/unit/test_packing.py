"""Packing sequences into token-budget microbatches (megatron_rl.packing): the plan, the packed
row's contents, and the round trip of per-token values back to the batch's layout."""
import pytest
import torch

from megatron_rl.packing import (Layout, balance_groups, first_fit_decreasing,
                                 packed_microbatches, padded_microbatches)


def test_balance_groups_deals_every_group_once_and_evens_the_tokens():
    tokens = [900, 30, 35, 40, 800, 50, 60, 70, 45, 55, 20, 1000]
    parts = balance_groups(tokens, 3)
    assert sorted(g for p in parts for g in p) == list(range(len(tokens)))
    assert [len(p) for p in parts] == [4, 4, 4]
    loads = [sum(tokens[g] for g in p) for p in parts]
    # round-robin (the old dealing) would put 900, 800 and 1000 on ranks 0, 1, 2 anyway, but
    # also leave 1000 + 60 + ... : balanced loads differ by less than the smallest big group
    assert max(loads) - min(loads) < 200, loads
    assert balance_groups([5, 5, 5], 1) == [[0, 1, 2]]
    assert balance_groups([3, 1], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError):
        balance_groups([1], 0)


def test_first_fit_decreasing_respects_the_budget():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in bins of 10: the optimum
    with pytest.raises(ValueError, match="sequence 2 has 9 tokens.*--max-tokens-per-microbatch 8"):
        first_fit_decreasing(lengths, 8)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (5, 12), generator=g)
    lengths = [12, 4, 9, 6, 3]
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0  # right padding
    return tokens, lengths


def test_packed_rows_restart_positions_and_unpack_exactly():
    tokens, lengths = _batch()
    mbs = packed_microbatches(tokens, lengths, [0, 1, 2, 3, 4], max_tokens=16, pad_multiple=8)
    seen = sorted(int(r) for mb in mbs for r in mb.rows)
    assert seen == [0, 1, 2, 3, 4]
    # a per-position function of the packed row (here: the target token as a float) comes back
    # equal to the same function on the padded layout at every position that scores a token
    padded_targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)[:, :-1].float()
    for mb in mbs:
        t = mb.inputs["tokens"]
        assert t.shape[0] == 1 and t.shape[1] % 8 == 0 and t.shape[1] <= 16
        cu = mb.inputs["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == t.shape[1]
        assert mb.inputs["cu_seqlens_host"] == tuple(cu)  # the same boundaries, on the host
        assert mb.inputs["cu_seqlens"].dtype == torch.int32
        assert mb.inputs["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        pos = mb.inputs["position_ids"][0]
        for a, b in zip(cu, cu[1:]):
            if b > a and a < sum(lengths[int(r)] for r in mb.rows):
                assert pos[a:b].tolist() == list(range(b - a))
        back = mb.to_rows(mb.targets.float())
        for j, r in enumerate(mb.rows.tolist()):
            n = lengths[r]
            assert torch.equal(back[j, :n - 1], padded_targets[r, :n - 1])
            assert torch.all(back[j, n - 1:] == 0)
            assert torch.equal(t[0, cu[j]:cu[j] + n], tokens[r, :n])


def test_equal_shapes_and_layout():
    tokens, lengths = _batch()
    mbs = packed_microbatches(tokens, lengths, range(5), 16, 8, equal_shapes=True)
    assert len({mb.inputs["tokens"].shape for mb in mbs}) == 1
    pad = padded_microbatches(tokens, [0, 2, 4], 2, equal_shapes=True)
    assert [mb.inputs["tokens"].shape[0] for mb in pad] == [2, 2]
    assert pad[1].to_rows(torch.ones(2, 12)).shape == (1, 11)
    assert len(Layout(packed=True, micro_batch_size=2).microbatches(tokens, lengths)) == 2
    assert len(Layout(packed=False, micro_batch_size=2).microbatches(tokens, lengths)) == 3
    with pytest.raises(ValueError, match="max-tokens-per-microbatch"):
        Layout(packed=True, max_tokens=10).microbatches(tokens, lengths)


def _minibatches_over_ranks(num_groups, tokens, dp_size, packing, num_minibatches):
    """The PPO minibatches of one batch, as sets of group indices over all data-parallel ranks:
    each rank's groups as the orchestrator deals them (_deal_groups), cut into equal slices as
    update.train_on_batch cuts a rank's rows."""
    from types import SimpleNamespace

    from megatron_rl.rollout_queue import _deal_groups

    groups = [[SimpleNamespace(group=g, prompt_ids=[0] * 3, response_ids=[0] * tokens[g])]
              for g in range(num_groups)]
    minibatches = [set() for _ in range(num_minibatches)]
    for rank in range(dp_size):
        mine = _deal_groups(groups, dp_size, rank, num_minibatches, packing)
        per_mb = len(mine) // num_minibatches
        for k in range(num_minibatches):
            minibatches[k] |= {g[0].group for g in mine[k * per_mb:(k + 1) * per_mb]}
    return minibatches


@pytest.mark.parametrize("num_minibatches", [2, 4])
def test_a_ppo_minibatch_holds_the_same_groups_at_every_data_parallel_size_and_packing(
        num_minibatches):
    """Which sequences share an optimizer step is the run's, not its layout's: a resume onto
    another node count (DP2 -> DP4) or with packing switched continues the same updates."""
    g = torch.Generator().manual_seed(0)
    n = 16
    block = n // num_minibatches
    expected = [set(range(k * block, (k + 1) * block)) for k in range(num_minibatches)]
    for _ in range(200):  # random response lengths: the packed dealing follows them
        tokens = torch.randint(1, 400, (n,), generator=g).tolist()
        for dp_size in (1, 2, 4):
            for packing in (False, True):
                got = _minibatches_over_ranks(n, tokens, dp_size, packing, num_minibatches)
                assert got == expected, (dp_size, packing, tokens)


def test_packed_dealing_balances_each_minibatch_over_the_ranks():
    from megatron_rl.packing import rank_groups

    tokens = [900, 30, 800, 40, 50, 1000, 70, 950]  # two minibatches of 4 groups
    shares = [rank_groups(tokens, 2, r, 2, balance=True) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8))
    for k in range(2):
        loads = [sum(tokens[g] for g in s[2 * k:2 * k + 2]) for s in shares]
        assert max(loads) - min(loads) <= 100, (k, loads)
    assert rank_groups(tokens, 2, 1, 2, balance=False) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="do not split"):
        rank_groups(tokens, 3, 0, 2, balance=True)


# -- shape bucketing -------------------------------------------------------------------------

def _long_tailed_lengths(rng, n, max_response, prompt=64):
    """Sequence lengths as tools/bench_train_phase.py draws them: a prompt of prompt +- 25%
    tokens per group of 8, responses log-normal with median max_response / 4 and sigma 1,
    clipped to [8, max_response]."""
    import math

    out = []
    for _ in range(n // 8):
        p = rng.randint(round(0.75 * prompt), round(1.25 * prompt))
        out += [p + min(max_response, max(8, round(rng.lognormvariate(
            math.log(max_response / 4), 1.0)))) for _ in range(8)]
    return out


@pytest.mark.parametrize("pad_multiple", [8, 16])
def test_bucketed_lengths_hold_the_row_within_the_budget_in_at_most_16_shapes(pad_multiple):
    from megatron_rl.packing import SHAPE_BUCKETS, bucket_quantum, bucketed_length

    for budget in (40, 100, 256, 1000, 2208, 4096, 6144, 8192, 8352):
        cap = -(-budget // pad_multiple) * pad_multiple
        q = bucket_quantum(budget, pad_multiple)
        seen = set()
        for n in range(1, budget + 1):
            t = bucketed_length(n, budget, pad_multiple)
            assert n <= t <= cap and t % pad_multiple == 0 and t - n < q, (budget, n, t)
            seen.add(t)
        assert len(seen) <= SHAPE_BUCKETS, (budget, sorted(seen))
    with pytest.raises(ValueError, match="over its budget"):
        bucketed_length(4097, 4096)


@pytest.mark.parametrize("max_response, budget", [(1024, 2304), (1024, 4096), (4096, 8192)])
def test_bucketing_bounds_the_row_shapes_of_1000_long_tailed_batches(max_response, budget):
    """1,000 random batches of 32 long-tailed sequences packed into a fixed token budget:
    unbucketed (rows padded to a multiple of 8) they take one row length per handful of
    microbatches; bucketed, at most SHAPE_BUCKETS (16) row lengths over all of them, for fewer
    than 5% padding tokens added to the real ones (about 1% here: most rows are filled to the
    budget, which is a bucket of its own)."""
    import random

    from megatron_rl.packing import SHAPE_BUCKETS

    rng = random.Random(max_response + budget)
    tokens = torch.zeros(32, max_response + 96, dtype=torch.long)
    shapes = {False: set(), True: set()}
    padded = {False: 0, True: 0}
    real = 0
    for _ in range(1000):
        lengths = _long_tailed_lengths(rng, 32, max_response)
        real += sum(lengths)
        for bucket in (False, True):
            for mb in Layout(packed=True, max_tokens=budget, bucket=bucket).microbatches(
                    tokens, lengths):
                shapes[bucket].add(mb.num_tokens)
                padded[bucket] += mb.num_tokens
    assert len(shapes[True]) <= SHAPE_BUCKETS, sorted(shapes[True])
    assert len(shapes[False]) > 3 * SHAPE_BUCKETS  # what the bound replaces
    assert (padded[True] - real) / real < 0.05, (padded[True] - real) / real


def test_a_bucketed_row_pads_with_segments_of_their_own():
    """The bucket's padding follows the sequences as segments of at most PAD_SEGMENT tokens and
    unpacks to nothing; the sequences' tokens, positions and segments are those of the
    unbucketed row."""
    from megatron_rl.packing import bucketed_length

    tokens, lengths = _batch()  # 34 tokens in sequences of 12, 4, 9, 6, 3
    lengths = [n * 30 for n in lengths]
    tokens = tokens.repeat_interleave(30, dim=1)
    (plain,) = packed_microbatches(tokens, lengths, range(5), max_tokens=8000)
    (mb,) = packed_microbatches(tokens, lengths, range(5), max_tokens=8000, bucket=True)
    # q = ceil(8000 / 16) rounded up to 8 = 504: 1020 real tokens -> 1512
    assert plain.num_tokens == 1024 and mb.num_tokens == bucketed_length(1020, 8000) == 1512
    cu = mb.inputs["cu_seqlens"].tolist()
    assert cu == plain.inputs["cu_seqlens"].tolist()[:-1] + [1276, 1512]
    assert mb.inputs["max_seqlen"] == 360
    assert not mb.inputs["position_ids"][0, 1020:].any()  # as the unbucketed row's padding
    assert torch.equal(mb.unpack, plain.unpack) and torch.equal(mb.valid, plain.valid)
    assert torch.equal(mb.inputs["tokens"][:, :1020], plain.inputs["tokens"][:, :1020])
    assert torch.equal(mb.inputs["position_ids"][:, :1020], plain.inputs["position_ids"][:, :1020])
    assert mb.inputs["cu_seqlens_host"] == tuple(cu)
    (pp,) = packed_microbatches(tokens, lengths, range(5), 8000, equal_shapes=True, bucket=True)
    assert pp.num_tokens == 1512


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("equal_shapes", [False, True])
def test_every_packed_row_carries_its_boundaries_on_the_host(bucket, equal_shapes):
    """cu_seqlens_host equals cu_seqlens in every row shape packing makes (padding to the pad
    multiple, bucketed lengths, the pipeline's equal shapes), and a row grown by padding
    (packing.pad_segments, as match_expert_peers grows one) keeps both in step: its padding in
    segments of at most PAD_SEGMENT tokens, max_seqlen the longest segment."""
    from megatron_rl.packing import PAD_SEGMENT, host_segment_bounds, pad_segments

    tokens, lengths = _batch()
    lengths = [n * 30 for n in lengths]
    tokens = tokens.repeat_interleave(30, dim=1)
    mbs = Layout(packed=True, max_tokens=600, bucket=bucket).microbatches(
        tokens, lengths, equal_shapes=equal_shapes)
    assert len(mbs) > 1
    for mb in mbs:
        host = mb.inputs["cu_seqlens_host"]
        assert host == tuple(mb.inputs["cu_seqlens"].tolist())
        assert host[-1] == mb.num_tokens
        grown = pad_segments(mb.inputs, 600)
        cu = grown["cu_seqlens"].tolist()
        assert grown["cu_seqlens_host"] == tuple(cu) and cu[:len(host)] == list(host)
        assert cu[-1] == mb.num_tokens + 600
        assert [b - a for a, b in zip(cu[len(host) - 1:], cu[len(host):])] == [256, 256, 88]
        assert grown["max_seqlen"] == max(mb.inputs["max_seqlen"], PAD_SEGMENT)
        assert grown["cu_seqlens"].dtype == torch.int32
        assert grown["cu_seqlens"].device == mb.inputs["cu_seqlens"].device
        # inputs built without the host copy: read back from the device once, same result
        bare = {k: v for k, v in mb.inputs.items() if k != "cu_seqlens_host"}
        assert host_segment_bounds(bare) == host
        assert pad_segments(bare, 600)["cu_seqlens_host"] == grown["cu_seqlens_host"]


def _trainer_loss(fused: bool):
    """(policy, batch, advantages, reference log-probs, loss function): a tiny megatron Qwen2
    at TP1 (fused LM head or logits), a batch of 8 rollouts of unequal lengths in 4 groups, and
    the trainer's RL loss over it (update.make_rl_loss_fn, k3 KL in the loss)."""
    from megatron_rl.batch import pack_rollouts
    from megatron_rl.kl import KLConfig
    from megatron_rl.loss import LossConfig, build_advantages
    from megatron_rl.models.config import ModelArgs, ModelOptions
    from megatron_rl.models.policy import Policy
    from megatron_rl.rollout.base import Completion
    from megatron_rl.rollout.single_turn import single_turn_groups
    from megatron_rl.update import make_rl_loss_fn

    args = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, qkv_bias=True,
                     max_position_embeddings=256, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    policy = Policy(args, options=ModelOptions(fused_lm_head=fused))
    g = torch.Generator().manual_seed(1)
    rng = torch.Generator().manual_seed(2)
    groups = []
    for _ in range(4):
        group = []
        for _ in range(2):
            n = int(torch.randint(3, 60, (1,), generator=rng))
            ids = torch.randint(3, 96, (n,), generator=rng).tolist()
            group.append(Completion(ids, (-torch.rand(n, generator=rng)).tolist(), "stop"))
        groups.append(group)
    prompts = [torch.randint(3, 96, (5 + k,), generator=rng).tolist() for k in range(4)]
    batch = pack_rollouts(single_turn_groups(prompts, groups, torch.rand(8, generator=g).tolist()),
                          pad_token_id=0)
    batch.old_logprobs = batch.rollout_logprobs + 0.1 * torch.randn(batch.loss_mask.shape,
                                                                    generator=g)
    ref = batch.old_logprobs + 0.1 * torch.randn(batch.loss_mask.shape, generator=g)
    cfg = LossConfig(kl=KLConfig("k3", "loss", coef=0.1))
    adv = build_advantages(batch.rewards, batch.old_logprobs, ref, batch.loss_mask, cfg,
                           batch.group_size)
    loss_fn = make_rl_loss_fn(policy, cfg, float(batch.loss_mask.sum()), 8.0)
    return policy, batch, adv, ref, loss_fn


def _losses_and_grads(policy, microbatches, loss_fn):
    """([the microbatches' losses], {name: main gradient}) of one forward_backward."""
    results = policy.forward_backward(microbatches, loss_fn, for_scoring=True)
    return (torch.stack([r["loss"] for r in results if r]),
            {k: v.clone() for k, v in policy.full_grads(dst=None).items()})


def _assert_same_losses_and_grads(got, expected):
    (loss, grads), (plain_loss, plain_grads) = got, expected
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert float(plain_loss.abs().max()) > 0
    for name, grad in plain_grads.items():
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_bucketing_leaves_the_trainers_loss_and_gradients_unchanged(dist_env, fused):
    """The trainer's loss function (update.make_rl_loss_fn) over a tiny megatron Qwen2 at TP1
    on packed microbatches, with and without bucketing: the same losses and main gradients to
    fp32 rounding, while the bucketed rows are longer (their padding, a segment of its own,
    scores nothing)."""
    pytest.importorskip("megatron.core")
    from megatron_rl.update import loss_microbatch

    policy, batch, adv, ref, loss_fn = _trainer_loss(fused)
    got, rows = {}, {}
    for bucket in (False, True):
        lay = Layout(packed=True, max_tokens=200, bucket=bucket)
        mbs = lay.microbatches(batch.tokens, batch.seq_lengths, None, policy.pad_multiple)
        rows[bucket] = [m.num_tokens for m in mbs]
        got[bucket] = _losses_and_grads(
            policy, [loss_microbatch(batch, adv, ref, m) for m in mbs], loss_fn)
    assert len(rows[True]) == len(rows[False]) > 1 and sum(rows[True]) > sum(rows[False])
    assert all(r % 16 == 0 or r == 200 for r in rows[True]), rows  # q = ceil(200 / 16) -> 16
    _assert_same_losses_and_grads(got[True], got[False])


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_expert_peers_padding_leaves_the_trainers_loss_and_gradients_unchanged(
        dist_env, monkeypatch, fused):
    """Packed microbatches made alike as expert-parallel peers make them
    (runner.match_expert_peers, here as if a peer held one more microbatch, 64 tokens wider
    than the widest: every row grown by padding segments, and a padding microbatch) give the
    trainer's loss function the same losses and main gradients as the microbatches as they
    were: the runner cuts a grown row's output back to its own length before the loss."""
    pytest.importorskip("megatron.core")
    from megatron_rl import parallel
    from megatron_rl.models import runner
    from megatron_rl.update import loss_microbatch

    policy, batch, adv, ref, loss_fn = _trainer_loss(fused)
    mbs = Layout(packed=True, max_tokens=200, bucket=True).microbatches(
        batch.tokens, batch.seq_lengths, None, policy.pad_multiple)
    micro = [loss_microbatch(batch, adv, ref, m) for m in mbs]
    expected = _losses_and_grads(policy, micro, loss_fn)
    all_reduce = parallel.all_reduce

    def a_larger_peer(values, group=None, op=None):  # [microbatches, b, s, packed]
        got = all_reduce(values, group)
        return got + torch.tensor([1.0, 0, 64, 0], dtype=got.dtype, device=got.device)

    monkeypatch.setattr(parallel, "all_reduce", a_larger_peer)
    grown = runner.match_expert_peers(micro, None)
    width = max(m.num_tokens for m in mbs) + 64
    assert len(grown) == len(micro) + 1 and grown[-1]["_dummy"]
    assert all(mb["tokens"].shape == (1, width) for mb in grown)
    for mb in grown:
        assert mb["cu_seqlens"].tolist() == list(mb["cu_seqlens_host"])
        assert mb["cu_seqlens_host"][-1] == width
    _assert_same_losses_and_grads(_losses_and_grads(policy, grown, loss_fn), expected)
