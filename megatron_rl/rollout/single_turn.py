"""The built-in rollout function "single-turn" (the default --rollout-function): one engine
completion per trajectory, all of it the policy's, scored by its task's verifier.

`single_turn_groups` and `single_turn_trajectory` make trajectories of engine completions for
other code that generates single responses (tools, tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from megatron_rl.batch import Trajectory
from megatron_rl.rollout.needs import declare_needs

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.rollout.base import Completion
    from megatron_rl.rollout.functions import RolloutContext


@declare_needs(single_response=True, token_versions=True)
def single_turn(ctx: RolloutContext, records: Sequence[PromptRecord]) -> list[list[Trajectory]]:
    """One response per trajectory: each prompt encoded, group_size completions of it from the
    engine in one generate call for all prompts, each decoded and scored by its task's
    verifier against the record's answer."""
    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    groups = ctx.engine.generate(prompt_ids, ctx.group_size, ctx.params)
    texts = [ctx.codec.decode(c.token_ids) for group in groups for c in group]
    each = lambda xs: [x for x in xs for _ in range(ctx.group_size)]  # noqa: E731
    scored = ctx.scorer.score(texts, each([r.answer for r in records]),
                              each([r.task for r in records]),
                              each([r.metadata for r in records]))
    return single_turn_groups(prompt_ids, groups, [s.reward for s in scored],
                              [s.reason for s in scored])


def single_turn_trajectory(prompt_ids: list[int], completion: Completion, reward: float,
                           reward_error: str | None = None) -> Trajectory:
    """The trajectory of one engine completion of `prompt_ids`: all of it the policy's."""
    return Trajectory(prompt_ids, completion.token_ids, [1] * len(completion.token_ids),
                      completion.rollout_logprobs, completion.finish_reason, reward, reward_error,
                      completion.routed_experts, token_versions=completion.token_versions)


def single_turn_groups(prompt_ids: Sequence[list[int]], groups: Sequence[Sequence[Completion]],
                       rewards: Sequence[float], reward_errors: Sequence[str | None] | None = None
                       ) -> list[list[Trajectory]]:
    """Each prompt's completions as single-turn trajectories (single_turn_trajectory), with the
    flat rewards (and reward errors) of all completions in order."""
    out, b = [], 0
    for p, group in zip(prompt_ids, groups):
        out.append([])
        for c in group:
            out[-1].append(single_turn_trajectory(p, c, rewards[b],
                                                  reward_errors[b] if reward_errors else None))
            b += 1
    if b != len(rewards):
        raise ValueError(f"{len(rewards)} rewards for {b} completions")
    return out
