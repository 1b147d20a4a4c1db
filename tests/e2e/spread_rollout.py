"""A rollout function given by import path (--rollout-function spread_rollout:by_sum, with this
directory on PYTHONPATH) whose groups have reward spread on known prompts: the engine's
single-turn responses to "Calculate a+b.", rewarded 1, 0, 0, ... when a + b is a multiple of 3
(spread), all 1 when a + b = 1 (mod 3) and all 0 otherwise, so a test knows which prompts
--dynamic-sampling keeps."""
import re

from megatron_rl.rollout.single_turn import single_turn_groups


def spread_of(text: str) -> bool:
    """Whether the group of the prompt `text` gets reward spread."""
    return operands_sum(text) % 3 == 0


def operands_sum(text: str) -> int:
    a, b = re.search(r"Calculate (\d+)\+(\d+)\.", text).groups()
    return int(a) + int(b)


def by_sum(ctx, records):
    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    groups = ctx.engine.generate(prompt_ids, ctx.group_size, ctx.params)
    rewards = []
    for r in records:
        kind = operands_sum(r.text) % 3
        rewards += [float(j == 0) if kind == 0 else float(kind == 1)
                    for j in range(ctx.group_size)]
    return single_turn_groups(prompt_ids, groups, rewards)
