"""The agent rollout function's settings (--rollout-function agent, or a rollout function that
declares agent_settings: rollout/needs.py): the tools, the limits of an episode, the environment
and how its failures are handled, the Python sandbox's limits, and the settings passed to an
environment and to tools of the user's. A TrainConfig group (`cfg.agent`); its flags are
`--agent-*` and `--tool-call-format`.

Each field's metadata "reads" says which environment reads it: "tools" (the built-in
--agent-environment tools), "environment" (an environment of the user's, by import path),
"python" (the tools environment with the python tool among --agent-tools); no "reads": every
environment. A flag set to other than its default that its environment does not read is
refused (`AgentConfig.unread_flags`), as nothing would read it.

Kept apart from the loop (agent/loop.py) so that reading the configuration imports no rollout
machinery: the environment and tools named here are only imported and checked, not made."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.agent.env import BUILT_IN, resolve_environment
from megatron_rl.agent.parsing import TOOL_CALL_FORMATS
from megatron_rl.agent.sandbox import SandboxLimits
from megatron_rl.agent.tools import Tool, ToolRegistry
from megatron_rl.flags import flag_name
from megatron_rl.imports import check_arguments, import_object

TOOLS = ("calculator", "python")

# The sandbox's limits as flags: {AgentConfig field: SandboxLimits field}. Each flag takes its
# default, help and bound from the limit's declaration in agent/sandbox.py.
SANDBOX_FLAGS = {
    "agent_sandbox_time": "wall_time_s",
    "agent_sandbox_cpu_time": "cpu_time_s",
    "agent_sandbox_memory_mb": "memory_mb",
    "agent_sandbox_processes": "max_processes",
    "agent_sandbox_scratch_mb": "scratch_mb",
    "agent_sandbox_output_bytes": "max_output_bytes",
    "agent_sandbox_open_files": "max_open_files",
}
_LIMITS = {f.name: f for f in dataclasses.fields(SandboxLimits)}


def _limit(name: str) -> Any:
    """The AgentConfig field of the sandbox limit `name` (a SandboxLimits field)."""
    f = _LIMITS[name]
    return field(default=f.default, metadata={
        **f.metadata, "help": "python tool: " + f.metadata["help"], "reads": "python"})


@dataclass
class AgentConfig:
    """The agent rollout function's settings (--rollout-function agent)."""

    agent_tools: list[str] = field(default_factory=lambda: ["calculator"], metadata={
        "help": "tools the policy may call in --rollout-function agent: calculator (exact "
                "arithmetic on integers and decimals), python (code run in a bubblewrap sandbox: "
                "no network, read-only file system, limits on time, memory and processes: "
                "--agent-sandbox-*), or the import path module:attr of a Tool (agent/tools.py) "
                "or of a function returning one, called with its --agent-tool-args",
        "reads": "tools"})
    agent_tool_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "settings of the tools of --agent-tools given by import path to a function: a "
                "JSON object {tool as --agent-tools names it: {parameter: value}}, passed to "
                "that function as keyword arguments (YAML: a mapping)", "reads": "tools"})
    tool_call_format: str = field(default="qwen", metadata={
        "help": "how the policy writes a tool call: qwen (Qwen2.5/Qwen3, Hermes: "
                "<tool_call>{json}</tool_call>) or llama3 (Llama 3.1 JSON: the turn is the call)",
        "choices": TOOL_CALL_FORMATS, "reads": "tools"})
    agent_max_turns: int = field(default=4, metadata={
        "help": "policy turns per episode at most (--rollout-function agent)", "min": 1})
    agent_max_tool_calls: int = field(default=8, metadata={
        "help": "tool calls per episode at most; a turn whose calls would pass it ends the "
                "episode without running them", "min": 0, "reads": "tools"})
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
                "to an observation, an optional reward and done), one made per episode with "
                "--agent-env-args"})
    agent_env_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "settings of the --agent-environment of the user's: a JSON object passed to its "
                "class or function as keyword arguments when each episode's environment is made "
                "(YAML: a mapping); checked against its signature at configuration",
        "reads": "environment"})
    agent_env_timeout: float = field(default=60.0, metadata={
        "help": "seconds an --agent-environment's reset or step may take; a call that raises "
                "or takes longer ends its episode (reward 0, end env_error or env_timeout), "
                "not the run (the built-in tools environment bounds its own time)",
        "reads": "environment"})
    agent_env_max_abandoned: int = field(default=32, metadata={
        "help": "environment calls past --agent-env-timeout whose threads (which cannot be "
                "stopped) may still run at once; one more stops the run", "min": 0,
        "reads": "environment"})
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
                "call is a sandbox process); 0: the CPU count, between 2 and 8", "min": 0,
        "reads": "tools"})
    agent_sandbox_time: float = _limit("wall_time_s")
    agent_sandbox_cpu_time: int | None = _limit("cpu_time_s")
    agent_sandbox_memory_mb: int = _limit("memory_mb")
    agent_sandbox_processes: int = _limit("max_processes")
    agent_sandbox_scratch_mb: int = _limit("scratch_mb")
    agent_sandbox_output_bytes: int = _limit("max_output_bytes")
    agent_sandbox_open_files: int = _limit("max_open_files")

    def sandbox_limits(self) -> SandboxLimits:
        """The Python tool's sandbox limits (--agent-sandbox-*)."""
        return SandboxLimits(**{limit: getattr(self, name) for name, limit in SANDBOX_FLAGS.items()})

    def changed_flags(self) -> list[str]:
        """The flags of the fields set to other than their defaults, in declaration order."""
        default = AgentConfig()
        return [flag_name(f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)]

    def unread_fields(self) -> list[str]:
        """The fields the agent loop does not read with this --agent-environment and
        --agent-tools, whatever their values (see the module docstring)."""
        tools_env = self.agent_environment in BUILT_IN
        reads = {"tools": tools_env, "environment": not tools_env,
                 "python": tools_env and "python" in self.agent_tools}
        return [f.name for f in dataclasses.fields(self)
                if not reads.get(f.metadata.get("reads", ""), True)]

    def unread_flags(self) -> list[str]:
        """The flags set to other than their defaults that the agent loop does not read with
        this --agent-environment and --agent-tools."""
        unread = {flag_name(name) for name in self.unread_fields()}
        return [flag for flag in self.changed_flags() if flag in unread]

    def validate(self) -> None:
        """Raise ValueError naming the flag: a tool that is neither built-in nor imports, tool
        settings that its function cannot take, an environment that does not import or cannot
        take --agent-env-args, a flag set that this environment does not read."""
        if not self.agent_env_timeout > 0:
            raise ValueError(f"--agent-env-timeout {self.agent_env_timeout}: must be > 0")
        for flag, value in (("--agent-env-args", self.agent_env_args),
                            ("--agent-tool-args", self.agent_tool_args)):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{flag}: a mapping of setting names to values, got {value!r}")
        unread = self.unread_flags()
        if unread:
            tools_env = self.agent_environment in BUILT_IN
            raise ValueError(
                f"{', '.join(unread)} set, but nothing reads them with --agent-environment "
                f"{self.agent_environment}" + (" and --agent-tools " + " ".join(self.agent_tools)
                                               if tools_env else "")
                + ": the --agent-sandbox-* limits are the python tool's, --agent-env-args and "
                "--agent-env-timeout an environment's of your own, the other tool flags the "
                "built-in tools environment's; remove them")
        if len(set(self.agent_tools)) != len(self.agent_tools):
            raise ValueError(f"--agent-tools {' '.join(self.agent_tools)}: a tool named twice")
        for name in self.agent_tools:
            resolve_tool(name, self.agent_tool_args.get(name, {}))
        for name in self.agent_tool_args:
            if name not in self.agent_tools:
                raise ValueError(f"--agent-tool-args {name!r}: not a tool of --agent-tools "
                                 f"({' '.join(self.agent_tools)})")
        self.sandbox_limits()  # the limits' own checks (their bounds: TrainConfig.validate)
        if self.agent_environment not in BUILT_IN:  # a bad path or setting fails here
            check_arguments(resolve_environment(self.agent_environment), self.agent_env_args,
                            "--agent-env-args", f"--agent-environment {self.agent_environment}")


def resolve_tool(name: str, args: dict[str, Any] | None = None) -> Any:
    """What the --agent-tools entry `name` names: a built-in's name back, or the Tool or the
    function making one that its import path `module:attr` names, imported (not called).
    `args`: its --agent-tool-args, checked against the function's signature. Raises
    ValueError naming the flag."""
    flag = f"--agent-tools {name!r}"
    if name in TOOLS:
        if args:
            raise ValueError(f"--agent-tool-args {name!r}: a built-in tool takes no settings "
                             "(the python tool's limits are the --agent-sandbox-* flags)")
        return name
    obj = import_object(name, flag, "tool", TOOLS, form="Tool or function")
    if isinstance(obj, Tool):
        if args:
            raise ValueError(f"--agent-tool-args {name!r}: it names a Tool, which takes no "
                             "settings; name a function that makes it to pass some")
        return obj
    if not callable(obj):
        raise ValueError(f"{flag}: a {type(obj).__name__}, neither a Tool (agent/tools.py) nor "
                         "a function returning one")
    check_arguments(obj, args or {}, f"--agent-tool-args {name!r}", f"the tool function {name}")
    return obj


def tool_registry(config: AgentConfig) -> ToolRegistry:
    """The registry of `config.agent_tools` (with their --agent-tool-args and the sandbox's
    limits), built once per such set in a process (the Python tool starts a sandbox to check
    it when it is built; the registry is read-only after)."""
    return _registry(tuple(config.agent_tools), json.dumps(config.agent_tool_args,
                                                           sort_keys=True),
                     config.sandbox_limits())


@functools.lru_cache(maxsize=None)
def _registry(names: tuple[str, ...], tool_args: str, limits: SandboxLimits) -> ToolRegistry:
    from megatron_rl.agent.calculator import calculator_tool
    from megatron_rl.agent.sandbox import PythonSandbox, python_tool

    args = json.loads(tool_args)
    tools = []
    for name in names:
        made = resolve_tool(name, args.get(name))
        if made == "calculator":
            tool = calculator_tool()
        elif made == "python":
            tool = python_tool(PythonSandbox(limits))
        elif isinstance(made, Tool):
            tool = made
        else:
            tool = made(**args.get(name, {}))
            if not isinstance(tool, Tool):
                raise ValueError(f"--agent-tools {name!r}: the function returned a "
                                 f"{type(tool).__name__}, not a Tool (agent/tools.py)")
        tools.append(tool)
    return ToolRegistry(tools)


__all__ = ["SANDBOX_FLAGS", "TOOLS", "AgentConfig", "resolve_tool", "tool_registry"]
