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

    from megatron_rl.rollout.orchestrate import _deal_groups

    groups = [[SimpleNamespace(group=g, prompt_ids=[0] * 3, response_ids=[0] * tokens[g])]
              for g in range(num_groups)]
    cfg = SimpleNamespace(algorithm=SimpleNamespace(sequence_packing=packing,
                                                    ppo_minibatches=num_minibatches))
    minibatches = [set() for _ in range(num_minibatches)]
    for rank in range(dp_size):
        mine = _deal_groups(SimpleNamespace(cfg=cfg, dp_size=dp_size, dp_rank=rank), groups)
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
