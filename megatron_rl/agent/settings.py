"""The agent rollout function's settings (--rollout-function agent): the tools, the limits of an
episode, the environment and how its failures are handled. A TrainConfig group (`cfg.agent`);
its flags are `--agent-*` and `--tool-call-format`.

Kept apart from the loop (agent/loop.py) so that reading the configuration imports no rollout
machinery: the environment and tools named here are only checked to import."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megatron_rl.agent.env import BUILT_IN, resolve_environment
from megatron_rl.agent.parsing import TOOL_CALL_FORMATS
from megatron_rl.agent.tools import ToolRegistry

TOOLS = ("calculator", "python")


@dataclass
class AgentConfig:
    """The agent rollout function's settings (--rollout-function agent)."""

    agent_tools: list[str] = field(default_factory=lambda: ["calculator"], metadata={
        "help": "tools the policy may call in --rollout-function agent: calculator (exact "
                "arithmetic on integers and decimals), python (code run in a bubblewrap sandbox: "
                "no network, read-only file system, limits on time, memory and processes)"})
    tool_call_format: str = field(default="qwen", metadata={
        "help": "how the policy writes a tool call: qwen (Qwen2.5/Qwen3, Hermes: "
                "<tool_call>{json}</tool_call>) or llama3 (Llama 3.1 JSON: the turn is the call)",
        "choices": TOOL_CALL_FORMATS})
    agent_max_turns: int = field(default=4, metadata={
        "help": "policy turns per episode at most (--rollout-function agent)", "min": 1})
    agent_max_tool_calls: int = field(default=8, metadata={
        "help": "tool calls per episode at most; a turn whose calls would pass it ends the "
                "episode without running them", "min": 0})
    agent_max_tokens: int = field(default=4096, metadata={
        "help": "tokens of a trajectory at most (prompt, the policy's turns and the tool "
                "responses); the turn that reaches it is cut to fit and ends the episode",
        "min": 2})
    agent_max_tool_output_chars: int = field(default=2000, metadata={
        "help": "characters of one tool response, and of one message of an "
                "--agent-environment's observation, at most; a longer one keeps its head and "
                "tail around a note of how much was cut", "min": 64})
    agent_environment: str = field(default="tools", metadata={
        "help": "what answers the policy's turns in --rollout-function agent: tools (the "
                "built-in: runs the turn's --agent-tools calls) or the import path module:Class "
                "of an environment (agent/env.py: reset on a record, step on each policy turn "
                "to an observation, an optional reward and done), one made per episode"})
    agent_env_timeout: float = field(default=60.0, metadata={
        "help": "seconds an --agent-environment's reset or step may take; a call that raises "
                "or takes longer ends its episode (reward 0, end env_error or env_timeout), "
                "not the run (the built-in tools environment bounds its own time)"})
    agent_env_max_abandoned: int = field(default=32, metadata={
        "help": "environment calls past --agent-env-timeout whose threads (which cannot be "
                "stopped) may still run at once; one more stops the run", "min": 0})
    agent_max_env_failures: float = field(default=0.5, metadata={
        "help": "share of a step's (or an evaluation's) episodes that may end in env_error or "
                "env_timeout; more stops the run, naming the environment, its first error and "
                "the record (1: never stop; failed episodes still train on nothing)",
        "min": 0.0, "max": 1.0})
    agent_concurrency: int = field(default=64, metadata={
        "help": "episodes advancing at once, each generating or waiting for its environment, "
                "with an engine that takes concurrent generate calls (vllm, sglang, a server "
                "pool; the in-process and process engines take each turn of all episodes in one "
                "call); 1: one request or environment step at a time", "min": 1})
    agent_tool_workers: int = field(default=0, metadata={
        "help": "tool calls running at once in --rollout-function agent (threads; each Python "
                "call is a sandbox process); 0: the CPU count, between 2 and 8", "min": 0})

    def validate(self) -> None:
        for name in self.agent_tools:
            if name not in TOOLS:
                raise ValueError(f"--agent-tools {name!r}: not a tool ({', '.join(TOOLS)})")
        if not self.agent_env_timeout > 0:
            raise ValueError(f"--agent-env-timeout {self.agent_env_timeout}: must be > 0")
        if self.agent_environment not in BUILT_IN:
            resolve_environment(self.agent_environment)  # a bad path fails at configuration


def tool_registry(config: AgentConfig) -> ToolRegistry:
    """The registry of `config.agent_tools`, built once per tool set in a process (the Python
    tool starts a sandbox to check it when it is built; the registry is read-only after)."""
    return _registry(tuple(config.agent_tools))


@functools.lru_cache(maxsize=None)
def _registry(names: tuple[str, ...]) -> ToolRegistry:
    from megatron_rl.agent.calculator import calculator_tool
    from megatron_rl.agent.sandbox import python_tool

    makers = {"calculator": calculator_tool, "python": python_tool}
    return ToolRegistry([makers[name]() for name in names])


__all__ = ["TOOLS", "AgentConfig", "tool_registry"]
