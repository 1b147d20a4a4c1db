"""Train-vs-rollout log-prob mismatch metric against hand-computed values."""

import math

import pytest
import torch

from megatron_rl.rollout.mismatch import logprob_mismatch, pad_ragged


def test_hand_computed_values():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.9]])
    train = torch.tensor([[-1.1, -1.8, -3.0], [-0.5, -0.2, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m = logprob_mismatch(rollout, train, mask)
    deltas = [-0.1, 0.2, 0.0, 0.0, 0.3]
    assert m.num_tokens == 5 and m.num_sequences == 2
    assert m.abs_delta_mean == pytest.approx(sum(abs(d) for d in deltas) / 5, abs=1e-6)
    assert m.abs_delta_max == pytest.approx(0.3, abs=1e-6)
    assert m.delta_mean == pytest.approx(sum(deltas) / 5, abs=1e-6)
    w = torch.tensor([math.exp(0.1), math.exp(0.3)], dtype=torch.float64)
    assert m.seq_weight_mean == pytest.approx(float(w.mean()), abs=1e-6)
    assert m.seq_weight_min == pytest.approx(math.exp(0.1), abs=1e-6)
    assert m.seq_weight_max == pytest.approx(math.exp(0.3), abs=1e-6)
    assert m.seq_weight_std == pytest.approx(float(w.std(unbiased=False)), abs=1e-6)


def test_identical_logprobs_give_unit_weights():
    lp = -torch.rand(4, 7) * 3
    m = logprob_mismatch(lp, lp.clone(), torch.ones(4, 7))
    assert m.abs_delta_max == 0 and m.seq_weight_min == m.seq_weight_max == 1.0
    assert m.seq_weight_std == 0.0


def test_sequences_without_tokens_are_not_counted():
    lp = torch.zeros(3, 2)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    m = logprob_mismatch(lp, lp + 0.5, mask)
    assert m.num_sequences == 2
    assert m.seq_weight_min == pytest.approx(math.exp(0.5))
    assert m.seq_weight_max == pytest.approx(math.exp(1.0))


def test_empty_mask_and_bad_shapes():
    m = logprob_mismatch(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert m.num_tokens == 0 and m.abs_delta_max == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="dims"):
        logprob_mismatch(torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_pad_ragged_and_as_dict():
    x, mask = pad_ragged([[-1.0, -2.0], [], [-3.0]])
    assert x.shape == (3, 2) and mask.tolist() == [[True, True], [False, False], [True, False]]
    d = logprob_mismatch(x, x, mask).as_dict()
    assert d["mismatch/num_tokens"] == 3.0 and "mismatch/seq_weight_std" in d


def test_combined_shards_equal_the_whole_batch():
    """Data-parallel shards' statistics combine into the whole batch's."""
    from megatron_rl.rollout.mismatch import combine

    gen = torch.Generator().manual_seed(0)
    rollout, train = torch.randn(9, 6, generator=gen), torch.randn(9, 6, generator=gen) * 0.1
    mask = (torch.rand(9, 6, generator=gen) > 0.3).float()
    mask[4] = 0  # a sequence with no response token
    whole = logprob_mismatch(rollout, rollout + train, mask)
    parts = [logprob_mismatch(rollout[s], rollout[s] + train[s], mask[s])
             for s in (slice(0, 2), slice(2, 7), slice(7, 9))]
    for k, v in combine(parts).as_dict().items():
        assert v == pytest.approx(whole.as_dict()[k], rel=1e-12, abs=1e-12), k
