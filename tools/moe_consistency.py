#!/usr/bin/env python
"""Train/inference consistency of a tiny mixture-of-experts policy under RL: routing replay and
rollout correction, on- and one-step off-policy.

The policy is a tiny random Qwen3-MoE (character tokenizer, 4 experts, top-2; see
megatron_rl/experiments/tiny_model.py) given the CPU demo's supervised warm-up on two-term
arithmetic, so that RL sees non-zero rewards. From that base model the script runs, one after
the other, the matrix

    routing replay (--routing-replay)           off / on
    rollout correction (--rollout-correction)   none / tis
    staleness (--async-level)                   0 (on-policy) / 1 (one step off-policy)

for each seed, every run with the process engine (a child process with its own weights, synced
after every step). The behaviour log-probs are the trainer's recompute (--old-logprobs
recompute), so that mismatch/* compares the engine's log-probs with it (the recompute replays
the engine's routes under --routing-replay), except off-policy without a correction: there the
trainer refuses a recompute (the generating weights are gone, and nothing would weigh the
samples against the current ones), so those runs take the engine's log-probs (--old-logprobs
rollout) and log no mismatch/*; their PPO ratio pi/mu on the one update per step shows the
engine-to-trainer gap instead (ratio_mean, clip_fraction).

It then reads each run's metrics.jsonl and prints markdown tables of means +- standard
deviations over the seeds (also written to <out>/table.md):

- mismatch: mismatch/abs_delta_mean and mismatch/abs_delta_max, averaged over the steps and at
  the last step;
- kl_k1 (KL to the reference, the initial policy) and reward/mean, averaged over the steps and
  at the last step;
- routing/differ_tokens (replaying runs that recompute): the share of rollout tokens whose
  experts the trainer's routers would have chosen differently from the engine, averaged over
  the steps and its largest step;
- stability: the largest grad_norm_max of a run, the skipped updates, non-finite values logged;
- the PPO ratio's clip_fraction and ratio_mean, averaged over the steps;
- the correction's rollout_corr/is_mean and changed_fraction (averaged over the steps) and
  is_max / is_min (extremes over the steps) where --rollout-correction is on;
- routing replay's own effect, paired by seed: the tis runs with and without replay sample the
  same batches until rounding differences first change a sampled token, so over those steps
  the ratio of their mismatch isolates what replay changes.

A run whose metrics.jsonl already holds --steps rows is not run again (--fresh re-runs them);
the base model is cached in <out>/base.

    OMP_NUM_THREADS=1 python tools/moe_consistency.py [--out outputs/moe_consistency]
        [--steps 100] [--seeds 1 2 3] [--model HF_DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The bare problem, then "=" and the number: what the character-level model is warmed up on.
PROMPT_TEMPLATE = "{prompt}="
# (name, --routing-replay, --rollout-correction, --async-level), the table's row order
CONFIGS = [(f"{'R3' if replay else 'noR3'}_{corr}_async{level}", replay, corr, level)
           for level in (0, 1) for replay in (False, True) for corr in ("none", "tis")]


def prepare_data(out: Path, train_size: int) -> Path:
    """Two-term arithmetic (up to two digits, + and -) from reasoning-gym, as the CPU demo's."""
    from megatron_rl.data.records import write_jsonl
    from megatron_rl.data.sources import generate_arithmetic

    path = out / "data" / "train.jsonl"
    if not path.exists():
        easy = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                    allow_parentheses=False, allow_negation=False, whitespace="no_space")
        write_jsonl(str(path), generate_arithmetic(train_size, 0, **easy))
    return path


def build_base_model(out: Path, train_path: Path, sft_steps: int, sft_lr: float) -> Path:
    """The tiny random Qwen3-MoE, supervised warm-up on (prompt, answer + eos), exported as HF to
    <out>/base (reused when present)."""
    base = out / "base"
    if (base / "model.safetensors").exists():
        print(f"[base] reusing {base}", flush=True)
        return base
    from megatron_rl.data.prompts import PromptBuilder, load_tokenizer
    from megatron_rl.data.records import read_examples
    from megatron_rl.experiments.sft import sft
    from megatron_rl.experiments.tiny_model import make_char_model
    from megatron_rl.models import ModelArgs, hf_mapping
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init = str(out / "init")
    make_char_model(init, seed=0, family="qwen3_moe")
    init_distributed(ParallelConfig(1, 1), seed=0)
    args = ModelArgs.from_pretrained(init)
    policy = Policy(args, trainable=True, optim=OptimConfig(lr=sft_lr, clip_grad=1.0))
    policy.load_hf(init)
    tok = load_tokenizer(init)
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    pairs = [(tok(builder(ex))["input_ids"], tok(ex.answer)["input_ids"] + [tok.eos_token_id])
             for ex in read_examples(str(train_path))]
    t0 = time.time()
    losses = sft(policy, pairs, steps=sft_steps, batch_size=64, micro_batch_size=64,
                 progress=False)
    print(f"[base] supervised warm-up: {sft_steps} steps in {time.time() - t0:.0f} s, "
          f"answer NLL {losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
    full = policy.full_state_dict(dst=0)
    tok_files = [os.path.join(init, f) for f in os.listdir(init)
                 if f.startswith(("tokenizer", "special"))]
    hf_mapping.save_hf_checkpoint(hf_mapping.megatron_to_hf(full, args), args, str(base),
                                  extra_files=tuple(tok_files))
    return base


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def old_logprobs(corr: str, level: int) -> str:
    """The trainer's recompute, unless off-policy without a correction (see the docstring)."""
    return "rollout" if level >= 1 and corr == "none" else "recompute"


def run_one(a, model: Path, data: Path, run_dir: Path, replay: bool, corr: str, level: int,
            seed: int) -> tuple[bool, float]:
    """One RL run in a child process (its log in <run_dir>/train.log). Returns (ok, seconds)."""
    if a.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    if len(read_rows(run_dir)) >= a.steps:
        return True, 0.0
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(model),
           "--train-data", str(data), "--train-iters", str(a.steps),
           "--num-prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--lr", str(a.lr),
           "--micro-batch-size", str(a.prompts_per_step * a.group_size),
           "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction", "--seed", str(seed),
           "--rollout-engine", "process", "--old-logprobs", old_logprobs(corr, level),
           "--async-level", str(level), "--rollout-correction", corr,
           "--routing-replay" if replay else "--no-routing-replay", "--save", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.time()
    with open(run_dir / "train.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return rc == 0 and len(read_rows(run_dir)) >= a.steps, time.time() - t0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarise(rows: list[dict]) -> dict[str, float]:
    """One run's numbers: means over the steps, last-step values, stability counts."""
    def mean_of(key):
        vals = [r[key] for r in rows if _finite(r.get(key))]
        return sum(vals) / len(vals) if vals else float("nan")

    last = rows[-1]
    nonfinite = sum(1 for r in rows for v in r.values()
                    if isinstance(v, float) and not math.isfinite(v))
    out = {
        "delta_mean": mean_of("mismatch/abs_delta_mean"),
        "delta_mean_last": last.get("mismatch/abs_delta_mean", float("nan")),
        "delta_max": mean_of("mismatch/abs_delta_max"),
        "delta_max_last": last.get("mismatch/abs_delta_max", float("nan")),
        "kl_k1": mean_of("kl_k1"),
        "kl_k1_last": last.get("kl_k1", float("nan")),
        "reward": mean_of("reward/mean"),
        "reward_last": last.get("reward/mean", float("nan")),
        "grad_norm_max": max((r.get("grad_norm_max", r.get("grad_norm", float("nan")))
                              for r in rows), default=float("nan")),
        "skipped": sum(r.get("skipped_update", 0.0) for r in rows),
        "nonfinite": float(nonfinite),
        "clip_fraction": mean_of("clip_fraction"),
        "ratio_mean": mean_of("ratio_mean"),
    }
    if any("routing/differ_tokens" in r for r in rows):  # replaying runs with a recompute
        out["routing_differ"] = mean_of("routing/differ_tokens")
        out["routing_differ_max"] = max(r.get("routing/differ_tokens", float("nan"))
                                         for r in rows)
    if any("rollout_corr/is_mean" in r for r in rows):
        out["is_mean"] = mean_of("rollout_corr/is_mean")
        out["is_max"] = max(r.get("rollout_corr/is_max", float("nan")) for r in rows)
        out["is_min"] = min(r.get("rollout_corr/is_min", float("nan")) for r in rows)
        out["changed"] = mean_of("rollout_corr/changed_fraction")
    return out


def fmt(vals: list[float], spec: str) -> str:
    """mean +- standard deviation over seeds (just the value for one seed)."""
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return format(vals[0], spec)
    return f"{format(statistics.mean(vals), spec)} ± {format(statistics.stdev(vals), spec)}"


MISMATCH_COLS = [("delta_mean", "\\|Δ\\| mean", ".1e"),
                 ("delta_mean_last", "\\|Δ\\| mean, last", ".1e"),
                 ("delta_max", "\\|Δ\\| max", ".1e"), ("delta_max_last", "\\|Δ\\| max, last", ".1e"),
                 ("kl_k1", "kl_k1", ".4f"), ("kl_k1_last", "kl_k1, last", ".4f"),
                 ("reward", "reward", ".3f"), ("reward_last", "reward, last", ".3f"),
                 ("routing_differ", "tokens routed elsewhere", ".2e"),
                 ("routing_differ_max", "routed elsewhere, max", ".2e")]
STABILITY_COLS = [("grad_norm_max", "max grad norm", ".2f"), ("skipped", "skipped", ".0f"),
                  ("nonfinite", "non-finite", ".0f"), ("clip_fraction", "clip fraction", ".4f"),
                  ("ratio_mean", "ratio mean", ".4f"), ("is_mean", "IS mean", ".4f"),
                  ("is_max", "IS max", ".2f"), ("is_min", "IS min", ".3f"),
                  ("changed", "truncated", ".4f")]


def table(results: dict[str, list[dict[str, float]]], cols) -> str:
    """A markdown table: one row per configuration, each cell mean ± std over its seeds."""
    lines = ["| run | old log-probs | seeds | " + " | ".join(h for _, h, _ in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for (name, _, corr, level), runs in results.items():
        cells = [fmt([r.get(k, float("nan")) for r in runs], spec) for k, _, spec in cols]
        lines.append(f"| {name} | {old_logprobs(corr, level)} | {len(runs)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_replay(out: Path, seeds: list[int]) -> str:
    """Routing replay's own effect, seed by seed: with --rollout-correction tis, the runs with and
    without --routing-replay sample the same batches until their weights' rounding differences
    first change a sampled token. Over those common steps (same reward/mean,
    response/length_mean and mismatch/num_tokens), the ratio of the replayed run's
    mismatch/abs_delta_mean to the other's, and how many steps it moves by more than 5%."""
    lines = ["| --async-level | seed | common steps | steps moved > 5% | "
             "R3 / noR3 \\|Δ\\| mean (mean over steps) | min | max |", "|---|---|---|---|---|---|---|"]
    keys = ("reward/mean", "response/length_mean", "mismatch/num_tokens")
    for level in (0, 1):
        for seed in seeds:
            a = read_rows(out / "runs" / f"noR3_tis_async{level}_s{seed}")
            b = read_rows(out / "runs" / f"R3_tis_async{level}_s{seed}")
            common = 0
            for ra, rb in zip(a, b):
                if any(ra.get(k) != rb.get(k) for k in keys):
                    break
                common += 1
            ratios = [rb["mismatch/abs_delta_mean"] / ra["mismatch/abs_delta_mean"]
                      for ra, rb in zip(a[:common], b[:common])
                      if _finite(ra.get("mismatch/abs_delta_mean"))
                      and _finite(rb.get("mismatch/abs_delta_mean"))
                      and ra["mismatch/abs_delta_mean"] > 0]
            if not ratios:
                continue
            moved = sum(abs(r - 1.0) > 0.05 for r in ratios)
            lines.append(f"| {level} | {seed} | {common} | {moved} | "
                         f"{statistics.mean(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/moe_consistency",
                   help="work directory: data, base model, one run directory per configuration "
                        "and seed, table.md")
    p.add_argument("--model", default=None,
                   help="HF directory of a mixture-of-experts base model to start RL from; unset: "
                        "build and warm up the tiny Qwen3-MoE in <out>/base")
    p.add_argument("--steps", type=int, default=100, help="RL steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of each configuration")
    p.add_argument("--sft-steps", type=int, default=1500, help="supervised warm-up steps (batch 64)")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="learning rate of the warm-up")
    p.add_argument("--train-size", type=int, default=20000, help="arithmetic problems generated")
    p.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per RL step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=6, help="tokens per response at most")
    p.add_argument("--fresh", action="store_true", help="re-run runs that are already complete")
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: tabulate the run directories already in --out")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if not a.table_only:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        data = prepare_data(out, a.train_size)
        model = Path(a.model).resolve() if a.model else build_base_model(out, data, a.sft_steps,
                                                                          a.sft_lr)
        total = len(CONFIGS) * len(a.seeds)
        i = 0
        for seed in a.seeds:
            for name, replay, corr, level in CONFIGS:
                i += 1
                run_dir = out / "runs" / f"{name}_s{seed}"
                ok, secs = run_one(a, model, data, run_dir, replay, corr, level, seed)
                rows = read_rows(run_dir)
                last = rows[-1] if rows else {}
                print(f"[{i}/{total}] {name} seed {seed}: {'ok' if ok else 'FAILED'} "
                      f"{secs:.0f} s, reward {last.get('reward/mean', float('nan')):.3f}, "
                      f"|delta| mean {last.get('mismatch/abs_delta_mean', float('nan')):.1e}"
                      + ("" if ok else f" (see {run_dir / 'train.log'})"), flush=True)
    results: dict[tuple, list[dict[str, float]]] = {}
    for config in CONFIGS:
        for seed in a.seeds:
            rows = read_rows(out / "runs" / f"{config[0]}_s{seed}")
            if rows:
                results.setdefault(config, []).append(summarise(rows))
    md = (f"Mismatch, KL and reward (mean over the {a.steps} steps, and at the last step):\n\n"
          + table(results, MISMATCH_COLS)
          + "\n\nStability, PPO ratio and rollout correction (a run's largest grad norm, its "
             "counts of skipped updates and non-finite values, the extremes of the IS weights "
             "over its steps, the rest means over its steps):\n\n"
          + table(results, STABILITY_COLS)
          + "\n\nRouting replay, paired by seed (tis runs, the steps before their batches "
            "differ):\n\n" + paired_replay(out, a.seeds))
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"\ntotal time {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
