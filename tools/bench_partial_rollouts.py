#!/usr/bin/env python
"""--partial-rollouts against waiting for the batch in flight: the process engine under
--async-level 1, on a tiny model with long-tailed response lengths.

The model is the CPU demo's tiny character-level Qwen2 with the (tied) embedding row of EOS set
to zero (tools/bench_vs_trl.py --long-tail): EOS comes with probability ~1/128 per token, so the
response lengths are geometric, cut at --max-new-tokens (most responses stop early, a few run to
the limit and hold the batch). A random model earns no reward, so the update is the K3 KL
to another random model of the same shape in the loss (coefficient 1, lr 1e-2: the weights move
every step, and the engine's samples lag them). Both runs train the same model on the same
prompts with the same seed, the trainer and the child on one core each, `--old-logprobs recompute --rollout-correction
tis` so that the trainer recomputes the behaviour log-probs and logs their mismatch against the
engine's (mismatch/*: the engine's samples against the policy trained at the step). Runs
alternate (off, on, off, on ...) so a slow phase of a shared machine hits both.

Per run, the warm-up steps excluded, medians over steps of:
    time/step, time/rollout (the trainer waiting for its batch), time/rollout_wait (waiting for
    the batches ahead before the weight update: 0 with the flag), time/weight_sync;
    engine idle = 1 - rollout/generate_seconds / the sum of time/step, over the whole run (the
    child's share of the wall time not spent generating);
    mismatch/abs_delta_mean and mismatch/seq_weight_std (the sequence IS weight's spread);
and, with the flag, the staleness distribution: the share of the policy tokens lagging 0 and 1
updates (rollout/token_lag_<j>), versions per sample, responses interrupted per step.

    python tools/bench_partial_rollouts.py --out /tmp/bench_partial --json \\
        benchmarks/partial_rollouts_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))


def make_inputs(work: str) -> tuple[str, str, str]:
    """(model dir, reference dir, train JSONL): the long-tailed tiny model, another of its
    shape, and two-term sums."""
    from bench_vs_trl import builtin_arithmetic, zero_eos_embedding

    from megatron_rl.data.records import write_jsonl
    from megatron_rl.experiments.tiny_model import make_char_model

    dirs = [os.path.join(work, name) for name in ("model", "ref")]
    for seed, path in enumerate(dirs):
        if not os.path.exists(os.path.join(path, "config.json")):
            make_char_model(path, seed=seed, max_position_embeddings=512)
            zero_eos_embedding(path)
    train = os.path.join(work, "train.jsonl")
    write_jsonl(train, builtin_arithmetic(2000, 0))
    return dirs[0], dirs[1], train


def run(a, model: str, ref: str, train: str, save: str, partial: bool) -> list[dict]:
    """One training run's metrics rows."""
    args = ["--hf-checkpoint", model, "--ref-checkpoint", ref, "--kl-placement", "loss",
            "--kl-estimator", "k3", "--kl-coef", "1.0", "--train-data", train, "--save", save,
            "--train-iters", str(a.steps), "--num-prompts-per-step", str(a.prompts),
            "--group-size", str(a.group_size), "--max-new-tokens", str(a.max_new_tokens),
            "--prompt-template", "{prompt}=", "--no-task-instruction", "--seed", "3",
            "--lr", "1e-2", "--rollout-engine", "process", "--async-level", "1",
            "--rollout-process-cores", "1", "--old-logprobs", "recompute",
            "--rollout-correction", "tis", "--save-interval", "0"]
    if partial:
        args.append("--partial-rollouts")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "megatron_rl.train",
                           *args], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup` (module docstring)."""
    timed = rows[warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    # the child's generating time against the wall time, over the whole run (its counter is
    # read when a batch is handed over, so per-step differences mix phases)
    busy = rows[-1]["rollout/generate_seconds"] / sum(r["time/step"] for r in rows)
    out = {k: med(k) for k in ("time/step", "time/rollout", "time/rollout_wait",
                               "time/weight_sync", "mismatch/abs_delta_mean",
                               "mismatch/seq_weight_std", "response/length_mean")}
    out["engine_idle"] = 1 - busy
    if "rollout/versions_per_sample" in timed[0]:
        lags = sorted({k for r in timed for k in r if k.startswith("rollout/token_lag_")})
        out.update({k: statistics.mean(r.get(k, 0.0) for r in timed) for k in lags})
        out["rollout/versions_per_sample"] = med("rollout/versions_per_sample")
        ints = [b["rollout/interrupted_responses"] - a["rollout/interrupted_responses"]
                for a, b in zip(rows[warmup - 1:], rows[warmup:])]
        out["interrupted_per_step"] = statistics.mean(ints)
    return out


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


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
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model, ref, train = make_inputs(a.out)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    t0 = time.time()
    for i in range(a.rounds):
        for side in ("off", "on"):
            save = os.path.join(a.out, f"{side}{i}")
            subprocess.run(["rm", "-rf", save], check=True)
            results[side].append(summarize(run(a, model, ref, train, save, side == "on"), a.warmup))
            print(side, i, json.dumps(results[side][-1]), flush=True)
    summary = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for side, rs in results.items()}
    summary["ratio_on_over_off"] = {k: summary["on"][k] / summary["off"][k]
                                    for k in summary["off"] if summary["off"][k]}
    # the same ratios round by round (a round's two runs are adjacent in time)
    summary["step_time_ratio_by_round"] = [on["time/step"] / off["time/step"]
                                           for off, on in zip(results["off"], results["on"])]
    summary["runs"] = results
    summary["setup"] = {"machine": _cpu_name(), "load_average": os.getloadavg()[0],
                        "cpus": os.cpu_count(), "wall_s": round(time.time() - t0),
                        **{k: getattr(a, k) for k in ("steps", "warmup", "prompts",
                                                       "group_size", "max_new_tokens",
                                                       "rounds")}}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
