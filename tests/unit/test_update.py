"""The policy update's glue (megatron_rl.update) around stand-in models: the global
normalizers each optimizer step's loss function gets."""
import types

import pytest
import torch

import megatron_rl.update as update
from megatron_rl.batch import pack_rollouts
from megatron_rl.config import TrainConfig
from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.single_turn import single_turn_groups


def _batch(first="stop"):
    """Two prompts x two samples; the second sample of the first prompt hit --max-new-tokens,
    the first one too where `first` is "length"."""
    groups = [[Completion([5, 6, 7, 8], [-0.5, -0.7, -0.1, -0.3], first),
               Completion([8, 9, 2, 3], [-0.2] * 4, "length")],
              [Completion([9, 2], [-1.0, -0.3], "stop"),
               Completion([3, 4, 5, 6], [-0.4] * 4, "stop")]]
    batch = pack_rollouts(single_turn_groups([[1, 2, 3], [4]], groups, [1.0, 0.0, 0.0, 1.0]),
                          pad_token_id=0)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    return batch


@pytest.mark.parametrize("first, expected", [("stop", [(4.0, 1.0), (6.0, 2.0)]),
                                             ("length", [(0.0, 1.0), (6.0, 2.0)])])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_mean_normalizer_counts_only_sequences_with_loss_tokens(aggregation, first,
                                                                    expected, monkeypatch):
    """With --overlong-filtering a truncated response keeps its row but loses its loss tokens:
    each PPO minibatch's num_global_seqs counts the sequences that still have loss tokens
    (minibatch [0, 1]: 1, minibatch [2, 3]: 2), so a filtered response does not shrink the loss
    of the others. A minibatch whose every response was filtered gets 1 (its loss is 0, not
    0/0, which would count as a non-finite update)."""
    cfg = TrainConfig()
    cfg.algorithm.ppo_minibatches = 2
    cfg.algorithm.loss.aggregation = aggregation
    cfg.algorithm.loss.overlong_filtering = True
    cfg.rollout.max_new_tokens = 4
    batch = _batch(first)
    seen = []

    def fake_loss_fn(policy, loss_cfg, num_global_tokens, num_global_seqs, reference=None):
        seen.append((num_global_tokens, num_global_seqs))
        return None

    monkeypatch.setattr(update, "make_rl_loss_fn", fake_loss_fn)
    result = {"loss": torch.zeros(()), "num_tokens": torch.ones(())}
    policy = types.SimpleNamespace(
        pad_multiple=1, pp_size=1, lr=1.0, parameters=lambda: [], step=lambda: (True, 1.0),
        forward_backward=lambda micro, loss_fn, reference=None, for_scoring=True: [result])
    reference = types.SimpleNamespace(
        token_logprobs=lambda tokens, lay, seq_lengths=None: torch.zeros(batch.loss_mask.shape))
    assert update.train_on_batch(policy, reference, cfg, batch, {})
    assert seen == expected


def test_a_filtered_response_stays_in_its_groups_baseline_per_token_too(monkeypatch):
    """--overlong-filtering takes a truncated response out of the loss, not out of its group's
    baseline: with per-token advantages (--turn-credit to-go; single-turn rows have no turn
    rewards, so each token's return is the sequence's) every loss token gets the advantage the
    per-sequence path gives its row."""
    seen = {}
    real = update.build_advantages

    def record(*args, **kwargs):
        out = real(*args, **kwargs)
        seen[args[4].turn_credit] = out
        return out

    monkeypatch.setattr(update, "build_advantages", record)
    monkeypatch.setattr(update, "make_rl_loss_fn", lambda *a, **k: None)
    result = {"loss": torch.zeros(()), "num_tokens": torch.ones(())}
    for turn_credit in ("sum", "to-go"):
        cfg = TrainConfig()
        cfg.algorithm.loss.overlong_filtering = True
        cfg.algorithm.loss.turn_credit = turn_credit
        cfg.rollout.max_new_tokens = 4
        batch = _batch()
        policy = types.SimpleNamespace(
            pad_multiple=1, pp_size=1, lr=1.0, parameters=lambda: [], step=lambda: (True, 1.0),
            forward_backward=lambda micro, loss_fn, reference=None, for_scoring=True: [result])
        reference = types.SimpleNamespace(
            token_logprobs=lambda tokens, lay, seq_lengths=None: torch.zeros(batch.loss_mask.shape))
        update.train_on_batch(policy, reference, cfg, batch, {})
        mask = batch.loss_mask
    per_sequence, per_token = seen["sum"], seen["to-go"]
    assert per_token.dim() == 2 and per_sequence.dim() == 1
    # the first group's two responses have 4 tokens each (a per-token baseline is taken over the
    # members with a token at t, so only equal lengths give the per-sequence numbers); row 1 is
    # the filtered one, and row 0's advantage is R_0 - R_1 (KL included) either way
    expected = per_sequence[:2].unsqueeze(-1).expand(2, per_token.shape[1]) * mask[:2]
    torch.testing.assert_close(per_token[:2] * mask[:2], expected)
    assert per_sequence[0] != 0 and mask[1].sum() == 4
