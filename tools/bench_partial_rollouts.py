#!/usr/bin/env python
"""--partial-rollouts against waiting for the batch in flight under --async-level 1, on a tiny
model with long-tailed response lengths: the process engine (--engine process) or a vLLM CPU
server (--engine vllm).

The model is the CPU demo's tiny character-level Qwen2 with the (tied) embedding row of EOS set
to zero (tools/bench_vs_trl.py --long-tail): EOS comes with probability ~1/128 per token, so the
response lengths are geometric, cut at --max-new-tokens (most responses stop early, a few run to
the limit and hold the batch). A random model earns no reward, so the update is the K3 KL
to another random model of the same shape in the loss (coefficient 1, lr 1e-2: the weights move
every step, and the engine's samples lag them). Both runs train the same model on the same
prompts with the same seed, the trainer and the engine (the child process, or the vLLM server
and its engine core) on one core each, `--old-logprobs recompute --rollout-correction tis` so
that the trainer recomputes the behaviour log-probs and logs their mismatch against the
engine's (mismatch/*: the engine's samples against the policy trained at the step). Runs
alternate (off, on, off, on ...) so a slow phase of a shared machine hits both.

Per run, the warm-up steps excluded, medians over steps of:
    time/step, time/rollout (the trainer waiting for its batch), time/rollout_wait (waiting for
    the batches ahead before the weight update: 0 with the flag), time/weight_sync;
    engine idle: the share of the run's wall time the engine was not generating (the process
    engine: 1 - rollout/generate_seconds / the sum of time/step; the vLLM server: the share of
    its /metrics samples, taken every 50 ms, with no request running);
    mismatch/abs_delta_mean and mismatch/seq_weight_std (the sequence IS weight's spread);
and, with the flag, the staleness distribution: the share of the policy tokens lagging 0 and 1
updates (rollout/token_lag_<j>), versions per sample, responses interrupted per step.

    python tools/bench_partial_rollouts.py --out /tmp/bench_partial --json \\
        benchmarks/partial_rollouts_cpu.json
    python tools/bench_partial_rollouts.py --engine vllm --out /tmp/bench_partial_vllm \\
        --json benchmarks/partial_rollouts_vllm_cpu.json

The vLLM variant starts one server (.venv-vllm) on core 1 for all runs and serves each run's
initial weights again before it starts (--rollout-url; the trainer syncs from disk).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))


# vLLM's CPU attention takes no head size of 16 (the demo model's): the server variant's model is
# twice as wide (head size 32)
VLLM_SHAPE = dict(hidden_size=128, intermediate_size=256)


def make_inputs(work: str, shape: dict) -> tuple[str, str, str]:
    """(model dir, reference dir, train JSONL): the long-tailed tiny model (the demo's, or of
    `shape`), another of its shape, and two-term sums."""
    from bench_vs_trl import builtin_arithmetic, zero_eos_embedding

    from megatron_rl.data.records import write_jsonl
    from megatron_rl.experiments.tiny_model import make_char_model

    tag = "".join(f"_{k}{v}" for k, v in sorted(shape.items()))
    dirs = [os.path.join(work, name + tag) for name in ("model", "ref")]
    for seed, path in enumerate(dirs):
        if not os.path.exists(os.path.join(path, "config.json")):
            make_char_model(path, seed=seed, max_position_embeddings=512, **shape)
            zero_eos_embedding(path)
    train = os.path.join(work, "train.jsonl")
    write_jsonl(train, builtin_arithmetic(2000, 0))
    return dirs[0], dirs[1], train


class VLLMServer:
    """The vLLM variant's server, on core 1, and its idle share while a run trains."""

    def __init__(self, model: str, work: str, max_model_len: int):
        from megatron_rl.rollout.interrupt import STREAM_INTERVAL
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {1})  # the server and the engine core it spawns inherit it
        try:
            self.model = model
            self.engine = VLLMEngine(model, VLLMConfig(
                work_dir=os.path.join(work, "vllm"), dtype="float32",
                max_model_len=max_model_len, kv_cache_memory_bytes=512 << 20,
                # as the trainer launches a server under --partial-rollouts
                extra_args=("--stream-interval", str(STREAM_INTERVAL))))
        finally:
            os.sched_setaffinity(0, mine)
        self.url = self.engine.url

    def reset(self) -> None:
        """Serve the initial weights again (each run starts from them)."""
        self.engine.load_weights_from_path(self.model, 0)

    def sample_idle(self, stop: threading.Event, out: list[float]) -> None:
        """Until `stop`: every 50 ms, 1.0 when no request runs on the server, else 0.0."""
        from megatron_rl.rollout.net import http_json

        while not stop.wait(0.05):
            text = http_json("GET", self.url + "/metrics", timeout=30)
            running = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("vllm:num_requests_running"))
            out.append(float(running == 0))

    def close(self) -> None:
        self.engine.shutdown()


def run(a, model: str, ref: str, train: str, save: str, partial: bool,
        server: VLLMServer | None = None) -> list[dict]:
    """One training run's metrics rows (with `server`: on it, "engine_idle" added to the last
    row)."""
    args = ["--hf-checkpoint", model, "--ref-checkpoint", ref, "--kl-placement", "loss",
            "--kl-estimator", "k3", "--kl-coef", "1.0", "--train-data", train, "--save", save,
            "--train-iters", str(a.steps), "--num-prompts-per-step", str(a.prompts),
            "--group-size", str(a.group_size), "--max-new-tokens", str(a.max_new_tokens),
            "--prompt-template", "{prompt}=", "--no-task-instruction", "--seed", "3",
            "--lr", "1e-2", "--async-level", "1", "--old-logprobs", "recompute",
            "--rollout-correction", "tis", "--save-interval", "0"]
    if server is None:
        args += ["--rollout-engine", "process", "--rollout-process-cores", "1"]
    else:
        server.reset()
        args += ["--rollout-engine", "vllm", "--rollout-url", server.url]
    if partial:
        args.append("--partial-rollouts")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    stop, idle = threading.Event(), []
    sampler = None
    if server is not None:
        sampler = threading.Thread(target=server.sample_idle, args=(stop, idle), daemon=True)
        sampler.start()
    try:
        proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "megatron_rl.train",
                               *args], env=env, capture_output=True, text=True, timeout=1800)
    finally:
        stop.set()
        if sampler is not None:
            sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if idle:
        rows[-1]["engine_idle"] = statistics.mean(idle)
    return rows


def summarize(rows: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup` (module docstring)."""
    timed = rows[warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    # the child's generating time against the wall time, over the whole run (its counter is
    # read when a batch is handed over, so per-step differences mix phases)
    out = {k: med(k) for k in ("time/step", "time/rollout", "time/rollout_wait",
                               "time/weight_sync", "mismatch/abs_delta_mean",
                               "mismatch/seq_weight_std", "response/length_mean")}
    if "engine_idle" in rows[-1]:  # sampled on the server
        out["engine_idle"] = rows[-1]["engine_idle"]
    else:
        busy = rows[-1]["rollout/generate_seconds"] / sum(r["time/step"] for r in rows)
        out["engine_idle"] = 1 - busy
    if "rollout/versions_per_sample" in timed[0]:
        lags = sorted({k for r in timed for k in r if k.startswith("rollout/token_lag_")})
        out.update({k: statistics.mean(r.get(k, 0.0) for r in timed) for k in lags})
        out["rollout/versions_per_sample"] = med("rollout/versions_per_sample")
        ints = [b["rollout/interrupted_responses"] - a["rollout/interrupted_responses"]
                for a, b in zip(rows[warmup - 1:], rows[warmup:])]
        out["interrupted_per_step"] = statistics.mean(ints)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/bench_partial_rollouts", help="work directory")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length limit")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    p.add_argument("--engine", choices=("process", "vllm"), default="process",
                   help="the rollout engine: the process engine, or one vLLM CPU server")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model, ref, train = make_inputs(a.out, VLLM_SHAPE if a.engine == "vllm" else {})
    results: dict[str, list[dict]] = {"off": [], "on": []}
    t0 = time.time()
    server = VLLMServer(model, a.out, 64 + a.max_new_tokens) if a.engine == "vllm" else None
    try:
        for i in range(a.rounds):
            for side in ("off", "on"):
                save = os.path.join(a.out, f"{side}{i}")
                subprocess.run(["rm", "-rf", save], check=True)
                rows = run(a, model, ref, train, save, side == "on", server)
                results[side].append(summarize(rows, a.warmup))
                print(side, i, json.dumps(results[side][-1]), flush=True)
    finally:
        if server is not None:
            server.close()
    summary = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for side, rs in results.items()}
    summary["ratio_on_over_off"] = {k: summary["on"][k] / summary["off"][k]
                                    for k in summary["off"] if summary["off"][k]}
    # the same ratios round by round (a round's two runs are adjacent in time)
    summary["step_time_ratio_by_round"] = [on["time/step"] / off["time/step"]
                                           for off, on in zip(results["off"], results["on"])]
    summary["runs"] = results
    from bench_lm_head import cpu_model

    summary["setup"] = {"machine": cpu_model(), "load_average": os.getloadavg()[0],
                        "cpus": os.cpu_count(), "wall_s": round(time.time() - t0),
                        **{k: getattr(a, k) for k in ("engine", "steps", "warmup", "prompts",
                                                       "group_size", "max_new_tokens",
                                                       "rounds")}}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
