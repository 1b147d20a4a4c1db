"""Per-turn rewards in the advantage (--turn-credit): by default the trajectory's reward is the
sum of its turn rewards, one return per sequence, as before; with to-go each policy token's
return holds the rewards of its turn and of the later ones, from the agent loop through
pack_rollouts to build_advantages.

The policy is test_agent_loop's scripted engine; the environment, the loop, pack_rollouts and
the advantages are real."""
import pytest
import torch
from test_env import _encode, _run

from megatron_rl.agent.env import Environment, StepResult
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.batch import Trajectory, pack_rollouts
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.loss import LossConfig, build_advantages, turn_rewards_to_go
from megatron_rl.rollout.functions import check_groups

HERE = __name__


class TwoScoredTurns(Environment):
    """Turn 1 scored metadata["first"] and asked again, turn 2 scored 1 and done."""

    def reset(self, record):
        self.first, self.turns = record.metadata["first"], 0

    def step(self, turn):
        self.turns += 1
        if self.turns == 1:
            return StepResult("again", reward=self.first)
        return StepResult(reward=1.0, done=True)


def _advantages(batch, credit, estimator="reinforce"):
    logprobs = torch.zeros_like(batch.loss_mask)  # the policy is the reference: no KL
    return build_advantages(batch.rewards, logprobs, logprobs, batch.loss_mask,
                            LossConfig(advantage_estimator=estimator, turn_credit=credit),
                            batch.group_size, in_baseline=batch.in_baseline,
                            token_rewards=batch.token_rewards)


def test_turn_rewards_to_go_from_the_loop_to_the_advantages(tokenizer, scorer):
    records = [PromptRecord(f"g:{i}", "Go:", "arithmetic", "0", {"first": first})
               for i, first in enumerate((0.25, 0.5))]
    config = AgentConfig(agent_environment=f"{HERE}:TwoScoredTurns", agent_max_turns=2)
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records, config)
    turn = len(_encode(tokenizer, "1<eos>"))
    env = len(_encode(tokenizer, "\nagain\n"))
    t = groups[1][0]
    assert (t.turn_rewards, t.turn_ends, t.reward) == ([0.5, 1.0], [turn, 2 * turn + env], 1.5)
    batch = pack_rollouts(groups, pad_token_id=0)
    # each turn's reward at the position that scores the turn's last token; a row sums to R
    start = len(t.prompt_ids) - 1
    assert batch.token_rewards is not None
    assert batch.token_rewards[2, start + turn - 1] == 0.5
    assert batch.token_rewards[2, start + 2 * turn + env - 1] == 1.0
    assert torch.equal(batch.token_rewards.sum(-1), batch.rewards)
    # the sum rule: one return per sequence, the trajectory's reward
    assert _advantages(batch, "sum").tolist() == [1.25, 1.25, 1.5, 1.5]
    # to go: turn 1's tokens get both turns' rewards, turn 2's the second's, the environment's 0
    adv = _advantages(batch, "to-go")
    row = adv[2, start:start + 2 * turn + env].tolist()
    assert row == [1.5] * turn + [0.0] * env + [1.0] * turn
    assert adv[0, start:start + turn].tolist() == [1.25] * turn
    # RLOO per token: the baseline at each position is the other sample's return there
    rloo = _advantages(batch, "to-go", "rloo")
    assert torch.equal(rloo, torch.zeros_like(rloo))  # both samples of a group score alike


def test_to_go_keeps_what_the_turn_rewards_do_not_hold_at_the_end():
    """A reward beyond its turn rewards (the overlong penalty added to R) is seen by every
    token; a trajectory without turn rewards gets its reward at every token (the sum's)."""
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 1, 1, 0]])
    token_rewards = torch.tensor([[0.0, 0.5, 0, 1.0], [0, 0, 0, 0]])
    rewards = torch.tensor([1.5 - 0.25, 2.0])
    out = turn_rewards_to_go(rewards, rewards, token_rewards, mask)
    assert out.tolist() == [[1.25, 1.25, 0, 0.75], [2, 2, 2, 0]]
    assert turn_rewards_to_go(rewards, rewards, None, mask).tolist() == [
        [1.25, 1.25, 0, 1.25], [2, 2, 2, 0]]


def test_the_sum_rule_ignores_where_the_turn_rewards_lie():
    groups = [[Trajectory([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, 0, -0.2], "stop", 1.5,
                          turn_rewards=[0.5, 1.0], turn_ends=[1, 3]),
               Trajectory([1, 2], [3, 4], [1, 1], [-0.1, -0.2], "stop", 0.0)]]
    check_groups(groups, 1, 2, "agent")
    batch = pack_rollouts(groups, pad_token_id=0)
    with_turns = _advantages(batch, "sum", "rloo")
    batch.token_rewards = None
    assert torch.equal(with_turns, _advantages(batch, "sum", "rloo"))
    assert with_turns.tolist() == [1.5, -1.5]


@pytest.mark.parametrize("ends,message", [([1], "without one turn reward each"),
                                          ([2, 1], "not ascending"), ([1, 4], "not ascending")])
def test_turn_ends_are_checked(ends, message):
    t = Trajectory([1], [3, 4, 5], [1, 0, 1], [-0.1, 0, -0.2], "stop", 1.5,
                   turn_rewards=[0.5, 1.0], turn_ends=ends)
    with pytest.raises(ValueError, match=message):
        check_groups([[t]], 1, 1, "agent")


def test_sequence_level_losses_refuse_turn_rewards_to_go():
    with pytest.raises(ValueError, match="--turn-credit to-go makes them per token"):
        LossConfig(policy_loss="gspo", turn_credit="to-go").validate()
    LossConfig(policy_loss="gspo-token", turn_credit="to-go").validate()
