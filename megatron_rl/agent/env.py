"""Environments of the agent loop: what answers the policy's turns (--agent-environment).

An environment is made once per episode and sees it from the start to the end::

    env = factory(**env_args)           # --agent-environment module:Class, --agent-env-args
    prompt = env.reset(record)          # None: the record's prompt; a str: the prompt to use
    result = env.step(turn_text)        # after every policy turn
    env.close()                         # once the episode ended (not after a hung call)

`turn_text` is the text of the policy's turn, decoded with its special tokens kept (an end of
turn such as <|im_end|> is there when the policy wrote it). `step` returns a StepResult:

    observation  the environment's message to the policy: a str (one user message), a list of
                 chat messages ({"role": "user" | "tool" | ..., "content": str}, the OpenAI
                 form), or None (nothing but the next assistant header). The agent loop renders
                 it with the chat template (ChatFormat.after_turn), encodes it once and appends
                 it with mask 0
    reward       the reward for this turn, or None
    done         the episode is over (the observation is then not shown)
    end          why, when done: counted as rollout/agent/end_<end> (default "answer")
    counts       numbers summed over the episode's steps into its metrics (rollout/agent/<name>)
    info         anything else; the last step's is kept in the trajectory's metadata

The trajectory's rewards (agent/loop.py): one per policy turn, Trajectory.turn_rewards, the
`reward` of the step on that turn (None: 0); on the last policy turn, where its step returned
no reward (or there was no step: a turn cut at --agent-max-tokens), the task's verifier on that
turn's text. The trajectory's reward is their sum.

`reset`, `step` and `close` may be coroutine functions (`async def`), or return an awaitable:
it is awaited on the call's thread, in an event loop of the episode's own, made at its first
awaitable and kept for all its calls (an environment may hold loop-bound things from reset to
close: a client session, a lock, a subprocess), closed after `close`. Each call still runs on
a thread of its own under --agent-env-timeout, so one episode's slow coroutine holds no other.

Each message of an observation is cut to --agent-max-tool-output-chars characters (its head
and tail around a note of how much was cut, as a tool's output is: tools.truncate_text),
counted as rollout/agent/observation_truncated.

Failures are the episode's, not the run's: `factory()`, `reset` and `step` run on daemon threads
(one per call, all of a turn's episodes at once) and a call that raises, or that has not
returned after --agent-env-timeout seconds, ends its episode with reward 0, end reason
env_error or env_timeout, and its policy tokens masked (mask 0: the policy is not trained on an
episode its environment broke; it leaves its group's baseline). A Python thread cannot be
killed: the thread of a call that timed out is abandoned, still running, and its environment is
never touched again. At most --agent-env-max-abandoned such threads may be alive in the process
at once; one more stops the run with an error (an environment that hangs that often is broken,
and each hung thread holds its memory). An environment that fails more than
--agent-max-env-failures of a rollout call's episodes is broken, not unlucky: the rollout stops
with EnvironmentFailed, naming the environment, how many episodes failed and the first
failure's call, error and record.

The built-in environment "tools" (ToolsEnvironment) is the loop's tool calling: it parses the
turn's calls (--tool-call-format), runs them on the loop's ToolExecutor, and answers with one
tool message per call; a turn without a call ends the episode (end "answer"). Its tools bound
their own time, and its step's time includes the wait for a free tool worker, which grows with
the batch: it runs without --agent-env-timeout.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence, Union

from megatron_rl.agent.parsing import parse_tool_calls
from megatron_rl.agent.tools import ToolExecutor
from megatron_rl.errors import RunError
from megatron_rl.imports import import_callable

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord

log = logging.getLogger(__name__)

Observation = Union[str, Sequence[Mapping[str, str]], None]


@dataclass
class StepResult:
    """What an environment answers to one policy turn (see the module docstring)."""

    observation: Observation = None
    reward: float | None = None
    done: bool = False
    end: str | None = None
    counts: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """The interface an --agent-environment class implements (subclassing is optional: an
    object with these methods will do).

    turn_end: text after which a policy turn ends, read from the class: where it is one token
        of the tokenizer it is a stop token of the generate call, else the turn is cut after it
        (None: a turn ends at the tokenizer's end of sequence or --max-new-tokens only).
    time_limited: whether --agent-env-timeout applies to its calls (True unless the environment
        bounds its own time).
    """

    turn_end: ClassVar[str | None] = None
    time_limited: ClassVar[bool] = True

    def reset(self, record: PromptRecord) -> str | None:
        """Start an episode on `record` (its prompt `text`, `task`, `answer` and the data row's
        `metadata`); the prompt text to use instead of record.text, or None."""
        return None

    def step(self, turn: str) -> StepResult:
        """The environment's answer to the policy's turn `turn`."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (called once it ended)."""


def messages(observation: Observation) -> list[dict[str, str]]:
    """`observation` as chat messages: a str is one user message."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    out = []
    for m in observation:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise TypeError(f"an observation message must be a mapping with a str 'content', "
                            f"got {m!r}")
        out.append({"role": str(m.get("role", "user")), "content": m["content"]})
    return out


BUILT_IN = ("tools",)


def resolve_environment(name: str) -> Callable[[], Any]:
    """The factory --agent-environment `name` names: `module:attr` (attr may be a dotted path),
    a class or function called with --agent-env-args as keyword arguments (checked against its
    signature at configuration: agent/settings.py) to make one episode's environment. Raises
    ValueError naming the flag when it does not import or is not callable."""
    return import_callable(name, f"--agent-environment {name!r}", "environment", BUILT_IN,
                           form="class or function")


class ToolsEnvironment(Environment):
    """The built-in environment "tools": the policy's tool calls run on `tools`, their
    responses are the observation (one "tool" message per call, in order).

    Ends the episode (in this order) when the turn makes no call ("answer"), when it is the
    --agent-max-turns-th turn ("max_turns") and when its calls would pass
    --agent-max-tool-calls ("max_tool_calls"), in the last two without running the calls.
    Counts: tool_calls, tool_seconds (the wait for this turn's calls), tool_<outcome>."""

    time_limited = False

    def __init__(self, tools: ToolExecutor, tool_call_format: str, max_turns: int,
                 max_tool_calls: int):
        self.tools, self.format = tools, tool_call_format
        self.max_turns, self.max_tool_calls = max_turns, max_tool_calls
        self.turns = self.calls = 0

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        calls = parse_tool_calls(turn, self.format)
        if not calls:
            return StepResult(done=True, end="answer")
        if self.turns >= self.max_turns:
            return StepResult(done=True, end="max_turns")
        if self.calls + len(calls) > self.max_tool_calls:
            return StepResult(done=True, end="max_tool_calls")
        self.calls += len(calls)
        start = time.monotonic()
        results = [f.result() for f in [self.tools.submit(c) for c in calls]]
        counts = {"tool_calls": float(len(results)), "tool_seconds": time.monotonic() - start}
        for r in results:
            counts[f"tool_{r.outcome}"] = counts.get(f"tool_{r.outcome}", 0.0) + 1
        return StepResult([{"role": "tool", "content": r.text} for r in results], counts=counts)


# -- calls on threads, under a time limit -----------------------------------------------------

OK, ERROR, TIMEOUT = "ok", "env_error", "env_timeout"


@dataclass
class CallOutcome:
    """One environment call's outcome: status OK with its `value`, ERROR with `error` (the
    exception's type and message) and `where` (the file, line and function it was raised in),
    or TIMEOUT; `seconds` it took (the limit, for TIMEOUT); `call`, which call it was
    ("make": the factory called with --agent-env-args, "reset", "step", "close")."""

    status: str
    value: Any = None
    error: str = ""
    seconds: float = 0.0
    where: str = ""
    call: str = ""


class _Abandoned:
    """The threads of calls that timed out and are still running, process-wide."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, thread: threading.Thread, limit: int) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            alive = len(self._threads)
        if alive > limit:
            raise RuntimeError(
                f"{alive} agent environment calls are still running past --agent-env-timeout "
                f"(--agent-env-max-abandoned {limit}): the environment hangs too often to go on; "
                "its threads cannot be stopped")

    def alive(self) -> int:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return len(self._threads)


ABANDONED = _Abandoned()


def run_calls(calls: Sequence[Callable[[], Any] | None], timeout: float | None,
              max_abandoned: int) -> list[CallOutcome | None]:
    """Each call on a daemon thread of its own, all at once; its CallOutcome (None for a None
    call). `timeout`: seconds each may take from the start of all (None: no limit); a call
    past it is abandoned (ABANDONED), and more than `max_abandoned` abandoned threads alive
    raise RuntimeError."""
    boxes: list[list] = [[] for _ in calls]

    def target(fn: Callable[[], Any], box: list, start: float) -> None:
        try:
            value = fn()
            box.append(CallOutcome(OK, value, seconds=time.monotonic() - start))
        except BaseException as e:  # noqa: BLE001 - the episode's failure, reported
            frames = traceback.extract_tb(e.__traceback__)
            where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
            box.append(CallOutcome(ERROR, error=f"{type(e).__name__}: {e}",
                                   seconds=time.monotonic() - start, where=where))

    start = time.monotonic()
    threads: list[threading.Thread | None] = []
    for fn, box in zip(calls, boxes):
        if fn is None:
            threads.append(None)
            continue
        t = threading.Thread(target=target, args=(fn, box, start), name="agent-env", daemon=True)
        t.start()
        threads.append(t)
    out: list[CallOutcome | None] = []
    for t, box in zip(threads, boxes):
        if t is None:
            out.append(None)
            continue
        t.join(None if timeout is None else max(0.0, start + timeout - time.monotonic()))
        if box:
            out.append(box[0])
        else:
            out.append(CallOutcome(TIMEOUT, seconds=float(timeout or 0.0)))
            ABANDONED.add(t, max_abandoned)
    return out


def record_identity(record: PromptRecord) -> str:
    """The record as a log names it: its uid, and its data file and row where known."""
    where = [f"{k}={record.metadata[k]}" for k in ("source", "row") if k in record.metadata]
    return record.uid + (f" ({', '.join(where)})" if where else "")


def failure_text(outcome: CallOutcome, what: str, record: PromptRecord,
                 timeout: float | None) -> str:
    """`<call> on record <record> raised <type: message> (at <file:line>)`, or that it did not
    return in time: one failed call, as the log and EnvironmentFailed name it."""
    why = (f"did not return within --agent-env-timeout {timeout} s (its thread is abandoned)"
           if outcome.status == TIMEOUT else
           f"raised {outcome.error}" + (f" (at {outcome.where})" if outcome.where else ""))
    call = "making the environment (its factory with --agent-env-args)" if what == "make" else what
    return f"{call} on record {record_identity(record)} {why}"


def log_failure(outcome: CallOutcome, what: str, record: PromptRecord, environment: str,
                timeout: float | None) -> None:
    """One warning for an episode its environment failed."""
    log.warning("agent environment %s: %s%s", environment,
                failure_text(outcome, what, record, timeout),
                "" if what == "close" else "; the episode ends with reward 0")


class EnvironmentFailed(RunError):
    """An --agent-environment failed more than --agent-max-env-failures of a rollout call's
    episodes (check_failures): the run stops, the message naming the environment, the count
    and the first failure."""


def check_failures(environment: str, max_share: float, total: int,
                   failures: Sequence[str]) -> None:
    """Raise EnvironmentFailed when `failures` (failure_text of each failed episode, in episode
    order) are more than `max_share` (--agent-max-env-failures) of the `total` episodes of a
    rollout call. Below it the failed episodes stay the episodes' own (reward 0, mask 0)."""
    if not failures or len(failures) <= max_share * total:
        return
    raise EnvironmentFailed(
        f"agent environment {environment} (--agent-environment) failed {len(failures)} of "
        f"{total} episodes of this rollout, more than --agent-max-env-failures {max_share:g} "
        f"of them; the first: {failures[0]}")


def resolve(value: Any, loops: list[asyncio.AbstractEventLoop | None], i: int) -> Any:
    """`value`, awaited where it is awaitable (a coroutine function's call, or a coroutine a
    plain function returned) in episode `i`'s event loop `loops[i]`, made on first use, on this
    thread. The calls of one environment never overlap (a call past the timeout is abandoned
    with its environment), so the loop is never run by two threads at once."""
    if not inspect.isawaitable(value):
        return value
    if loops[i] is None:
        loops[i] = asyncio.new_event_loop()
    loop = loops[i]
    assert loop is not None
    return loop.run_until_complete(value)


def close_loop(loops: list[asyncio.AbstractEventLoop | None], i: int) -> None:
    """Episode `i`'s event loop, if it made one, closed (its async generators finished)."""
    loop, loops[i] = loops[i], None
    if loop is not None:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


__all__ = ["ABANDONED", "BUILT_IN", "CallOutcome", "Environment", "EnvironmentFailed",
           "StepResult", "ToolsEnvironment", "check_failures", "failure_text", "messages",
           "resolve_environment", "run_calls"]
