"""Rollout functions: what turns prompts into scored trajectories (batch.Trajectory).

The signature every rollout function has:

    def rollout(ctx: RolloutContext, records: Sequence[PromptRecord]) -> list[list[Trajectory]]

    records  the prompts to roll out (data.prompts.PromptRecord: the rendered prompt `text`, its
             `task`, the gold `answer`, the row's `metadata`)
    ctx      what a rollout works with (RolloutContext): the engine (RolloutEngine.generate:
             token ids in, Completions out), this call's sampling params (its seed included),
             the group size, the tokenizer's codec (encode, decode; codec.tokenizer for a chat
             template), the reward scorer, the step, whether it is an evaluation, the agent
             settings and the function's own settings (--rollout-function-args)
    returns  for each record, in order, ctx.group_size Trajectory: the group its advantage
             baseline is taken from, each scored (`reward` set); a function that declares
             RolloutNeeds(variable_groups=True) (rollout/needs.py) may return more, at least
             ctx.group_size, each group its own size

A Trajectory (batch.py) is the token sequence the trainer trains on: `prompt_ids`, then `response_ids`,
in which `response_mask` marks the tokens the policy sampled (1: trained on, with the engine's
log-prob in `rollout_logprobs`) and the tokens that came from elsewhere (0: a tool's output, an
environment's message, a user turn; context only, never trained on). The built-in
"single-turn" (rollout/single_turn.py) makes one from each engine completion, mask 1 over all
of it. A multi-turn agent loop appends turns to one trajectory: the policy's completion (mask 1, its
log-probs), the environment's answer (mask 0, log-prob 0), and so on, and scores the whole.

Chosen by --rollout-function: a name of ROLLOUT_FUNCTIONS, or the `module:function` import path
of a function with this signature (`resolve_rollout_function`). Where it runs
(rollout_queue.py): with the in-process engine on every rank, each data-parallel replica
its share of the prompts -- generate is collective over the replica's model-parallel group, so
every rank of a group makes the same generate calls with the same prompts; with an engine that
has a client rank (the process engine, servers) on that rank alone, for the whole batch, and
under --async-level in a background thread, one per batch in flight (the scorer takes calls
from several threads). The trainer's periodic evaluation calls the same function
(ctx.evaluation True; mean@k and pass@k count a reward >= 1 as correct).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from megatron_rl.batch import Trajectory
from megatron_rl.imports import import_callable
from megatron_rl.rollout.base import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from megatron_rl.agent.settings import AgentConfig
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.rewards import RewardScorer
    from megatron_rl.data.prompts import Codec


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """What a rollout function works with (see the module docstring).

    engine: generates (RolloutEngine.generate(prompt ids, n, params) -> Completions).
    params: this call's sampling settings (--temperature, --top-p, --max-new-tokens, the stop
        ids, the seed of this step and rank; routed experts asked for under --routing-replay).
    group_size: trajectories per prompt (--group-size; --eval-samples in evaluation).
    codec: text <-> token ids with the run's tokenizer (data.prompts.Codec).
    scorer: the rewards (rewards.RewardScorer.score: a Scored per response).
    step: the RL step the rollout belongs to, from 0: step s's training batch and the
        evaluation after step s's update both have s (metrics.jsonl and the checkpoints number
        that step s + 1); `megatron-rl eval` has its weights' periodic evaluation's (a --load
        checkpoint of step N: N - 1; 0 for weights no RL step made).
    evaluation: True when the rollout is for an evaluation (periodic or `megatron-rl eval`),
        not for training.
    agent: the agent settings (the --agent-* flags, agent.settings.AgentConfig), for a
        function that reads them (RolloutNeeds.agent_settings); None: their defaults.
    args: the rollout function's own settings, --rollout-function-args ({} when not given);
        the context holds its own copy.
    """

    engine: RolloutEngine
    params: SamplingParams
    group_size: int
    codec: Codec
    scorer: RewardScorer
    step: int = 0
    evaluation: bool = False
    agent: AgentConfig | None = None
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "args", dict(self.args))  # the run's settings stay as given


RolloutFunction = Callable[[RolloutContext, Sequence["PromptRecord"]], list[list[Trajectory]]]


ROLLOUT_FUNCTIONS = {"single-turn": "megatron_rl.rollout.single_turn:single_turn",
                     "agent": "megatron_rl.agent.loop:agent_rollout"}
"""The built-in rollout functions' import paths by --rollout-function name, imported when
chosen: "single-turn" (rollout/single_turn.py), "agent", the multi-turn tool-calling loop
(agent/loop.py)."""


def resolve_rollout_function(name: str) -> RolloutFunction:
    """The rollout function --rollout-function `name` names: a ROLLOUT_FUNCTIONS key, or
    `module:function` (the function may be an attribute path: `module:Class.method`). Raises
    ValueError naming the flag when it is neither, or does not import."""
    flag = f"--rollout-function {name!r}"
    return cast(RolloutFunction, import_callable(ROLLOUT_FUNCTIONS.get(name, name), flag,
                                                 "rollout function", ROLLOUT_FUNCTIONS))


def trajectory_counts(groups: Sequence[Sequence[Trajectory]]) -> collections.Counter:
    """The sum over the trajectories of `groups` of their metadata["counts"]."""
    total: collections.Counter = collections.Counter()
    for g in groups:
        for t in g:
            total.update(t.metadata.get("counts", {}))
    return total


def check_groups(groups: Any, num_prompts: int, group_size: int, name: str,
                 variable_groups: bool = False) -> None:
    """Raise ValueError, naming --rollout-function `name` and the first problem, unless
    `groups` is what a rollout function must return for `num_prompts` prompts: group_size
    Trajectory per prompt (at least group_size with `variable_groups`, the function's
    RolloutNeeds.variable_groups), each with a prompt, one mask value (0 or 1) and one log-prob per
    response token, and turn rewards (where given) that sum to its reward."""
    flag = f"--rollout-function {name}"
    if not isinstance(groups, list) or len(groups) != num_prompts:
        got = f"{len(groups)} groups" if isinstance(groups, list) else type(groups).__name__
        raise ValueError(f"{flag} returned {got} for {num_prompts} prompts (a list of groups, "
                         "one per prompt, in order)")
    for i, group in enumerate(groups):
        if not isinstance(group, list) or len(group) != group_size:
            got = len(group) if isinstance(group, list) else type(group).__name__
            if not (variable_groups and isinstance(group, list) and len(group) > group_size):
                least = "at least " if variable_groups else ""
                raise ValueError(f"{flag}: prompt {i}: {got} trajectories, --group-size is "
                                 f"{least}{group_size}")
        for j, t in enumerate(group):
            where = f"{flag}: prompt {i} trajectory {j}"
            if not isinstance(t, Trajectory):
                raise ValueError(f"{where}: a {type(t).__name__}, not a Trajectory")
            if not t.prompt_ids:
                raise ValueError(f"{where}: no prompt tokens")
            n = len(t.response_ids)
            if len(t.response_mask) != n or len(t.rollout_logprobs) != n:
                raise ValueError(f"{where}: {n} response tokens, {len(t.response_mask)} mask "
                                 f"values, {len(t.rollout_logprobs)} log-probs (one each)")
            if any(m not in (0, 1) for m in t.response_mask):
                raise ValueError(f"{where}: response_mask holds values other than 0 and 1")
            if t.turn_rewards is not None:
                if not all(math.isfinite(r) for r in t.turn_rewards):
                    raise ValueError(f"{where}: turn_rewards {t.turn_rewards} are not all "
                                     "finite numbers")
                if not math.isclose(sum(t.turn_rewards), t.reward, rel_tol=1e-9, abs_tol=1e-9):
                    raise ValueError(f"{where}: reward {t.reward} is not the sum of its "
                                     f"turn_rewards {t.turn_rewards}")
            if t.turn_ends is not None:
                ends = t.turn_ends
                if t.turn_rewards is None or len(ends) != len(t.turn_rewards):
                    raise ValueError(f"{where}: turn_ends {ends} without one turn reward each")
                if any(not 0 <= a <= b <= n for a, b in zip([0, *ends], ends)):
                    raise ValueError(f"{where}: turn_ends {ends} are not ascending positions in "
                                     f"its {n} response tokens")


def run_rollout(name: str, ctx: RolloutContext,
                records: Sequence[PromptRecord]) -> list[list[Trajectory]]:
    """The groups of trajectories rollout function `name` (a --rollout-function value) returns
    for `records`, checked (check_groups)."""
    from megatron_rl.rollout.needs import needs_of

    fn = resolve_rollout_function(name)
    groups = fn(ctx, records)
    check_groups(groups, len(records), ctx.group_size, name, needs_of(fn).variable_groups)
    return groups
