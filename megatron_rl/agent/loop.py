"""The multi-turn agent loop: the built-in rollout function "agent" (--rollout-function agent).

An episode is one trajectory: the prompt, then turns of the policy and of its tools until the
policy answers without calling a tool or a limit ends it. Token in, token out:

    prompt_ids | policy turn 1 (mask 1) | tool response 1 (mask 0) | policy turn 2 (mask 1) | ...

- The policy's tokens are exactly the ids the engine sampled, with its log-probs. They are never
  decoded and encoded again: the text of a turn is decoded only to find its tool calls.
- The environment's tokens are the text the chat format puts between the policy's turns (the
  end of the policy's turn where it did not end it itself, the tool responses, the header of the
  next assistant turn), encoded once, without special tokens added, and appended. They have mask
  0 and log-prob 0: the loss, the advantages, every KL estimator and placement, the importance
  weights and the metrics use the policy's tokens only (batch.pack_rollouts makes the mask the
  row's loss mask). docs/results.md derives why charging the environment's tokens, or counting
  them in importance weights, biases the gradient of the trajectory-level KL.
- A turn stops at the end of a tool call: where the format's end marker ("</tool_call>" for
  qwen) is one token of the tokenizer it is a stop token of the generate call (every engine
  stops there); where it is not, the turn is cut after the first marker once generated (the
  tokens after it are dropped: the trajectory keeps a prefix of what was sampled, as a stop
  string does). A turn also ends at the tokenizer's end-of-sequence ids and at
  --max-new-tokens.

How episodes are scheduled (agent/schedule.py) follows the engine. With the in-process and
process engines they advance together, one turn at a time: one generate call per turn for all
episodes still running (the first for all prompts with n = group size, so that an engine shares
each prompt's prefill), then every tool call of that turn at once on ToolExecutor's threads
(--agent-tool-workers; one sandbox process each for the Python tool), so a slow tool holds the
others until the slowest call of the turn returns. With an engine whose generate may be called
from several threads at once (RolloutEngine.concurrent_generate: vLLM, SGLang, a server pool)
each episode advances on its own on up to --agent-concurrency threads, so that one episode's
tool wait never holds another's generation. With the in-process engine the loop runs on every
rank of a model-parallel group; the tools run on the group's first rank and the others take
its answers (parallel.model_parallel_source), so that the group's generate calls stay identical.

Limits (AgentConfig), each ending an episode with its reason, counted as
rollout/agent/end_<reason>:
    answer          the policy's turn made no tool call (the normal end)
    length          the policy's turn ran out of --max-new-tokens without a call
    max_turns       --agent-max-turns policy turns taken
    max_tool_calls  the turn's calls would pass --agent-max-tool-calls (not executed)
    max_tokens      the trajectory reached --agent-max-tokens (the turn is cut to fit; a tool
                    response that does not fit is left out)

Reward: the task's verifier on the text of the policy's last turn, against the record's answer
(tool responses are not the policy's answer).

Per-trajectory counts in Trajectory.metadata["counts"] (agent/turns, agent/tool_calls,
agent/tool_seconds, agent/tool_<outcome> for agent.tools.OUTCOMES, agent/end_<reason>) are
averaged over the batch's trajectories and logged as rollout/agent/<name>.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from megatron_rl.agent import schedule
from megatron_rl.agent.parsing import TOOL_CALL_FORMATS, parse_tool_calls
from megatron_rl.agent.tools import OUTCOMES, ToolExecutor, ToolRegistry, ToolResult
from megatron_rl.parallel import model_parallel_source
from megatron_rl.rollout.functions import Trajectory

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.rollout.base import Completion, SamplingParams
    from megatron_rl.rollout.functions import RolloutContext

END_REASONS = ("answer", "length", "max_turns", "max_tool_calls", "max_tokens")
TOOLS = ("calculator", "python")
_END_MARKERS = {"qwen": "</tool_call>", "llama3": None}  # llama3: the call is the whole turn


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
        "help": "characters of one tool response at most; a longer one keeps its head and tail "
                "around a note of how much was cut", "min": 64})
    agent_concurrency: int = field(default=64, metadata={
        "help": "episodes advancing at once, each generating or waiting for its tools, with an "
                "engine that takes concurrent generate calls (vllm, sglang, a server pool; "
                "the in-process and process engines take each turn of all episodes in one "
                "call); 1: one request or tool wait at a time", "min": 1})
    agent_tool_workers: int = field(default=0, metadata={
        "help": "tool calls running at once in --rollout-function agent (threads; each Python "
                "call is a sandbox process); 0: the CPU count, between 2 and 8", "min": 0})

    def validate(self) -> None:
        for name in self.agent_tools:
            if name not in TOOLS:
                raise ValueError(f"--agent-tools {name!r}: not a tool ({', '.join(TOOLS)})")


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


# -- the text between the policy's turns ------------------------------------------------------

_ASSISTANT = "assistant-turn-text"  # stand-ins: only the template's text around them is used
_BASE = [{"role": "user", "content": "user-turn-text"}, {"role": "assistant", "content": _ASSISTANT}]


class ChatFormat:
    """The environment's text after a policy turn that called tools: `after_turn(results,
    turn_ids)`. With a chat template (tokenizer.chat_template) it is what the template renders
    for the tool messages and the next assistant header, preceded by the end of the assistant
    turn unless the policy's last token already ended it; without one, each response in
    <tool_response> tags on lines of its own."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.templated = getattr(tokenizer, "chat_template", None) is not None
        self._close = self._tool_header = ""
        if self.templated:
            rendered = self._render(_BASE, False)
            if _ASSISTANT not in rendered:
                raise ValueError("the chat template does not render an assistant message's text")
            self._close = rendered[rendered.rindex(_ASSISTANT) + len(_ASSISTANT):]  # <|im_end|>\n
            self._base = rendered

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def after_turn(self, results: Sequence[str], last_token_text: str) -> str:
        """The text appended after a policy turn whose last token reads `last_token_text`
        (special tokens kept), holding the tool `results` in order."""
        if not self.templated:
            return "".join(f"\n<tool_response>\n{r}\n</tool_response>\n" for r in results)
        tools = [{"role": "tool", "content": r} for r in results]
        full = self._render(_BASE + tools, True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders the conversation before the tool "
                             "messages differently once they follow: the environment's text "
                             "between turns cannot be taken from it")
        close = self._close
        if last_token_text and close.startswith(last_token_text):
            close = close[len(last_token_text):]  # the policy ended its turn itself
        return close + full[len(self._base):]


def _marker_stop_id(tokenizer: Any, marker: str | None) -> int | None:
    """The token id of `marker` where the tokenizer has it as one token, else None."""
    if marker is None:
        return None
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _cut_after(ids: list[int], decode, marker: str) -> int:
    """The length of the shortest prefix of `ids` whose text holds `marker` (len(ids) where
    none does): the prefix property makes this a binary search."""
    if marker not in decode(ids):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


# -- episodes ---------------------------------------------------------------------------------

@dataclass
class _Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    end: str | None = None
    counts: dict[str, float] = field(default_factory=dict)

    def count(self, name: str, by: float = 1.0) -> None:
        key = f"agent/{name}"
        self.counts[key] = self.counts.get(key, 0.0) + by

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.response_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def agent_rollout(ctx: RolloutContext, records: Sequence[PromptRecord],
                  registry: ToolRegistry | None = None) -> list[list[Trajectory]]:
    """The rollout function "agent": ctx.group_size episodes per record (see the module
    docstring), each a scored Trajectory. `registry`: the tools (default: --agent-tools')."""
    config = getattr(ctx.config, "agent", None) or AgentConfig()
    tokenizer = ctx.codec.tokenizer
    fmt = ChatFormat(tokenizer)
    marker = _END_MARKERS[config.tool_call_format]
    marker_id = _marker_stop_id(tokenizer, marker)
    params = ctx.params
    if marker_id is not None:
        params = dataclasses.replace(params, stop_token_ids=tuple(
            sorted({*params.stop_token_ids, marker_id})))
    registry = registry if registry is not None else tool_registry(config)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    prompt_ids = [ctx.codec.encode(r.text) for r in records]
    episodes = [_Episode(list(p)) for p in prompt_ids for _ in range(ctx.group_size)]
    with ToolExecutor(registry, config.agent_tool_workers or None,
                      max_output_chars=config.agent_max_tool_output_chars) as tools:
        turns = _Turns(ctx.engine, config, tools, fmt, marker, decode, ctx.codec.tokenizer)
        if turns.concurrent:
            schedule.concurrent(turns, episodes, prompt_ids, ctx.group_size, params,
                                config.agent_max_turns, config.agent_concurrency)
        else:
            schedule.turn_synchronous(turns, episodes, prompt_ids, ctx.group_size, params,
                                      config.agent_max_turns)
        for e in episodes:
            if e.end is None:  # still calling tools after its last allowed turn
                e.end = "max_turns"
    texts = [ctx.codec.decode(e.last_turn) for e in episodes]
    each = lambda xs: [x for x in xs for _ in range(ctx.group_size)]  # noqa: E731
    scored = ctx.scorer.score(texts, each([r.answer for r in records]),
                              each([r.task for r in records]), each([r.metadata for r in records]))
    groups: list[list[Trajectory]] = []
    for i, (e, s) in enumerate(zip(episodes, scored)):
        if i % ctx.group_size == 0:
            groups.append([])
        e.count(f"end_{e.end}")
        groups[-1].append(Trajectory(e.prompt_ids, e.response_ids, e.mask, e.logprobs,
                                     e.finish_reason, s.reward, s.reason,
                                     metadata={"counts": e.counts, "end": e.end}))
    return groups


class _Turns:
    """This rollout's turns as agent/schedule.py drives them (schedule.EpisodeTurns)."""

    def __init__(self, engine, config: AgentConfig, tools: ToolExecutor, fmt: ChatFormat,
                 marker: str | None, decode, tokenizer):
        self.engine, self.config, self.tools, self.fmt = engine, config, tools, fmt
        self.marker, self.decode, self.tokenizer = marker, decode, tokenizer
        # one client drives the engine and takes calls from several threads at once: episodes
        # advance on their own (every rank of an in-process engine's group takes each turn)
        self.concurrent = (getattr(engine, "concurrent_generate", False)
                           and engine.client_rank is not None)

    def generate(self, contexts: list[list[int]], n: int, params: SamplingParams
                 ) -> list[Completion]:
        return _generate(self.engine, contexts, n, params, self.config.agent_max_tokens)

    def context(self, e: _Episode) -> list[int]:
        return e.prompt_ids + e.response_ids

    def policy_turn(self, e: _Episode, c: Completion, turn: int) -> list:
        return _take_turn(e, c, self.config, self.marker, self.decode, turn)

    def environment_turn(self, episodes: list[_Episode], calls_of: list[list]) -> None:
        _run_tools(self.tools, episodes, calls_of, self.fmt, self.config, self.decode,
                   self.tokenizer, everywhere=self.engine.client_rank is None)


def _generate(engine, contexts: list[list[int]], n: int, params, max_tokens: int
              ) -> list[Completion]:
    """n completions of each context, flat, none of them past `max_tokens` tokens with its
    context: contexts with room for --max-new-tokens in one generate call, those nearer the
    limit in a second one with the smallest room among them (a turn with no room at all gets
    an empty completion, ended as "length")."""
    from megatron_rl.rollout.base import Completion

    rooms = [max_tokens - len(c) for c in contexts]
    full = [i for i, r in enumerate(rooms) if r >= params.max_new_tokens]
    near = [i for i, r in enumerate(rooms) if 0 < r < params.max_new_tokens]
    out: list[list[Completion]] = [[Completion([], [], "length")] * n for _ in contexts]
    for idx, max_new in ((full, params.max_new_tokens),
                         (near, min((rooms[i] for i in near), default=0))):
        if idx:
            groups = engine.generate([contexts[i] for i in idx], n,
                                     dataclasses.replace(params, max_new_tokens=max_new))
            for i, g in zip(idx, groups):
                out[i] = list(g)
    return [c for g in out for c in g]


def _take_turn(e: _Episode, c: Completion, config: AgentConfig, marker: str | None, decode,
               turn: int) -> list:
    """Append the policy's turn `c` to `e` (cut after a tool call's end marker and to the token
    limit); the turn's tool calls, [] where the episode ended."""
    ids, logprobs = list(c.token_ids), list(c.rollout_logprobs)
    finish = c.finish_reason
    if marker is not None:
        keep = _cut_after(ids, decode, marker)
        if keep < len(ids):
            ids, logprobs, finish = ids[:keep], logprobs[:keep], "stop"
    room = config.agent_max_tokens - e.length
    cut = len(ids) > room
    if cut:
        ids, logprobs, finish = ids[:room], logprobs[:room], "length"
    e.append(ids, logprobs)
    e.last_turn = ids
    e.finish_reason = finish
    e.count("turns")
    if cut:
        e.end = "max_tokens"
        return []
    calls = parse_tool_calls(decode(ids), config.tool_call_format)
    if not calls:
        e.end = "length" if finish == "length" else "answer"
        return []
    if turn + 1 >= config.agent_max_turns:
        e.end = "max_turns"
        return []
    if e.counts.get("agent/tool_calls", 0) + len(calls) > config.agent_max_tool_calls:
        e.end = "max_tool_calls"
        return []
    return calls


def _run_tools(tools: ToolExecutor, active: list[_Episode], calls_of: list[list], fmt: ChatFormat,
               config: AgentConfig, decode, tokenizer, everywhere: bool) -> None:
    """Every call of this turn at once; each episode's responses appended as its environment
    tokens (mask 0). `everywhere`: the loop runs on every rank of a model-parallel group (the
    in-process engine), so the calls run on the group's first rank and the others take its
    results: a tool answering differently on two ranks (a time limit hit on one) would send
    them different prompts."""
    def execute() -> list[tuple[list[tuple[str, str]], float]]:
        start = time.monotonic()
        futures = [[tools.submit(call) for call in calls] for calls in calls_of]
        out = []
        for calls in futures:
            results: list[ToolResult] = [f.result() for f in calls]
            out.append(([(r.text, r.outcome) for r in results], time.monotonic() - start))
        return out

    answers = model_parallel_source(execute) if everywhere else execute()
    for e, (results, seconds) in zip(active, answers):
        if not results:
            continue
        e.count("tool_calls", len(results))
        e.count("tool_seconds", seconds)  # this turn's wait for its tools
        for _, outcome in results:
            e.count(f"tool_{outcome}")
        text = fmt.after_turn([text for text, _ in results], decode(e.last_turn[-1:]))
        env = tokenizer(text, add_special_tokens=False)["input_ids"]
        if e.length + len(env) >= config.agent_max_tokens:
            e.end = "max_tokens"  # no room for the responses and a next turn
            continue
        e.append(env, None)


COUNT_NAMES = tuple(f"agent/{n}" for n in ("turns", "tool_calls", "tool_seconds",
                                            *(f"tool_{o}" for o in OUTCOMES),
                                            *(f"end_{r}" for r in END_REASONS)))
"""Every count an episode may carry in Trajectory.metadata["counts"]."""
