"""An environment that fails most of a rollout's episodes stops it, naming the environment, the
count, the first error and its record (below --agent-max-env-failures the failed episodes are
their own); async environments are awaited in an event loop of each episode's own; an
environment's long message is cut as a tool's output is.

The policy is test_agent_loop's scripted engine; the environments, the loop and the scorer are
real (test_env's helpers)."""
import asyncio
import logging
import time

import pytest
from test_env import _run, hung_threads_released, release  # noqa: F401 - a fixture

from megatron_rl.agent.env import ABANDONED, Environment, EnvironmentFailed, StepResult
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.errors import RunError

HERE = __name__


def _records(n, **meta):
    return [PromptRecord(f"games:{i}", "Play:", "arithmetic", "1",
                         {"source": "games.jsonl", "row": i, **meta}) for i in range(n)]


class BrokenStep:
    """Every step raises; where the record's metadata has "ok", the step answers (reward 1)."""

    def reset(self, record):
        self.ok = record.metadata.get("ok", False)

    def step(self, turn):
        if self.ok:
            return StepResult(reward=1.0, done=True)
        raise KeyError("no such board")

    def close(self):
        pass


def test_an_environment_failing_every_episode_stops_the_rollout_naming_it(tokenizer, scorer):
    config = AgentConfig(agent_environment=f"{HERE}:BrokenStep")
    with pytest.raises(EnvironmentFailed) as info:
        _run(tokenizer, scorer, lambda _, __: "1<eos>", _records(2), config)
    message = str(info.value)
    assert message.startswith(f"agent environment {HERE}:BrokenStep (--agent-environment) "
                              "failed 4 of 4 episodes of this rollout, more than "
                              "--agent-max-env-failures 0.5 of them; the first: step on record "
                              "games:0 (source=games.jsonl, row=0) raised KeyError: "
                              "'no such board' (at "), message
    assert "test_env_failures.py" in message and "in step" in message  # where it raised
    # what the commands print without a traceback (errors.run_command)
    assert isinstance(info.value, RunError) and isinstance(info.value, RuntimeError)


def test_below_the_share_failed_episodes_are_their_own(tokenizer, scorer, caplog):
    records = _records(4, ok=True)
    records[2].metadata["ok"] = False  # 2 of 8 episodes fail
    config = AgentConfig(agent_environment=f"{HERE}:BrokenStep", agent_max_env_failures=0.25)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.agent.env"):
        groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records, config)
    assert [[t.metadata["end"] for t in g] for g in groups] == [
        ["answer"] * 2, ["answer"] * 2, ["env_error"] * 2, ["answer"] * 2]
    assert [t.reward for t in groups[2]] == [0.0, 0.0]
    assert all(set(t.response_mask) == {0} for t in groups[2])
    assert sum("games:2" in r.getMessage() for r in caplog.records) == 2
    # one more than the share stops it; a share of 0 stops at the first failed episode
    for share, batch in ((0.2, records), (0.0, _records(1, ok=True) + _records(1))):
        config = AgentConfig(agent_environment=f"{HERE}:BrokenStep",
                             agent_max_env_failures=share)
        with pytest.raises(EnvironmentFailed, match="failed 2 of "):
            _run(tokenizer, scorer, lambda _, __: "1<eos>", batch, config)


class Picky:
    """An environment whose constructor refuses its settings (--agent-env-args)."""

    def __init__(self, board: str = "go"):
        if board not in ("go", "chess"):
            raise ValueError(f"no board {board!r}")

    def reset(self, record):
        return None

    def step(self, turn):
        return StepResult(reward=1.0, done=True)


def test_an_environment_that_cannot_be_made_is_named_as_such(tokenizer, scorer):
    config = AgentConfig(agent_environment=f"{HERE}:Picky", agent_env_args={"board": "shogi"})
    with pytest.raises(EnvironmentFailed) as info:
        _run(tokenizer, scorer, lambda _, __: "1<eos>", _records(2), config)
    message = str(info.value)
    assert ("the first: making the environment (its factory with --agent-env-args) on record "
            "games:0 (source=games.jsonl, row=0) raised ValueError: no board 'shogi' (at ") in message
    assert "in __init__" in message
    # made with settings it takes, the same environment plays
    config = AgentConfig(agent_environment=f"{HERE}:Picky", agent_env_args={"board": "chess"})
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", _records(2), config)
    assert [t.reward for g in groups for t in g] == [1.0] * 4


closed: list[str] = []


class AsyncGuess:
    """Guess the record's metadata["secret"] with async reset, step and close. reset makes an
    asyncio.Lock, held by step: a lock is bound to the loop it is first used in, so every call
    of the episode must run in one loop. metadata["hang"]: the step waits for `release`."""

    async def reset(self, record):
        self.record, self.lock = record, asyncio.Lock()
        async with self.lock:
            await asyncio.sleep(0)
        return None

    async def step(self, turn):
        if self.record.metadata.get("hang"):
            await asyncio.get_running_loop().run_in_executor(None, release.wait)
        async with self.lock:
            await asyncio.sleep(0.01)
            if turn.startswith(str(self.record.metadata["secret"])):
                return StepResult(reward=1.0, done=True)
            return StepResult("higher", reward=0.25)

    async def close(self):
        async with self.lock:
            closed.append(self.record.uid)


class ReturnsCoroutine:
    """A plain `def step` returning a coroutine: awaited like an async step's."""

    def reset(self, record):
        return None

    def step(self, turn):
        async def answer():
            await asyncio.sleep(0)
            return StepResult(reward=1.0, done=True)
        return answer()


class AsyncBroken(Environment):
    async def reset(self, record):
        await asyncio.sleep(0)

    async def step(self, turn):
        raise KeyError("no such board")


def test_async_environments_run_and_score(tokenizer, scorer, monkeypatch):
    closed.clear()
    loops = []
    new_loop = asyncio.new_event_loop
    monkeypatch.setattr(asyncio, "new_event_loop", lambda: loops.append(new_loop()) or loops[-1])
    records = [PromptRecord(f"guess:{i}", "Guess:", "arithmetic", "0", {"secret": 2})
               for i in range(2)]
    config = AgentConfig(agent_environment=f"{HERE}:AsyncGuess", agent_max_turns=3)
    guesses = lambda context, _: "2<eos>" if "higher" in context else "1<eos>"  # noqa: E731
    groups, _, _ = _run(tokenizer, scorer, guesses, records, config)
    for t in (t for g in groups for t in g):
        assert t.metadata["end"] == "answer" and t.metadata["counts"]["agent/turns"] == 2
        assert t.turn_rewards == [0.25, 1.0] and t.reward == 1.25
    assert sorted(closed) == ["guess:0", "guess:0", "guess:1", "guess:1"]
    assert len(loops) == 4 and all(loop.is_closed() for loop in loops)  # one an episode
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records[:1],
                        AgentConfig(agent_environment=f"{HERE}:ReturnsCoroutine"))
    assert [t.reward for t in groups[0]] == [1.0, 1.0]
    # an async step that raises fails its episode; its loop is closed all the same
    loops.clear()
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records[:1],
                        AgentConfig(agent_environment=f"{HERE}:AsyncBroken",
                                    agent_max_env_failures=1.0))
    assert [t.metadata["end"] for t in groups[0]] == ["env_error"] * 2
    assert len(loops) == 2 and all(loop.is_closed() for loop in loops)


def test_an_async_step_past_the_timeout_fails_its_episode(tokenizer, scorer,
                                                          hung_threads_released):  # noqa: F811
    records = [PromptRecord("guess:0", "Guess:", "arithmetic", "0", {"secret": 1}),
               PromptRecord("guess:1", "Guess:", "arithmetic", "0", {"secret": 1, "hang": True})]
    config = AgentConfig(agent_environment=f"{HERE}:AsyncGuess", agent_env_timeout=0.3)
    start = time.monotonic()
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records, config)
    assert time.monotonic() - start < 5
    assert [[t.metadata["end"] for t in g] for g in groups] == [["answer"] * 2,
                                                                ["env_timeout"] * 2]
    assert ABANDONED.alive() == 2


class Verbose(Environment):
    """Answers the first turn with a 1 MB message (and a short one), the second with reward 1."""

    def reset(self, record):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "HEAD" + "x" * 1_000_000 + "TAIL"},
                               {"role": "tool", "content": "short"}])
        return StepResult(reward=1.0, done=True)


def test_a_long_environment_message_is_cut_to_its_head_and_tail(tokenizer, scorer):
    config = AgentConfig(agent_environment=f"{HERE}:Verbose", agent_max_tool_output_chars=200,
                         agent_max_tokens=4096)
    start = time.monotonic()
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", _records(1), config,
                        group_size=1)
    assert time.monotonic() - start < 5
    t = groups[0][0]
    text = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if m == 0])
    first = text.split("\n<tool_response>")[0].strip("\n")
    assert len(first) <= 200 and first.startswith("HEADxx") and first.endswith("xxTAIL")
    assert f"\n...[{1_000_008 - len(first.split(chr(10))[0]) - len(first.split(chr(10))[-1])} " \
        "characters truncated]...\n" in first  # head and tail around how much was cut
    assert "\n<tool_response>\nshort\n</tool_response>\n" in text  # a short one as it is
    assert t.metadata["counts"]["agent/observation_truncated"] == 1
    assert t.reward == 1.0 and t.metadata["end"] == "answer"


def test_skyrl_rows_without_an_env_class_stop_the_rollout_clearly(tokenizer, scorer):
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed "
                        "(requirements-cpu.txt pins it)")
    records = [PromptRecord(f"gsm8k:{i}", "Q: 8*9?", "gsm8k", "72",
                            {"source": "gsm8k.jsonl", "row": i}) for i in range(2)]
    config = AgentConfig(agent_environment="megatron_rl.agent.envs.skyrl:SkyRLGymEnvironment")
    with pytest.raises(EnvironmentFailed) as info:
        _run(tokenizer, scorer, lambda _, __: "#### 72<eos>", records, config)
    message = str(info.value)
    assert ("agent environment megatron_rl.agent.envs.skyrl:SkyRLGymEnvironment "
            "(--agent-environment) failed 4 of 4 episodes") in message
    assert ("reset on record gsm8k:0 (source=gsm8k.jsonl, row=0) raised ValueError: record "
            "gsm8k:0: no metadata env_class") in message
    assert "gsm8k_multi_turn" in message  # the environments it could name

