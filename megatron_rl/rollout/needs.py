"""What a rollout function needs of the run, declared by the function as data.

The configuration checks, the engine factory and the data loading ask a rollout function's
`RolloutNeeds` (`rollout_needs(name)`), never its name, as they ask an engine's EngineSpec
(rollout/factory.py ENGINES). A function declares its needs with the `declare_needs` decorator,
which sets the attribute `rollout_needs`; `functools.wraps` copies a function's __dict__, so a
user's function that wraps a built-in with it keeps the built-in's needs::

    @functools.wraps(agent_rollout)
    def my_rollout(ctx, records):
        ...
        return agent_rollout(ctx, records)

A function that declares nothing gets RolloutNeeds() (the defaults below). What the needs make
of the settings (`prompt_tools`, `episode_tokens`, `free_tasks`, `unread_agent_flags`) is here
too, so that the training run and `megatron-rl eval` read them alike.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from megatron_rl.rollout.functions import resolve_rollout_function

if TYPE_CHECKING:
    from megatron_rl.agent.settings import AgentConfig

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RolloutNeeds:
    """What a rollout function needs of the run.

    agent_settings: it reads the agent settings (ctx.agent: the --agent-* flags,
        --tool-call-format); without it those flags set to other than their defaults are
        refused, as nothing would read them.
    episode_context: a trajectory is an episode of several generate calls, up to
        --agent-max-tokens tokens: servers started here take that context, and an
        --agent-max-tokens longer than the model's (or --rollout-max-context-len) is refused.
    tool_schemas: the prompts carry the schemas of --agent-tools in the chat template (with the
        built-in --agent-environment tools, which runs them).
    routing_replay: each trajectory keeps the experts its one generate call routed to
        (Trajectory.routed_experts), so --routing-replay can replay them; False refuses it.
    single_response: each trajectory's response is one generate call's completion, within
        --max-new-tokens, which --overlong-buffer-len's penalty measures it against.
    token_versions: its trajectories carry the weight version of each policy token
        (Trajectory.token_versions, from the engine's Completion.token_versions), so that
        --partial-rollouts may cut its generate calls at a weight update; without it the flag
        is refused (a trajectory without versions counts as sampled wholly by the weights its
        rollout began with).
    variable_groups: a prompt's group may hold more than --group-size trajectories (at least
        --group-size, each group its own size: a tree search, sampling until a success); the
        advantage baseline of each group is over its own members. Without it every group holds
        exactly --group-size. Refused under pipeline parallelism without --sequence-packing
        (all microbatches need one shape there).
    """

    agent_settings: bool = False
    episode_context: bool = False
    tool_schemas: bool = False
    routing_replay: bool = True
    single_response: bool = False
    token_versions: bool = False
    variable_groups: bool = False


def declare_needs(**needs: bool) -> Callable[[F], F]:
    """A decorator setting `fn.rollout_needs = RolloutNeeds(**needs)` on rollout function `fn`."""
    declared = RolloutNeeds(**needs)

    def declare(fn: F) -> F:
        fn.rollout_needs = declared  # type: ignore[attr-defined]
        return fn

    return declare


def needs_of(fn: Callable[..., Any]) -> RolloutNeeds:
    """The RolloutNeeds rollout function `fn` declares (RolloutNeeds() where it declares none)."""
    declared = getattr(fn, "rollout_needs", None)
    if declared is None:
        return RolloutNeeds()
    if not isinstance(declared, RolloutNeeds):
        raise ValueError(f"rollout function {getattr(fn, '__qualname__', fn)!r}: its "
                         f"rollout_needs is a {type(declared).__name__}, not a RolloutNeeds")
    return declared


def rollout_needs(name: str) -> RolloutNeeds:
    """The needs of the rollout function --rollout-function `name` names (imported: a bad name
    raises ValueError naming the flag)."""
    return needs_of(resolve_rollout_function(name))


def prompt_tools(rollout_function: str, agent: AgentConfig) -> list[dict[str, Any]] | None:
    """The tool schemas the prompts carry in the chat template: --agent-tools' where
    --rollout-function declares tool_schemas and --agent-environment is the built-in tools;
    None otherwise (builds the tools: the Python tool checks its sandbox once per process)."""
    if not rollout_needs(rollout_function).tool_schemas or agent.agent_environment != "tools":
        return None
    from megatron_rl.agent.settings import tool_registry

    return tool_registry(agent).schemas()


def episode_tokens(rollout_function: str, agent: AgentConfig) -> int:
    """Tokens a trajectory may reach over its generate calls: --agent-max-tokens where
    --rollout-function declares episode_context, else 0 (one call: prompt + --max-new-tokens)."""
    return agent.agent_max_tokens if rollout_needs(rollout_function).episode_context else 0


def free_tasks(rollout_function: str, agent: AgentConfig) -> bool:
    """Whether a data row's `task` may be one no verifier knows: the rollout function reads
    the agent settings and --agent-environment is an environment of the user's, whose step
    gives the reward (an episode it gives none is scored by the task's verifier, and one
    without a verifier scores 0 with reward error "error")."""
    from megatron_rl.agent.env import BUILT_IN

    return (rollout_needs(rollout_function).agent_settings
            and agent.agent_environment not in BUILT_IN)


def unread_agent_flags(rollout_function: str, agent: AgentConfig) -> list[str]:
    """The agent flags set to other than their defaults that nothing reads: all of them where
    --rollout-function does not declare agent_settings, else those its --agent-environment
    and --agent-tools leave unread (AgentConfig.unread_flags)."""
    if not rollout_needs(rollout_function).agent_settings:
        return agent.changed_flags()
    return agent.unread_flags()


__all__ = ["RolloutNeeds", "declare_needs", "episode_tokens", "free_tasks", "needs_of",
           "prompt_tools", "rollout_needs", "unread_agent_flags"]
