"""Verifiable rewards: a registry of reward functions by task name and a batch scorer.

    from megatron_rl.rewards import RewardScorer, get_reward_fn
    get_reward_fn("countdown")("<answer>(1+2)*3</answer>", "9", {"numbers": [1, 2, 3]})  # 1.0
    with RewardScorer(timeout_s=5) as scorer:
        rewards, stats = scorer.score_batch(responses, golds, tasks, metadata)

Tasks: math (last \\boxed{}, math-verify in a sandboxed worker), countdown (own safe parser),
mmlu (final letter), gsm8k and arithmetic (last number).
"""
from megatron_rl.rewards.registry import REWARDS, TaskReward, get_reward_fn, register
from megatron_rl.rewards.scorer import RewardScorer, close_default_scorer, score_batch
from megatron_rl.rewards.types import REASONS, Scored

__all__ = ["REWARDS", "REASONS", "RewardScorer", "Scored", "TaskReward", "close_default_scorer",
           "get_reward_fn", "register", "score_batch"]
