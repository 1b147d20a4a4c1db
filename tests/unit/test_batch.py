"""batch.pack_rollouts: trajectories -> RolloutBatch rows. The loss mask and the engine's
log-probs sit at the positions that score the tokens the policy sampled -- also when a
trajectory holds several policy spans with environment tokens between them (a multi-turn
rollout), whose positions are context only."""
import pytest
import torch

from megatron_rl.batch import Trajectory, pack_rollouts
from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.single_turn import single_turn_groups, single_turn_trajectory

PROMPT = [1, 2, 3]
# two policy turns ([10, 11] and [12, 13]) around an environment message ([20, 21, 22]); the
# log-probs the function wrote at the environment's tokens are not the engine's and must not
# reach the batch
TURNS = Trajectory(prompt_ids=PROMPT, response_ids=[10, 11, 20, 21, 22, 12, 13],
                   response_mask=[1, 1, 0, 0, 0, 1, 1],
                   rollout_logprobs=[-0.1, -0.2, -9.0, -9.0, -9.0, -0.3, -0.4],
                   finish_reason="stop", reward=1.0, metadata={"turns": 2})


def _policy_tokens(batch, row):
    """(token, rollout log-prob) at every position the loss trains on, in order."""
    return [(int(batch.tokens[row, t + 1]), float(batch.rollout_logprobs[row, t]))
            for t in range(batch.loss_mask.shape[1]) if batch.loss_mask[row, t] == 1]


def test_two_policy_spans_with_environment_tokens_between():
    one_turn = single_turn_trajectory(PROMPT, Completion([30, 31], [-0.5, -0.6], "length"), 0.0)
    batch = pack_rollouts([[TURNS, one_turn]], pad_token_id=0)
    assert batch.tokens[0, :10].tolist() == PROMPT + TURNS.response_ids
    assert batch.prompt_lengths == [3, 3] and batch.response_lengths == [7, 2]
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.finish_reasons == ["stop", "length"]
    # position t scores token t+1: the prompt's last position scores the first response token
    assert batch.loss_mask[0].tolist()[:11] == [0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert _policy_tokens(batch, 0) == [(10, pytest.approx(-0.1)), (11, pytest.approx(-0.2)),
                                        (12, pytest.approx(-0.3)), (13, pytest.approx(-0.4))]
    # nothing of the environment's turn: 0 wherever the loss mask is
    assert torch.equal(batch.rollout_logprobs[0] * (1 - batch.loss_mask[0]),
                       torch.zeros_like(batch.rollout_logprobs[0]))
    assert _policy_tokens(batch, 1) == [(30, pytest.approx(-0.5)), (31, pytest.approx(-0.6))]
    assert batch.loss_mask[1].sum() == 2 and batch.tokens.shape[1] % 8 == 0


def test_single_turn_trajectories_train_on_the_whole_completion():
    groups = [[Completion([5, 6, 7], [-0.5, -0.7, -0.1], "stop"), Completion([8], [-0.2], "length")],
              [Completion([9, 2], [-1.0, -0.3], "stop"), Completion([3, 4], [-0.4] * 2, "stop")]]
    prompts = [[1, 2, 3], [4]]
    batch = pack_rollouts(single_turn_groups(prompts, groups, [1.0, 0.0, 0.0, 1.0]),
                          pad_token_id=0)
    for row, (p, c) in enumerate((p, c) for p, g in zip(prompts, groups) for c in g):
        assert _policy_tokens(batch, row) == [(t, pytest.approx(lp))
                                              for t, lp in zip(c.token_ids, c.rollout_logprobs)]
        assert batch.loss_mask[row, :len(p) - 1].sum() == 0


def test_trajectory_lengths_must_agree():
    bad = Trajectory(PROMPT, [10, 11], [1], [-0.1, -0.2], "stop", 0.0)
    with pytest.raises(ValueError, match="2 response tokens has 1 mask values and 2 log-probs"):
        pack_rollouts([[bad]], pad_token_id=0)
