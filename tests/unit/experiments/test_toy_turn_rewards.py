"""The toy's per-turn rewards: trajectories of policy turns and environment answers, each turn
rewarded, the objective E[sum_j R_j] - KL(P_theta || P_ref). Checked by exact enumeration through
the production code: crediting every token with the sum of the turn rewards (the agent loop's
rule) and crediting each turn's tokens with the rewards from it on (with the KL to go) are both
unbiased; the last turn's reward alone, or a turn credited with the rewards before it, are not."""
import pytest
import torch

from megatron_rl.experiments.toy import (DEFAULT_ENV, DEFAULT_PARAMS, ENV_LAYOUTS, TOOL_REWARD,
                                         BinaryARPolicy, all_sequences, policy_token_mask,
                                         prefix_features, reward_events, trajectory_kl_gradient,
                                         trajectory_logprobs, turn_credit_moments,
                                         turn_credit_returns, turn_reward_objective_gradient,
                                         turn_reward_study)

SEQ_LEN = 6
THETA, REF, _ = DEFAULT_PARAMS["count"]
ENV = DEFAULT_ENV["count"]
UNBIASED = 1e-20  # bias^2: |E[grad] - grad J| below 1e-10


def test_turns_and_their_rewards_on_a_trajectory():
    # policy 0 1 | env 1 | policy 1 | env 0 | policy 1: turns (0, 1), (1), (1)
    y = torch.tensor([[0.0, 1, 1, 1, 0, 1]])
    mask = policy_token_mask(y, "call")
    assert mask.tolist() == [[1, 1, 0, 1, 0, 1]]
    events = reward_events(y, mask)
    assert events.tolist() == [[0, 0, TOOL_REWARD, 0, 0, 1]]  # R = (0.25, 0, 1)
    total = TOOL_REWARD + 1
    assert turn_credit_returns(events, mask, "sum").tolist() == [[total, total, 0, total, 0,
                                                                  total]]
    assert turn_credit_returns(events, mask, "to-go").tolist() == [[total, total, 0, 1, 0, 1]]
    assert turn_credit_returns(events, mask, "last-turn").tolist() == [[1, 1, 0, 1, 0, 1]]
    assert turn_credit_returns(events, mask, "to-date").tolist() == [
        [TOOL_REWARD, TOOL_REWARD, 0, TOOL_REWARD, 0, total]]


@pytest.mark.parametrize("layout", ENV_LAYOUTS)
def test_the_objective_gradient_is_the_score_function_sum(layout):
    """grad J by autograd of the enumeration = E[(sum_j R_j - log P_theta/P_ref) S_P], the
    score over the policy's tokens, computed without autograd; with no reward, g* of the KL."""
    y = all_sequences(SEQ_LEN)
    mask = policy_token_mask(y, layout)
    policy, ref, env = (BinaryARPolicy(*p) for p in (THETA, REF, ENV))
    with torch.no_grad():
        lp = trajectory_logprobs(policy, env, y, mask).sum(-1)[0]
        lq = trajectory_logprobs(ref, env, y, mask).sum(-1)[0]
        dz = ((y - torch.sigmoid(policy.logits(y))) * mask)[0]
        score = torch.stack([dz.sum(-1), (dz * prefix_features(y, "count")[0]).sum(-1)], -1)
        total = reward_events(y, mask).sum(-1)[0]
    by_score = (lp.exp() * (total - (lp - lq))) @ score
    g = turn_reward_objective_gradient(THETA, REF, ENV, SEQ_LEN, layout=layout)
    assert torch.allclose(g, by_score, atol=1e-13, rtol=0)
    # the reward moves the gradient: J is not the KL alone
    assert (g + trajectory_kl_gradient(THETA, REF, ENV, SEQ_LEN, layout=layout)).abs().max() > 0.01


@pytest.mark.parametrize("layout", ENV_LAYOUTS)
def test_the_sum_and_to_go_credits_are_unbiased_the_others_not(layout):
    g = turn_reward_objective_gradient(THETA, REF, ENV, SEQ_LEN, layout=layout)
    bias, variance = {}, {}
    for credit in ("sum", "to-go", "last-turn", "to-date"):
        mean, variance[credit] = turn_credit_moments(THETA, REF, ENV, SEQ_LEN, credit,
                                                     layout=layout)
        bias[credit] = (mean - g).square().sum().item()
    assert bias["sum"] < UNBIASED and bias["to-go"] < UNBIASED, bias
    assert bias["last-turn"] > 1e-4 and bias["to-date"] > 1e-4, bias
    assert variance["to-go"] < variance["sum"]  # fewer rewards per token: less noise


def test_the_study_reports_each_credit():
    study = turn_reward_study(THETA, REF, ENV, SEQ_LEN)
    assert [r["credit"] for r in study["rows"]] == ["sum", "to-go", "last-turn", "to-date"]
    assert [r["biased"] for r in study["rows"]] == [False, False, True, True]
