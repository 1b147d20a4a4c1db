#!/usr/bin/env python
"""Multi-turn agent rollout with a slow tool: how much the schedules overlap, and what
re-prefilling each turn's context costs (docs/agent.md).

The policy is make_tool_caller_model's tiny model (megatron_rl/experiments/tiny_model.py): it
calls the "sleep" tool at every turn (3 tokens a turn), so each episode is --turns policy turns
with a tool call after all but the last, and the tool sleeps --tool-seconds. The rollout is
the real agent loop (agent.loop.agent_rollout) on the real engine.

Schedules, each over the same --prompts x --group-size episodes:
    one at a time    each episode alone (one record, group size 1), one after another: the
                     baseline, with nothing overlapped
    turn-synchronous every running episode's turn in one generate call, then the turn's tool
                     calls at once (the schedule of the in-process and process engines)
    concurrent       each episode on its own thread (--agent-concurrency), generating while the
                     others wait for their tools (the schedule of vLLM, SGLang, a server pool);
                     on the local engine its generate calls are serialised by a lock, so that
                     the schedule can be measured without a server
Reported (the fastest of --rounds runs of each): wall seconds, speed-up over one at a time,
and the overlap, the mean wall time of
one episode alone over the schedule's wall time for all (1.0: N episodes take as long as one;
the ideal).

Re-prefill: every turn after the first sends the episode's whole context again. From the
concurrent run's trajectories: context tokens sent per turn against the new tokens since the
episode's previous turn. Timed: one generate call (3 new tokens) on a context of each of
--prefill-lengths tokens, a fresh context each time and the same context again; the local
engine keeps no cache across calls (both cost a full prefill), a server with prefix caching
finds a repeated context's KV (vLLM: its /metrics prefix-cache counters are reported).

    python tools/bench_agent.py --json benchmarks/agent_schedule_cpu.json            # local
    python tools/bench_agent.py --engine vllm --json out.json    # launches vLLM (.venv-vllm)
    python tools/bench_agent.py --engine vllm --url http://host:8000 --work DIR   # attached:
        # the server must serve DIR/model (written by a first run), see VLLMConfig for its flags
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class Scheduled:
    """`engine` with the schedule the agent loop picks forced: concurrent (generate calls from
    several threads; serialised by a lock where the engine does not take them) or
    turn-synchronous."""

    def __init__(self, engine, concurrent: bool):
        self.engine, self.concurrent_generate = engine, concurrent
        self.client_rank = 0 if concurrent else engine.client_rank
        self.weight_version, self.holds_own_weights = 0, engine.holds_own_weights
        self.lock = None if engine.concurrent_generate else threading.Lock()

    def generate(self, prompts, n, params):
        if self.lock is None:
            return self.engine.generate(prompts, n, params)
        with self.lock:
            return self.engine.generate(prompts, n, params)


class SleepTool:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self) -> str:
        time.sleep(self.seconds)
        return "slept"


def rollout(engine, codec, scorer, records, group_size: int, a, registry, concurrency: int):
    from megatron_rl.agent.loop import agent_rollout
    from megatron_rl.agent.settings import AgentConfig
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.functions import RolloutContext

    config = AgentConfig(agent_tools=[], agent_max_turns=a.turns, agent_max_tokens=1000,
                         agent_concurrency=concurrency, agent_tool_workers=64)
    params = SamplingParams(max_new_tokens=8, seed=a.seed, stop_token_ids=codec.stop_ids)
    ctx = RolloutContext(engine, params, group_size, codec, scorer, agent=config)  # type: ignore
    t0 = time.perf_counter()
    groups = agent_rollout(ctx, records, registry)
    return groups, time.perf_counter() - t0


def turn_tokens(groups) -> tuple[list[int], list[int]]:
    """For every turn after an episode's first: the context it was generated from (tokens) and
    the tokens new since the episode's previous turn (that turn's and the tool responses)."""
    contexts, new = [], []
    for g in groups:
        for t in g:
            starts = [i for i, m in enumerate(t.response_mask)
                      if m == 1 and (i == 0 or t.response_mask[i - 1] == 0)]
            for prev, s in zip(starts, starts[1:]):
                contexts.append(len(t.prompt_ids) + s)
                new.append(s - prev)
    return contexts, new


def prefix_cache_counters(url: str | None) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens queried, tokens hit) from its /metrics."""
    if url is None:
        return {}
    from megatron_rl.rollout.net import http_json

    text = http_json("GET", url + "/metrics", timeout=30)
    out: dict[str, float] = {}
    for line in str(text).splitlines():
        for key in ("prefix_cache_queries", "prefix_cache_hits"):
            name = line.split("{")[0].split(" ")[0]
            if not line.startswith("#") and name.endswith((key, key + "_total")):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def prefill_times(engine, codec, lengths, repeats: int) -> list[dict]:
    """Seconds of one generate call (3 new tokens) on a fresh context of each length, and on
    the same context again right after."""
    from megatron_rl.rollout.base import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=3, seed=0, stop_token_ids=codec.stop_ids)
    chars = [codec.encode(c)[0] for c in "abcdefghijklmnopqrstuvwxyz"]
    end = codec.encode("=")
    rows = []
    for n in lengths:
        fresh, again = [], []
        for _ in range(repeats):
            ctx = [rng.choice(chars) for _ in range(n - 1)] + end
            t = time.perf_counter()
            engine.generate([ctx], 1, params)
            fresh.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.generate([ctx], 1, params)
            again.append(time.perf_counter() - t)
        rows.append({"context_tokens": n, "fresh_s": statistics.median(fresh),
                     "again_s": statistics.median(again)})
    return rows


def make_engine(a, model: str, work: str):
    """The engine, and its server's URL (None for the local engine)."""
    if a.engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        engine = VLLMEngine(model, VLLMConfig(work_dir=work, dtype="float32", url=a.url,
                                              kv_cache_memory_bytes=1 << 30, max_model_len=1024))
        return engine, engine.url
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed
    from megatron_rl.rollout.local import LocalEngine

    init_distributed(ParallelConfig())
    policy = Policy(ModelArgs.from_pretrained(model), trainable=False)
    policy.load_hf(model)
    return LocalEngine(policy), None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("local", "vllm"), default="local")
    p.add_argument("--url", help="--engine vllm: attach to this server (serving <work>/model)")
    p.add_argument("--work", help="where the model is written (default: a temporary directory)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--turns", type=int, default=3, help="policy turns per episode (a tool call "
                   "after each but the last)")
    p.add_argument("--tool-seconds", type=float, default=0.5)
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=[64, 128, 256, 512, 960])
    p.add_argument("--repeats", type=int, default=3, help="timed calls per prefill length")
    p.add_argument("--rounds", type=int, default=2, help="runs of every schedule (the "
                   "fastest counts: the machine may be shared)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()

    import torch

    from megatron_rl.agent.tools import Tool, ToolRegistry
    from megatron_rl.data.prompts import PromptRecord, load_tokenizer
    from megatron_rl.experiments.tiny_model import make_tool_caller_model
    from megatron_rl.rewards import RewardScorer
    from megatron_rl.data.prompts import Codec

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = a.work or tempfile.mkdtemp(prefix="bench_agent_")
    model = os.path.join(work, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_tool_caller_model(model, "sleep", max_position_embeddings=1024)
    codec = Codec.from_tokenizer(load_tokenizer(model), chat_template=False)
    engine, url = make_engine(a, model, os.path.join(work, a.engine))
    registry = ToolRegistry([Tool("sleep", "sleeps", {"type": "object", "properties": {}},
                                  SleepTool(a.tool_seconds))])
    records = [PromptRecord(f"r{i}", f"Q{i}=", "arithmetic", "0") for i in range(a.prompts)]
    n = a.prompts * a.group_size
    out: dict = {"engine": a.engine, "episodes": n, "prompts": a.prompts,
                 "group_size": a.group_size, "turns": a.turns, "tool_seconds": a.tool_seconds,
                 "tool_calls_per_episode": a.turns - 1, "cpu": platform.processor(),
                 "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                 "load_average": os.getloadavg()[0],
                 "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        with RewardScorer(num_workers=1) as scorer:
            rollout(engine, codec, scorer, records[:1], 1, a, registry, 1)  # warm-up
            seconds: dict[str, list[float]] = {}
            alone_means, before, after, groups = [], {}, {}, None
            for _ in range(a.rounds):  # each schedule once per round; the fastest round counts
                alone = []
                for r in records:
                    for _ in range(a.group_size):
                        alone.append(rollout(Scheduled(engine, False), codec, scorer, [r], 1,
                                             a, registry, 1)[1])
                alone_means.append(statistics.mean(alone))
                seconds.setdefault("one at a time", []).append(sum(alone))
                before = before or prefix_cache_counters(url)
                for name, concurrent in (("turn-synchronous", False), ("concurrent", True)):
                    groups, sec = rollout(Scheduled(engine, concurrent), codec, scorer, records,
                                          a.group_size, a, registry, n)
                    seconds.setdefault(name, []).append(sec)
                after = prefix_cache_counters(url)
            episode = min(alone_means)
            rows = [{"schedule": k, "seconds": min(v), "rounds_s": v} for k, v in seconds.items()]
            for r in rows:
                r["speedup"] = rows[0]["seconds"] / r["seconds"]
                r["overlap"] = episode / r["seconds"]
            out.update(schedules=rows, episode_alone_s=episode,
                       tool_seconds_per_episode=(a.turns - 1) * a.tool_seconds)
            contexts, new = turn_tokens(groups)
            out["reprefill"] = {"turns_after_the_first": len(contexts),
                                "context_tokens_per_turn": statistics.mean(contexts),
                                "new_tokens_per_turn": statistics.mean(new)}
            if before and after:
                q = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
                h = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
                out["reprefill"].update(prefix_cache_queried_tokens=q, prefix_cache_hit_tokens=h,
                                        prefix_cache_hit_rate=h / q if q else None)
            out["prefill"] = prefill_times(engine, codec, a.prefill_lengths, a.repeats)
    finally:
        engine.shutdown()
    base = out["prefill"][0]["fresh_s"]
    for r in out["prefill"]:
        r["fresh_vs_shortest"] = r["fresh_s"] / base
    print(f"{n} episodes x {a.turns} turns, tool {a.tool_seconds} s, {a.engine} engine; one "
          f"episode alone {episode:.2f} s")
    print("| schedule | seconds | speed-up over one at a time | overlap (1.0 ideal) |")
    print("|---|---|---|---|")
    for r in out["schedules"]:
        print(f"| {r['schedule']} | {r['seconds']:.2f} | {r['speedup']:.2f}x | "
              f"{r['overlap']:.2f} |")
    print(f"re-prefill: {out['reprefill']}")
    print("| context tokens | fresh s | again s | fresh / shortest |\n|---|---|---|---|")
    for r in out["prefill"]:
        print(f"| {r['context_tokens']} | {r['fresh_s']:.4f} | {r['again_s']:.4f} | "
              f"{r['fresh_vs_shortest']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
