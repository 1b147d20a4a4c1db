"""The multi-turn agent loop: the built-in rollout function "agent" (--rollout-function agent).

An episode is one trajectory: the prompt, then turns of the policy and of its environment
(--agent-environment, agent/env.py: the built-in "tools" runs the turn's tool calls) until the
environment says done (for "tools": the policy answers without calling a tool) or a limit ends
it. Token in, token out:

    prompt_ids | policy turn 1 (mask 1) | observation 1 (mask 0) | policy turn 2 (mask 1) | ...

- The policy's tokens are exactly the ids the engine sampled, with its log-probs. They are never
  decoded and encoded again: the text of a turn is decoded only to find its tool calls.
- The environment's tokens are the text the chat format puts between the policy's turns (the
  end of the policy's turn where it did not end it itself, the environment's messages: tool
  responses as "tool" messages, an environment's str observation as a "user" message; the
  header of the next assistant turn), encoded once, without special tokens added (the
  format's own text with its special tokens, each message's content as plain text: a tool
  printing "<|im_end|>" gives those characters), and appended. They have mask
  0 and log-prob 0: the loss, the advantages, every KL estimator and placement, the importance
  weights and the metrics use the policy's tokens only (batch.pack_rollouts makes the mask the
  row's loss mask). docs/results.md derives why charging the environment's tokens, or counting
  them in importance weights, biases the gradient of the trajectory-level KL.
- A turn stops at the end of a tool call (the environment's `turn_end`; for "tools" the
  format's end marker, "</tool_call>" for qwen): where it is one token of the tokenizer it is a
  stop token of the generate call (every engine stops there); where it is not, the turn is cut
  after the first marker once generated (the tokens after it are dropped: the trajectory keeps
  a prefix of what was sampled, as a stop string does). A turn also ends at the tokenizer's
  end-of-sequence ids and at --max-new-tokens.

How episodes are scheduled (agent/schedule.py) follows the engine. With the in-process and
process engines they advance together, one turn at a time: one generate call per turn for all
episodes still running (the first for all prompts with n = group size, so that an engine shares
each prompt's prefill), then every episode's environment steps at once, each on a thread of its
own (for "tools": every tool call of the turn at once on ToolExecutor's threads,
--agent-tool-workers, one sandbox process each for the Python tool), so a slow environment holds
the others only until the slowest step of the turn returns. With an engine whose generate may
be called from several threads at once (RolloutEngine.concurrent_generate: vLLM, SGLang, a
server pool) each episode advances on its own on up to --agent-concurrency threads, so that one
episode's environment never holds another's generation. With the in-process engine the loop
runs on every rank of a model-parallel group; the environments live and run on the group's
first rank and the others take their answers (parallel.model_parallel_source), so that the
group's generate calls stay identical.

Limits (AgentConfig, agent/settings.py), each ending an episode with its reason, counted as
rollout/agent/end_<reason>:
    answer          the policy's turn made no tool call (the normal end)
    length          the policy's turn ran out of --max-new-tokens without a call
    max_turns       --agent-max-turns policy turns taken
    max_tool_calls  the turn's calls would pass --agent-max-tool-calls (not executed)
    max_tokens      the trajectory reached --agent-max-tokens (the turn is cut to fit; an
                    observation that does not fit is left out)
    env_error       the environment raised (made, reset or step): reward 0, every token mask 0
    env_timeout     its call took longer than --agent-env-timeout: the same
    (another environment may end an episode with a reason of its own: StepResult.end)
More than --agent-max-env-failures of the call's episodes ending in env_error or env_timeout
stop the rollout (env.check_failures: EnvironmentFailed naming the environment, the count, the
first failure's call, error and record), on every rank of a model-parallel group alike (the
outcomes it counts are the group's shared ones).

Rewards, one per policy turn (Trajectory.turn_rewards): the environment's step reward on that
turn, 0 where the step gave None; on the last policy turn, where its step gave none (or it was
not stepped: a turn cut at --agent-max-tokens), the task's verifier on that turn's text against
the record's answer (tool responses are not the policy's answer); an environment's reward on
the last turn is counted as agent/env_reward. The trajectory's reward is the sum of its turn
rewards (for the built-in tools environment, which gives none: the verifier's on the last
turn). An episode its environment failed: every turn reward 0.

Per-trajectory counts in Trajectory.metadata["counts"] (agent/turns, agent/tool_calls,
agent/tool_seconds, agent/tool_<outcome> for agent.tools.OUTCOMES, agent/end_<reason>,
agent/called_tools: 1 for an episode that called a tool at all, an environment's own
StepResult.counts) are averaged over the batch's trajectories and logged as
rollout/agent/<name>.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from megatron_rl.agent import schedule
from megatron_rl.agent.env import ERROR as ENV_ERROR
from megatron_rl.agent.env import OK, CallOutcome, StepResult, ToolsEnvironment
from megatron_rl.agent.env import (check_failures, close_loop, failure_text, log_failure,
                                   messages, resolve, resolve_environment, run_calls)
from megatron_rl.agent.env import TIMEOUT as ENV_TIMEOUT
from megatron_rl.agent.settings import AgentConfig, tool_registry
from megatron_rl.agent.tools import OUTCOMES, ToolExecutor, ToolRegistry, truncate_text
from megatron_rl.batch import Trajectory
from megatron_rl.parallel import model_parallel_source
from megatron_rl.rollout.needs import declare_needs

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord
    from megatron_rl.rollout.base import Completion, SamplingParams
    from megatron_rl.rollout.functions import RolloutContext

END_REASONS = ("answer", "length", "max_turns", "max_tool_calls", "max_tokens", ENV_ERROR,
               ENV_TIMEOUT)
_END_MARKERS = {"qwen": "</tool_call>", "llama3": None}  # llama3: the call is the whole turn


# -- the text between the policy's turns ------------------------------------------------------

_ASSISTANT = "assistant-turn-text"  # stand-ins: only the template's text around them is used
_USER = {"role": "user", "content": "user-turn-text"}


class ChatFormat:
    """The environment's text after a policy turn: `after_turn(messages, last_token)`.

    With a chat template (tokenizer.chat_template) it is what the template renders after an
    assistant message followed by the environment's messages (tool responses, user messages)
    and the next assistant header: the end of the assistant turn, the messages, the header.
    Only that text is taken, from the end of a stand-in assistant message's content on, so
    what a template renders before it does not enter: Qwen3's hybrid-thinking template gives
    the assistant message an empty think block only while it is the last message, and Llama
    3.2/3.3's put today's date in the system header; neither is part of the trajectory, whose
    prompt and policy turns are already tokens.

    A policy that ended its turn itself, with one of `end_ids` (the stop ids of generation:
    Llama 3.1 ends a tool call with <|eom_id|> and other turns with <|eot_id|>) or with the
    template's own end-of-turn token, gets no second end of turn: the template's end-of-turn
    token is left out. The turn end is told by token id, never by text, so a turn cut after a
    token that reads like the start of the end-of-turn token ("<") still gets it.

    Without a template, each tool response is in <tool_response> tags on lines of its own and
    any other message's content on lines of its own.

    `encode_after_turn` gives the token ids: the format's own text (the template's, with its
    special tokens) encoded with special tokens live, each message's content as plain text, so
    that a tool or an environment printing "<|im_end|>" gives the characters, never the policy's
    end-of-turn token."""

    def __init__(self, tokenizer: Any, end_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.templated = getattr(tokenizer, "chat_template", None) is not None
        self.end_ids = frozenset(end_ids)
        self._close_id: int | None = None  # the template's end-of-turn token, where it is one
        if self.templated:
            after = self._after_assistant([_USER], generation_prompt=False)  # <|im_end|>\n...
            ids = tokenizer(after, add_special_tokens=False)["input_ids"]
            if ids and ids[0] in set(tokenizer.all_special_ids):
                self._close_id = ids[0]
                self.end_ids |= {ids[0]}

    def _after_assistant(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template's text after an assistant message's content, `messages` following it."""
        rendered = self.tokenizer.apply_chat_template(
            [_USER, {"role": "assistant", "content": _ASSISTANT}, *messages], tokenize=False,
            add_generation_prompt=generation_prompt)
        if _ASSISTANT not in rendered:
            raise ValueError("the chat template does not render an assistant message's text")
        return rendered[rendered.index(_ASSISTANT) + len(_ASSISTANT):]

    def after_turn(self, results: Sequence[str | dict[str, str]], last_token: int | None
                   ) -> str:
        """The text appended after a policy turn whose last token id is `last_token` (None: an
        empty turn), holding the environment's messages `results` in order: a str is a tool
        response (a "tool" message), a dict a chat message ({"role", "content"})."""
        msgs = [{"role": "tool", "content": r} if isinstance(r, str) else r for r in results]
        if not self.templated:
            return "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>\n"
                           if m["role"] == "tool" else f"\n{m['content']}\n" for m in msgs)
        return "".join(text for text, _ in self._segments(msgs, last_token))

    def encode_after_turn(self, results: Sequence[str | dict[str, str]], last_token: int | None
                          ) -> list[int]:
        """The token ids of `after_turn(results, last_token)`'s text: the format's own text
        with special tokens live, each message's content with special tokens off (read as the
        characters they are made of)."""
        msgs = [{"role": "tool", "content": r} if isinstance(r, str) else r for r in results]
        ids: list[int] = []
        for text, content in self._segments(msgs, last_token):
            if text:
                ids += self.tokenizer(text, add_special_tokens=False,
                                      split_special_tokens=content)["input_ids"]
        return ids

    def _segments(self, msgs: list[dict], last_token: int | None) -> list[tuple[str, bool]]:
        """The text after a policy turn as (text, is a message's content) pieces in order.

        With a template, the messages are rendered once with a unique placeholder for each
        content and split there; each content is put back as the template renders it (a
        template may trim it: Llama 3's does), found by rendering the real messages too."""
        if not self.templated:
            out: list[tuple[str, bool]] = []
            for m in msgs:
                tool = m["role"] == "tool"
                out += [("\n<tool_response>\n" if tool else "\n", False), (m["content"], True),
                        ("\n</tool_response>\n" if tool else "\n", False)]
            return out
        nonce = secrets.token_hex(8)
        holders = {f"{{content-{i}-{nonce}}}": m["content"] for i, m in enumerate(msgs)
                   if isinstance(m.get("content"), str)}
        ids = iter(holders)
        placed = [dict(m, content=next(ids)) if isinstance(m.get("content"), str) else m
                  for m in msgs]
        template = self._after_assistant(placed, generation_prompt=True)
        pieces = re.split("(" + "|".join(map(re.escape, holders)) + ")", template) if holders else [template]
        real = self._after_assistant(msgs, generation_prompt=True)
        out, pos = [], 0
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                out.append((piece, False))
                pos += len(piece)
                continue
            content, after = holders[piece], pieces[i + 1]
            rendered = next((c for c in (content, content.strip())
                             if real.startswith(c + after, pos)), content)
            out.append((rendered, True))
            pos += len(rendered)
        if self._close_id is not None and last_token in self.end_ids:
            close = self.tokenizer.decode([self._close_id], skip_special_tokens=False)
            if out[0][0].startswith(close):
                out[0] = (out[0][0][len(close):], False)  # the policy ended its turn itself
        return out


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
    # the weight version of each token (--partial-rollouts: the engine's, for the policy's
    # tokens; an observation's tokens take the version before them); None: not tracked
    versions: list[int] | None = None
    last_turn: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    end: str | None = None
    counts: dict[str, float] = field(default_factory=dict)
    # the reward of each policy turn's step (None: no reward, or not stepped), and where the
    # turn ends in response_ids
    turn_rewards: list[float | None] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    env_info: dict[str, Any] = field(default_factory=dict)
    failure: tuple[str, CallOutcome] | None = None  # the failed call ("make", "reset", "step"), its outcome

    def count(self, name: str, by: float = 1.0) -> None:
        key = f"agent/{name}"
        self.counts[key] = self.counts.get(key, 0.0) + by

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def failed(self) -> bool:
        return self.end in (ENV_ERROR, ENV_TIMEOUT)

    def append(self, ids: list[int], logprobs: list[float] | None,
               versions: list[int] | None = None) -> None:
        """A policy turn (its log-probs and, under --partial-rollouts, its tokens' weight
        versions) or, `logprobs` None, the environment's tokens (mask 0)."""
        if versions is not None and self.versions is None:
            self.versions = [versions[0] if versions else 0] * len(self.response_ids)
        if self.versions is not None:
            last = self.versions[-1] if self.versions else 0
            self.versions += versions if versions is not None else [last] * len(ids)
        self.response_ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, status: str, what: str, outcome: CallOutcome) -> None:
        """Ended by its environment's failure (`outcome` of its call `what`): not trained on
        (every token mask 0)."""
        self.end, self.failure = status, (what, outcome)
        self.mask = [0] * len(self.response_ids)
        self.logprobs = [0.0] * len(self.response_ids)


@declare_needs(agent_settings=True, episode_context=True, tool_schemas=True, routing_replay=False,
               token_versions=True)
def agent_rollout(ctx: RolloutContext, records: Sequence[PromptRecord],
                  registry: ToolRegistry | None = None) -> list[list[Trajectory]]:
    """The rollout function "agent": ctx.group_size episodes per record (see the module
    docstring), each a scored Trajectory. `registry`: the built-in environment's tools
    (default: --agent-tools')."""
    config = ctx.agent or AgentConfig()
    tokenizer = ctx.codec.tokenizer
    fmt = ChatFormat(tokenizer, end_ids=ctx.codec.stop_ids)
    with_tools = config.agent_environment == "tools"
    factory = None if with_tools else resolve_environment(config.agent_environment)
    marker = (_END_MARKERS[config.tool_call_format] if with_tools
              else getattr(factory, "turn_end", None))
    marker_id = _marker_stop_id(tokenizer, marker)
    params = ctx.params
    if marker_id is not None:
        params = dataclasses.replace(params, stop_token_ids=tuple(
            sorted({*params.stop_token_ids, marker_id})))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    with contextlib.ExitStack() as stack:
        if with_tools:
            tools = stack.enter_context(ToolExecutor(
                registry if registry is not None else tool_registry(config),
                config.agent_tool_workers or None,
                max_output_chars=config.agent_max_tool_output_chars))
            factory = functools.partial(ToolsEnvironment, tools, config.tool_call_format,
                                        config.agent_max_turns, config.agent_max_tool_calls)
        assert factory is not None
        envs = _Environments(factory, config, [r for r in records for _ in range(ctx.group_size)],
                             everywhere=ctx.engine.client_rank is None)
        stack.callback(envs.close)
        episodes = _start(ctx, records, envs.reset())
        turns = _Turns(ctx.engine, config, envs, episodes, fmt, marker, decode, tokenizer)
        shared = [e.prompt_ids for e in episodes[::ctx.group_size]]
        prompts = shared if all(e.prompt_ids == shared[i // ctx.group_size]
                                for i, e in enumerate(episodes)) else None
        if turns.concurrent:
            schedule.concurrent(turns, episodes, prompts, ctx.group_size, params,
                                config.agent_max_turns, config.agent_concurrency)
        else:
            schedule.turn_synchronous(turns, episodes, prompts, ctx.group_size, params,
                                      config.agent_max_turns)
        for e in episodes:
            if e.end is None:  # still going after its last allowed turn
                e.end = "max_turns"
    failed = [failure_text(e.failure[1], e.failure[0], records[i // ctx.group_size],
                           envs.timeout) for i, e in enumerate(episodes) if e.failure]
    check_failures(config.agent_environment, config.agent_max_env_failures, len(episodes), failed)
    return _score(ctx, records, episodes)


class _Turns:
    """This rollout's turns as agent/schedule.py drives them (schedule.EpisodeTurns)."""

    def __init__(self, engine, config: AgentConfig, envs: _Environments,
                 episodes: list[_Episode], fmt: ChatFormat, marker: str | None, decode,
                 tokenizer):
        self.engine, self.config, self.envs, self.fmt = engine, config, envs, fmt
        self.marker, self.decode, self.tokenizer = marker, decode, tokenizer
        self.number = {id(e): i for i, e in enumerate(episodes)}
        # one client drives the engine and takes calls from several threads at once: episodes
        # advance on their own (every rank of an in-process engine's group takes each turn)
        self.concurrent = (getattr(engine, "concurrent_generate", False)
                           and engine.client_rank is not None)

    def generate(self, contexts: list[list[int]], n: int, params: SamplingParams
                 ) -> list[Completion]:
        return _generate(self.engine, contexts, n, params, self.config.agent_max_tokens)

    def context(self, e: _Episode) -> list[int]:
        return e.prompt_ids + e.response_ids

    def policy_turn(self, e: _Episode, c: Completion) -> bool:
        return _take_turn(e, c, self.config, self.marker, self.decode)

    def environment_turn(self, episodes: list[_Episode], turn: int) -> None:
        outcomes = self.envs.step([self.number[id(e)] for e in episodes],
                                  [self.decode(e.last_turn) for e in episodes])
        for e, outcome in zip(episodes, outcomes):
            _answer(e, outcome, self.fmt, self.config,
                    last_turn=turn + 1 >= self.config.agent_max_turns)


class _Environments:
    """One environment per episode, made, reset and stepped on daemon threads (env.run_calls)
    under --agent-env-timeout, on the model-parallel group's first rank when the loop runs on
    every rank of the group (`everywhere`: the in-process engine), the others taking its
    outcomes (parallel.model_parallel_source), as a tool's answers are: an environment
    answering differently on two ranks would send them different prompts. The environments
    exist on that rank alone."""

    def __init__(self, factory, config: AgentConfig, records: Sequence[PromptRecord],
                 everywhere: bool):
        self.factory, self.config, self.records, self.everywhere = factory, config, records, everywhere
        self.name = config.agent_environment
        self.timeout = config.agent_env_timeout if getattr(factory, "time_limited", True) else None
        self.envs: list[Any] = [None] * len(records)
        self.loops: list[Any] = [None] * len(records)  # each episode's event loop (env.resolve)
        self.failed: set[int] = set()  # episodes whose environment is never called again

    def _run(self, idx: list[int], calls: list, what: str) -> list[CallOutcome]:
        """`calls` (one per episode of `idx`) run on this rank; failures logged, their
        environments dropped. A RuntimeError (too many abandoned calls) is returned, not
        raised, so that the other ranks of the group get it too."""
        try:
            outcomes = run_calls(calls, self.timeout, self.config.agent_env_max_abandoned)
        except RuntimeError as e:
            return [CallOutcome("fatal", error=str(e))]
        for i, o in zip(idx, outcomes):
            assert o is not None
            o.call = what
            if o.status != OK:
                log_failure(o, what, self.records[i], self.name, self.timeout)
                self.failed.add(i)
                if o.status == ENV_ERROR and what != "close":  # its call is over: no thread
                    close_loop(self.loops, i)  # runs the loop of an environment dropped
        return [o for o in outcomes if o is not None]

    def _everywhere(self, fn):
        out = model_parallel_source(fn) if self.everywhere else fn()
        if len(out) == 1 and out[0].status == "fatal":
            raise RuntimeError(out[0].error)
        return out

    def reset(self) -> list[CallOutcome]:
        """Each episode's environment made, then reset: OK with the prompt text to use (None:
        the record's), or the failure of its "make" or "reset" call (CallOutcome.call)."""
        def make(i: int) -> None:
            self.envs[i] = self.factory(**self.config.agent_env_args)  # {} for the built-in tools

        def reset(i: int) -> str | None:
            prompt = resolve(self.envs[i].reset(self.records[i]), self.loops, i)
            if prompt is not None and not isinstance(prompt, str):
                raise TypeError(f"reset returned a {type(prompt).__name__}, not a str or None")
            return prompt

        def fatal(outcomes: list[CallOutcome]) -> bool:
            return len(outcomes) == 1 and outcomes[0].status == "fatal"

        def make_and_reset() -> list[CallOutcome]:
            idx = list(range(len(self.records)))
            outcomes = self._run(idx, [functools.partial(make, i) for i in idx], "make")
            if fatal(outcomes):
                return outcomes
            made = [i for i, o in zip(idx, outcomes) if o.status == OK]
            resets = self._run(made, [functools.partial(reset, i) for i in made], "reset")
            if fatal(resets):
                return resets
            for i, o in zip(made, resets):
                outcomes[i] = o
            return outcomes

        return self._everywhere(make_and_reset)

    def step(self, idx: list[int], texts: list[str]) -> list[CallOutcome]:
        """The environments of episodes `idx` stepped on their policy turns `texts`: OK with a
        StepResult (its observation as chat messages, each cut to
        --agent-max-tool-output-chars and counted as observation_truncated), or the failure."""
        limit = self.config.agent_max_tool_output_chars

        def step(i: int, text: str) -> StepResult:
            result = resolve(self.envs[i].step(text), self.loops, i)
            if not isinstance(result, StepResult):
                raise TypeError(f"step returned a {type(result).__name__}, not a StepResult")
            reward = None if result.reward is None else float(result.reward)
            if reward is not None and not math.isfinite(reward):
                raise ValueError(f"step returned the reward {reward}, not a finite number")
            observation, counts = [], dict(result.counts)
            for m in messages(result.observation):
                content, cut = truncate_text(m["content"], limit)
                observation.append(dict(m, content=content))
                if cut:
                    counts["observation_truncated"] = counts.get("observation_truncated", 0) + 1
            return dataclasses.replace(result, observation=observation, reward=reward,
                                       counts=counts)

        if not idx:
            return []
        return self._everywhere(lambda: self._run(
            idx, [functools.partial(step, i, t) for i, t in zip(idx, texts)], "step"))

    def close(self) -> None:
        """Every environment still held closed (on this rank; a failure is logged)."""
        def close(i: int) -> None:
            try:
                resolve(self.envs[i].close(), self.loops, i)
            finally:
                close_loop(self.loops, i)

        held = [i for i, env in enumerate(self.envs) if env is not None and i not in self.failed]
        if held:
            self._run(held, [functools.partial(close, i) for i in held], "close")


def _start(ctx: RolloutContext, records: Sequence[PromptRecord], resets: list[CallOutcome]
           ) -> list[_Episode]:
    """The episodes, each on its record's prompt or the prompt its environment's reset gave;
    one whose environment failed to start ended with the failure."""
    record_ids = [ctx.codec.encode(r.text) for r in records]
    episodes = []
    for i, o in enumerate(resets):
        prompt = o.value if o.status == OK else None
        e = _Episode(list(record_ids[i // ctx.group_size]) if prompt is None
                     else ctx.codec.encode(prompt))
        if o.status != OK:
            e.fail(o.status, o.call or "reset", o)
        episodes.append(e)
    return episodes


def _answer(e: _Episode, outcome: CallOutcome, fmt: ChatFormat, config: AgentConfig,
            last_turn: bool) -> None:
    """The environment's `outcome` for the policy's last turn applied to `e`: its failure, the
    end it gives, or its observation appended (mask 0)."""
    if outcome.status != OK:
        e.fail(outcome.status, "step", outcome)
        return
    result: StepResult = outcome.value
    for name, value in result.counts.items():
        e.count(name, value)
    e.turn_rewards[-1], e.env_info = result.reward, result.info
    if result.done:
        end = result.end or "answer"
        e.end = "length" if end == "answer" and e.finish_reason == "length" else end
        return
    if last_turn:
        e.end = "max_turns"
        return
    last_token = e.last_turn[-1] if e.last_turn else None
    env = fmt.encode_after_turn(list(result.observation or ()), last_token)
    if e.length + len(env) >= config.agent_max_tokens:
        e.end = "max_tokens"  # no room for the observation and a next turn
        return
    e.append(env, None)


def _score(ctx: RolloutContext, records: Sequence[PromptRecord], episodes: list[_Episode]
           ) -> list[list[Trajectory]]:
    """The trajectories, grouped by record, with their turn rewards (the module docstring):
    each turn's step reward (None: 0), the verifier's on the last turn where its step gave
    none, all 0 for an episode its environment failed; the reward is their sum."""
    k = ctx.group_size
    verify = [i for i, e in enumerate(episodes)
              if not e.failed and (not e.turn_rewards or e.turn_rewards[-1] is None)]
    scored = ctx.scorer.score(
        [ctx.codec.decode(episodes[i].last_turn) for i in verify],
        [records[i // k].answer for i in verify], [records[i // k].task for i in verify],
        [records[i // k].metadata for i in verify]) if verify else []
    verified: dict[int, tuple[float, str | None]] = {
        i: (s.reward, s.reason) for i, s in zip(verify, scored)}
    groups: list[list[Trajectory]] = []
    for i, e in enumerate(episodes):
        if i % k == 0:
            groups.append([])
        turn_rewards = [0.0 if r is None or e.failed else r for r in e.turn_rewards]
        reward, reward_error = 0.0, None
        if i in verified:
            reward, reward_error = verified[i]
            if turn_rewards:
                turn_rewards[-1] = reward
        elif not e.failed:
            e.count("env_reward")
        reward = sum(turn_rewards) if turn_rewards else reward
        e.count(f"end_{e.end}")
        if e.counts.get("agent/tool_calls"):
            e.count("called_tools")
        metadata: dict[str, Any] = {"counts": e.counts, "end": e.end}
        if e.env_info:
            metadata["env_info"] = e.env_info
        groups[-1].append(Trajectory(e.prompt_ids, e.response_ids, e.mask, e.logprobs,
                                     e.finish_reason, reward, reward_error, metadata=metadata,
                                     turn_rewards=turn_rewards, turn_ends=list(e.turn_ends),
                                     token_versions=e.versions))
    return groups


def _generate(engine, contexts: list[list[int]], n: int, params, max_tokens: int
              ) -> list[Completion]:
    """n completions of each context, flat, none of them past `max_tokens` tokens with its
    context: the contexts with room for --max-new-tokens in one generate call, and those nearer
    the limit in one call per room, each with its own room as max_new_tokens, so that an
    episode near the limit never cuts another's turn (a turn with no room at all gets an empty
    completion, ended as "length"). Each call is seeded as its first context would be in one
    call of all of them (base.prompt_seed), so no two calls of a turn share a seed."""
    from megatron_rl.rollout.base import Completion, prompt_seed

    rooms = [max_tokens - len(c) for c in contexts]
    calls: dict[int, list[int]] = {}  # max_new_tokens -> the contexts generated with it
    for i, room in enumerate(rooms):
        if room > 0:
            calls.setdefault(min(room, params.max_new_tokens), []).append(i)
    out: list[list[Completion]] = [[Completion([], [], "length")] * n for _ in contexts]
    for max_new, idx in sorted(calls.items(), key=lambda item: item[1][0]):
        groups = engine.generate([contexts[i] for i in idx], n, dataclasses.replace(
            params, max_new_tokens=max_new, seed=prompt_seed(params.seed, idx[0])))
        for i, g in zip(idx, groups):
            out[i] = list(g)
    return [c for g in out for c in g]


def _take_turn(e: _Episode, c: Completion, config: AgentConfig, marker: str | None, decode
               ) -> bool:
    """Append the policy's turn `c` to `e` (cut after the environment's turn end marker and to
    the token limit); whether the environment is to answer it (False: the episode ended)."""
    ids, logprobs = list(c.token_ids), list(c.rollout_logprobs)
    versions = None if c.token_versions is None else list(c.token_versions)
    finish = c.finish_reason
    if marker is not None:
        keep = _cut_after(ids, decode, marker)
        if keep < len(ids):
            ids, logprobs, finish = ids[:keep], logprobs[:keep], "stop"
    room = config.agent_max_tokens - e.length
    cut = len(ids) > room
    if cut:
        ids, logprobs, finish = ids[:room], logprobs[:room], "length"
    e.append(ids, logprobs, None if versions is None else versions[:len(ids)])
    e.last_turn = ids
    e.finish_reason = finish
    e.turn_rewards.append(None)
    e.turn_ends.append(len(e.response_ids))
    e.count("turns")
    if cut:
        e.end = "max_tokens"
    return not cut


COUNT_NAMES = tuple(f"agent/{n}" for n in ("turns", "tool_calls", "called_tools", "tool_seconds",
                                            "env_reward",
                                            *(f"tool_{o}" for o in OUTCOMES),
                                            *(f"end_{r}" for r in END_REASONS)))
"""Every count an episode of the built-in environment may carry in Trajectory.metadata["counts"]
(another environment adds its own StepResult.counts)."""
