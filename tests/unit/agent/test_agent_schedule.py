"""How the agent loop schedules episodes (megatron_rl.agent.schedule), on the real decoder.

The policy is a real tiny model on the real LocalEngine: make_tool_caller_model's weights make
it call the "sleep" tool at every turn (near certainly at temperature 1; at temperature 3 it
often writes something else and ends its episode). The tool is a real registered tool that
sleeps and records when each call ran. The engine is the LocalEngine behind a lock, declared
`concurrent_generate` with one client: the lock makes its generate safe to call from several
threads (a server is; the in-process decoder is not), so that the concurrent schedule, the
thing under test, runs over a real engine.
"""
import threading
import time

import pytest
import torch

from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.agent.tools import Tool, ToolRegistry
from megatron_rl.data.prompts import Codec, PromptRecord, load_tokenizer
from megatron_rl.experiments.tiny_model import make_tool_caller_model
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.functions import RolloutContext

pytest.importorskip("megatron.core")

RECORDS = [PromptRecord(f"r{i}", f"Q{i}=", "arithmetic", "408") for i in range(2)]


class LockedEngine:
    """The LocalEngine driven by one client from several threads, one generate call at a time."""

    client_rank = 0
    concurrent_generate = True
    holds_own_weights = False
    weight_version = 0

    def __init__(self, engine):
        self.engine, self.lock = engine, threading.Lock()

    def generate(self, prompts, n, params):
        with self.lock:
            return self.engine.generate(prompts, n, params)


class SleepTool:
    """A tool that sleeps: `slow` seconds on its first call, `fast` on the others; records the
    (start, end) of every call."""

    def __init__(self, slow: float, fast: float):
        self.slow, self.fast, self.calls = slow, fast, []
        self.lock = threading.Lock()

    def __call__(self) -> str:
        with self.lock:
            seconds = self.slow if not self.calls else self.fast
            self.calls.append(None)
            i = len(self.calls) - 1
        start = time.monotonic()
        time.sleep(seconds)
        self.calls[i] = (start, time.monotonic())
        return "slept"

    def registry(self) -> ToolRegistry:
        return ToolRegistry([Tool("sleep", "sleeps", {"type": "object", "properties": {}}, self)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory, dist_env):
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.rollout.local import LocalEngine

    path = make_tool_caller_model(str(tmp_path_factory.mktemp("caller")), "sleep")
    policy = Policy(ModelArgs.from_pretrained(path), trainable=True)
    policy.load_hf(path)
    codec = Codec.from_tokenizer(load_tokenizer(path), chat_template=False)
    with RewardScorer(num_workers=1) as scorer:
        yield LocalEngine(policy), codec, scorer


def _run(setup, engine, tool, *, concurrency=64, temperature=1.0, seed=11, max_turns=3):
    _, codec, scorer = setup
    config = AgentConfig(agent_tools=[], agent_max_turns=max_turns,
                         agent_concurrency=concurrency, agent_tool_workers=8)
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=seed,
                            stop_token_ids=codec.stop_ids)
    ctx = RolloutContext(engine, params, 2, codec, scorer, agent=config)
    return agent_rollout(ctx, RECORDS, tool.registry())


def _episodes(groups):
    """Everything of each trajectory but the wall-clock counts, in order."""
    out = []
    for g in groups:
        for t in g:
            counts = {k: v for k, v in t.metadata["counts"].items() if k != "agent/tool_seconds"}
            out.append((t.prompt_ids, t.response_ids, t.response_mask, t.finish_reason,
                        t.reward, t.metadata["end"], counts))
    return out


def _started_during(calls, interval):
    return sum(1 for s, _ in calls if interval[0] < s < interval[1])


def test_concurrent_episodes_overlap_their_tool_waits_and_give_the_same_trajectories(setup):
    """4 episodes (2 prompts x 2) of 3 turns, 2 tool calls each, the first call 1.5 s and the
    others 0.3 s. Turn-synchronous (the local engine): no episode's second call starts before
    the slow first call has returned, so at most the 3 other first calls start during it. With
    the engine's concurrent generate, the other episodes take their next turn meanwhile: their
    second calls start during it too. The episodes are the same (the policy is near
    deterministic), in record and group order."""
    local = setup[0]
    sync_tool, conc_tool = SleepTool(1.5, 0.3), SleepTool(1.5, 0.3)
    sync = _run(setup, local, sync_tool)
    conc = _run(setup, LockedEngine(local), conc_tool)
    for tool in (sync_tool, conc_tool):
        assert len(tool.calls) == 8 and None not in tool.calls  # 4 episodes x turns 0 and 1
    assert _started_during(sync_tool.calls, sync_tool.calls[0]) <= 3
    assert _started_during(conc_tool.calls, conc_tool.calls[0]) >= 5
    assert _episodes(conc) == _episodes(sync)
    codec = setup[1]
    assert [[t.prompt_ids for t in g] for g in conc] == [[codec.encode(r.text)] * 2
                                                         for r in RECORDS]
    t = conc[0][0]
    assert t.metadata["end"] == "max_turns" and t.metadata["counts"]["agent/tool_calls"] == 2
    for a, b in zip((t for g in conc for t in g), (t for g in sync for t in g)):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs),
                              atol=1e-5)


def test_concurrent_episodes_are_the_same_at_a_fixed_seed_whatever_the_thread_order(setup):
    """At temperature 3 the policy leaves its rule often, so the episodes differ by seed; each
    request's seed is the episode's own, so one episode at a time and 8 at once give the same
    episodes, token for token and log-prob for log-prob, and another seed others."""
    engine = LockedEngine(setup[0])
    runs = [_run(setup, engine, SleepTool(0.0, 0.0), concurrency=c, temperature=3.0, seed=s,
                 max_turns=4) for c, s in ((1, 3), (8, 3), (8, 4))]
    one, many, other = runs
    assert _episodes(one) == _episodes(many)
    assert [t.rollout_logprobs for g in one for t in g] == [t.rollout_logprobs for g in many
                                                             for t in g]
    assert _episodes(other) != _episodes(one)
    ends = {t.metadata["end"] for run in runs for g in run for t in g}
    assert len(ends) > 1, ends  # the seed changes which episodes call tools and which answer


def test_concurrency_must_be_positive():
    from megatron_rl.config import parse_config

    base = ["--hf-checkpoint", "m", "--train-data", "d.jsonl", "--rollout-function", "agent"]
    assert parse_config(base).agent.agent_concurrency == 64
    assert parse_config(base + ["--agent-concurrency", "4"]).agent.agent_concurrency == 4
    with pytest.raises(ValueError, match="--agent-concurrency"):
        parse_config(base + ["--agent-concurrency", "0"])

