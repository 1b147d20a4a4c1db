"""A rollout function given to the trainer by import path (--rollout-function
two_turn_rollout:two_turns, with this directory on PYTHONPATH): two policy turns with an
environment message between them, in one trajectory, built with the engine the trainer hands
over. Its rewards are fixed (even trajectories of a group 1, odd ones 0 with reward error
"no_answer"), so the run's reward metrics show that its trajectories are what the trainer
trained on."""
import dataclasses

from megatron_rl.batch import Trajectory

ENVIRONMENT = [5, 6, 7]  # the environment's answer between the turns: 3 tokens, never trained on


def two_turns(ctx, records):
    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    first = ctx.engine.generate(prompt_ids, ctx.group_size, ctx.params)
    # the second turn sees the prompt, the policy's first turn and the environment's answer
    contexts = [p + c.token_ids + ENVIRONMENT for p, group in zip(prompt_ids, first)
                for c in group]
    params = dataclasses.replace(ctx.params, seed=(ctx.params.seed or 0) + 1)
    second = [g[0] for g in ctx.engine.generate(contexts, 1, params)]
    groups = []
    for i, (p, group) in enumerate(zip(prompt_ids, first)):
        groups.append([])
        for j, c in enumerate(group):
            d = second[i * ctx.group_size + j]
            groups[-1].append(Trajectory(
                prompt_ids=p, response_ids=c.token_ids + ENVIRONMENT + d.token_ids,
                response_mask=[1] * len(c.token_ids) + [0] * len(ENVIRONMENT)
                + [1] * len(d.token_ids),
                rollout_logprobs=c.rollout_logprobs + [0.0] * len(ENVIRONMENT)
                + d.rollout_logprobs,
                finish_reason=d.finish_reason, reward=float(j % 2 == 0),
                reward_error=None if j % 2 == 0 else "no_answer",
                metadata={"counts": {"two_turn/turns": 2.0, "two_turn/odd": float(j % 2)},
                          "evaluation": ctx.evaluation}))
    return groups
