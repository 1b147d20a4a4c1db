"""Dynamic sampling (--dynamic-sampling, DAPO's): a step's batch drawn in rounds until it holds
--num-prompts-per-step groups whose task rewards are not all equal.

The rollout function runs in rounds (`sample_informative`): the groups whose task rewards are
all equal (no `has_spread`) do not count towards the batch, and further prompts, next in data
order, are generated until the target number of groups with spread is in hand (`select_groups`
decides which groups of those drawn make the batch, and how many prompts it consumed;
`refill_size` how many prompts the next round draws). The rule is stated by plain values
(`DynamicSampling`); where the rounds run, and with which seeds, is the caller's
(rollout_queue.py: every rank in step with the in-process engine, else the engine's client
rank). docs/results.md "Dynamic sampling" derives why the batch is that of a sequential draw.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Sequence

from megatron_rl.batch import Trajectory

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptDataset

ROUND_SEED_STRIDE = 104729  # a refill round's sampling seed: the step's + round x this (a prime)
MAX_ROUND_BATCHES = 4       # a refill round draws at most this many batches' prompts


def has_spread(group: Sequence[Trajectory]) -> bool:
    """Whether the task rewards of the group's sampled trajectories are not all equal: the
    groups whose task advantage is not identically 0 under a group baseline (rloo, grpo,
    dr_grpo). A trajectory without a token of the policy's (an agent episode its environment
    broke) is out of the baseline (batch.pack_rollouts' in_baseline) and out of this
    comparison."""
    rewards = [t.reward for t in group if 1 in t.response_mask]
    return len(rewards) > 1 and max(rewards) > min(rewards)


@dataclasses.dataclass
class Selection:
    """The batch chosen from the groups drawn so far, in data order: the first `consumed`
    prompts are used up (the data position advances over them; those drawn after them go back
    to the data), `kept` the indices of the groups that make the batch (ascending), `found` the
    groups with spread among the consumed."""
    consumed: int
    kept: list[int]
    found: int


def select_groups(spread: Sequence[bool], target: int, unit: int = 1,
                  keep_filtered: bool = False, last_round: bool = False) -> Selection | None:
    """The batch from the groups drawn so far, in data order, whose spread flags are `spread`:
    the shortest prefix holding `target` groups with spread, and

    - keep_filtered False (DAPO's filter): its groups with spread, exactly `target`;
    - keep_filtered True: all its groups, the prefix also a multiple of `unit` (groups that
      split over the data-parallel ranks and PPO minibatches): >= `target` with spread.

    The prefix ends where a sequential draw would stop, whatever came after it in the round,
    so the batch is that of drawing prompts one by one until the rule holds (a stopping time:
    docs/results.md "Dynamic sampling"). None when no prefix holds it yet; on the `last_round`
    (--dynamic-sampling-max-rounds spent) the batch is what there is: all groups with spread
    topped up with the first groups without spread to `target` groups (keep_filtered: the
    longest prefix that is a multiple of `unit`, all its groups). `target` is a multiple of
    `unit`, and at least `target` groups were drawn."""
    assert target % unit == 0 and len(spread) >= target, (target, unit, len(spread))
    found = 0
    for m, ok in enumerate(spread):
        found += ok
        if found >= target and (not keep_filtered or (m + 1) % unit == 0):
            kept = (list(range(m + 1)) if keep_filtered
                    else [i for i in range(m + 1) if spread[i]])
            return Selection(m + 1, kept, found)
    if not last_round:
        return None
    if keep_filtered:
        consumed = len(spread) - len(spread) % unit
        return Selection(consumed, list(range(consumed)), sum(spread[:consumed]))
    with_spread = [i for i, ok in enumerate(spread) if ok]
    without = [i for i, ok in enumerate(spread) if not ok][:target - len(with_spread)]
    kept = sorted(with_spread + without)
    return Selection(kept[-1] + 1, kept, len(with_spread))


def refill_size(spread: Sequence[bool], target: int, unit: int = 1,
                keep_filtered: bool = False) -> int:
    """Prompts the next round draws when select_groups found no batch in the groups drawn so
    far: those expected to complete it at the share of groups with spread seen so far in the
    step (the whole `target` when none had spread; at most MAX_ROUND_BATCHES x `target`), or,
    keep_filtered with `target` found, the groups up to the next multiple of `unit`."""
    n, found = len(spread), sum(spread)
    if found >= target:  # keep_filtered: only the prefix's length is not yet a multiple of unit
        return unit - n % unit
    if found == 0:
        return target
    return min(math.ceil((target - found) * n / found), MAX_ROUND_BATCHES * target)


@dataclasses.dataclass
class Sampled:
    """A batch of --dynamic-sampling: its groups in data order, the data position after the
    prompts it consumed, its rollout/* metrics, the warning when the rounds ran out before
    the batch had --num-prompts-per-step groups with spread ("" otherwise), and the prompt
    records of its groups (for --save-rollouts)."""
    groups: list[list[Trajectory]]
    data_state: dict
    stats: dict[str, float]
    shortfall: str = ""
    records: list = dataclasses.field(default_factory=list)  # the groups' prompt records


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """The rule of a step's rounds, from the run's settings (built once).

    target: groups with spread a batch holds (--num-prompts-per-step).
    keep_filtered: the batch keeps the groups without spread among those it consumed
        (AlgorithmConfig.keeps_filtered_groups: --dynamic-sampling-keep-kl).
    unit: with keep_filtered, the number of groups a batch is a multiple of (each
        data-parallel rank and PPO minibatch the same share); 1 otherwise.
    granularity: a round's prompts are a multiple of this (the data-parallel size where each
        replica rolls out its share: the in-process engine; 1 where one rank rolls out all).
    max_rounds: refill rounds after the first (--dynamic-sampling-max-rounds).
    """
    target: int
    keep_filtered: bool
    unit: int
    granularity: int
    max_rounds: int



def sample_informative(rule: DynamicSampling, data: PromptDataset,
                       rollout: Callable[[list, int], list[list[Trajectory]]]) -> Sampled:
    """A step's batch by dynamic sampling under `rule`: rounds of prompts taken from `data` in
    order, each rolled out by `rollout(records, round)` (its groups, in the records' order),
    until select_groups finds the batch or rule.max_rounds refill rounds are spent.
    `data` is left after the prompts the batch consumed: prompts drawn past them (a round's
    surplus) are taken again by the next batch, with its own sampling seed.

    Metrics (the whole batch's, every rank the same): rollout/dynamic_sampling_rounds
    (generation rounds, 1 = no refill), rollout/generated_prompts (all rounds' prompts),
    rollout/consumed_prompts (the data position's advance), rollout/filtered_groups (consumed
    groups without spread), rollout/batch_groups (the groups trained on) and
    rollout/consumed_reward_mean (the task reward over all consumed groups: the policy's
    success rate, which the batch's own reward/mean overstates or understates)."""
    target, keep, unit = rule.target, rule.keep_filtered, rule.unit
    groups: list[list[Trajectory]] = []
    records: list = []
    spread: list[bool] = []
    starts: list[tuple[int, dict]] = []  # each round's first group and data position before it
    size, selection, rounds = target, None, 0
    while selection is None:
        starts.append((len(groups), data.state_dict()))
        drawn = data.next_batch(size)
        new = rollout(drawn, rounds)
        assert len(new) == size, (len(new), size)
        groups += new
        records += drawn
        spread += [has_spread(g) for g in new]
        rounds += 1
        selection = select_groups(spread, target, unit, keep,
                                  last_round=rounds > rule.max_rounds)
        size = -(-refill_size(spread, target, unit, keep) // rule.granularity) * rule.granularity
    if selection.consumed < len(groups):  # the surplus goes back: the position after the batch
        first, state = max((s for s in starts if s[0] <= selection.consumed), key=lambda s: s[0])
        data.load_state_dict(state)
        data.next_batch(selection.consumed - first)
    consumed = groups[:selection.consumed]
    rewards = [t.reward for g in consumed for t in g]
    stats = {"rollout/dynamic_sampling_rounds": float(rounds),
             "rollout/generated_prompts": float(len(groups)),
             "rollout/consumed_prompts": float(selection.consumed),
             "rollout/filtered_groups": float(selection.consumed - selection.found),
             "rollout/batch_groups": float(len(selection.kept)),
             "rollout/consumed_reward_mean": sum(rewards) / len(rewards)}
    shortfall = ""
    if selection.found < target:
        shortfall = (f"dynamic sampling found {selection.found} groups with reward spread of "
                     f"the {target} wanted (--num-prompts-per-step) in {rounds} rounds "
                     f"(--dynamic-sampling-max-rounds {rule.max_rounds}, "
                     f"{len(groups)} prompts generated); training on {len(selection.kept)} "
                     "groups, " + ("all those consumed" if keep else
                                   f"{target - selection.found} of them without spread"))
    return Sampled([groups[i] for i in selection.kept], data.state_dict(), stats, shortfall,
                   [records[i] for i in selection.kept])
