"""A rollout function given to the trainer by import path (--rollout-function
more_samples_rollout:more_samples, with this directory on PYTHONPATH) that returns more than
--group-size trajectories per prompt, each group its own size, as a tree search or a function
that samples until a success would: prompt i of a call gets group_size + (i % 3) single-turn
samples. It declares RolloutNeeds(variable_groups=True), without which the trainer refuses
such groups. Its rewards are fixed (trajectory j of a group: 1 when j is even, else 0), so the
run's reward metrics show that all of its trajectories are what the trainer trained on."""
from megatron_rl.rollout.needs import declare_needs
from megatron_rl.rollout.single_turn import single_turn_trajectory


def sizes(group_size, num_prompts):
    """The group size of each prompt of a call."""
    return [group_size + i % 3 for i in range(num_prompts)]


@declare_needs(single_response=True, variable_groups=True)
def more_samples(ctx, records):
    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    wanted = sizes(ctx.group_size, len(records))
    completions = ctx.engine.generate(prompt_ids, max(wanted), ctx.params)
    return [[single_turn_trajectory(p, c, float(j % 2 == 0), None if j % 2 == 0 else "no_answer")
             for j, c in enumerate(group[:n])]
            for p, group, n in zip(prompt_ids, completions, wanted)]


@declare_needs(single_response=True, variable_groups=True)
def by_answer(ctx, records):
    """As more_samples, with group_size + (answer % 3) samples for a record whose answer is a
    number: the sizes follow the data, not a prompt's place in the call, so data-parallel ranks
    roll out groups of different sizes and different numbers of rows."""
    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    wanted = [ctx.group_size + int(r.answer) % 3 for r in records]
    completions = ctx.engine.generate(prompt_ids, max(wanted), ctx.params)
    return [[single_turn_trajectory(p, c, float(j % 2 == 0), None if j % 2 == 0 else "no_answer")
             for j, c in enumerate(group[:n])]
            for p, group, n in zip(prompt_ids, completions, wanted)]
