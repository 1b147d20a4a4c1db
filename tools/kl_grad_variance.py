#!/usr/bin/env python
"""Variance of the KL part of the policy gradient, per KL configuration, at fixed weights.

The reference is the tiny demo's SFT base model (tools/reproduce.py's / tools/cpu_demo.py's,
built when missing). At the base model itself the policy equals the reference and every KL
gradient is exactly zero, so the policy first takes --warmup-steps RL steps of the demo's recipe
(K1 in the reward, beta --warmup-beta; default 40 steps at 0.05, which leaves a KL of about
0.1 nats/token, the regime of the sweep's runs). The weights are then frozen, and the trainer's
own code draws R independent rollout batches of the demo's shape
(32 prompts x 5 samples, `rollout_queue.generate_batch` with a different step seed each), sets the task
rewards to zero, and for every KL configuration runs `update.train_on_batch` (one minibatch,
so on-policy: the behaviour policy is the current one) with the optimizer step replaced by a
capture of the gradient (the DDP `main_grad` buffers, before clipping): the gradient of the KL
regulariser alone, as the production loss computes it (RLOO baseline, loss normalised by the
batch's token count). All configurations see the same batch within a repetition (common random
numbers). Per configuration it reports the norm of the mean gradient, the total variance of one
batch's gradient (trace of the covariance across the R batches), their ratio, the variance
relative to K1 in the reward, and the cosine of the mean gradient with exact reward+loss's mean
(the unbiased target).

    python tools/kl_grad_variance.py [--repeats 32] [--out outputs/kl_grad_variance]

Writes <out>/results.json and <out>/table.md. Run it with OMP_NUM_THREADS=1 on a shared CPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

# name -> (--kl-estimator, --kl-placement); the last one is the unbiased target
KL_CONFIGS: dict[str, tuple[str, str]] = {
    "k1:reward": ("k1", "reward"),
    "k3:loss": ("k3", "loss"),
    "k1:reward+loss": ("k1", "reward+loss"),
    "k3:reward+loss": ("k3", "reward+loss"),
    "exact:reward": ("exact", "reward"),
    "exact:loss": ("exact", "loss"),
    "exact:reward+loss": ("exact", "reward+loss"),
}
TARGET = "exact:reward+loss"
REFERENCE = "k1:reward"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-out", default=os.path.join(REPO, "outputs", "reproduce"),
                   help="tools/reproduce.py's --out: <base-out>/base and <base-out>/data (built "
                        "there when missing, ~100 s)")
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "kl_grad_variance"))
    p.add_argument("--repeats", type=int, default=32, help="R independent batches")
    p.add_argument("--beta", type=float, default=1.0,
                   help="KL coefficient (with zero rewards every gradient is linear in beta)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, default=40,
                   help="RL steps (K1 in reward) before the weights are frozen; 0: the base model, "
                        "where policy = reference and every KL gradient is 0")
    p.add_argument("--warmup-beta", type=float, default=0.05)
    p.add_argument("--figure", default=None,
                   help="also draw the table as a bar chart here (e.g. "
                        "docs/figures/exact_kl_grad_variance.png)")
    p.add_argument("--configs", nargs="+", default=list(KL_CONFIGS), choices=list(KL_CONFIGS))
    a = p.parse_args(argv)
    if a.repeats < 2:
        p.error("--repeats must be >= 2 (a variance needs two batches)")
    if TARGET not in a.configs:
        a.configs.append(TARGET)
    return a


def flat_grad(policy):
    import torch

    parts = []
    for p in policy.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        parts.append((torch.zeros_like(p) if g is None else g).detach().reshape(-1))
    return torch.cat(parts).double()


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    from megatron_rl.progress import progress

    import reproduce
    from megatron_rl.config import parse_config
    from megatron_rl.kl import KLConfig
    from megatron_rl.runtime import setup_run
    from megatron_rl.rollout_queue import generate_batch
    from megatron_rl.update import train_on_batch

    t0 = time.time()
    paths = reproduce.prepare_tiny(os.path.abspath(a.base_out))
    save = tempfile.mkdtemp(prefix="kl_grad_variance_")
    cfg = parse_config(["--hf-checkpoint", paths["hf_checkpoint"], "--train-data",
                        *paths["train_data"], "--save", save, *reproduce.TINY_TRAIN_ARGS,
                        "--kl-estimator", "k1", "--kl-placement", "reward",
                        "--kl-coef", f"{a.beta:g}", "--ppo-minibatches", "1",
                        "--seed", str(a.seed)])
    rt = setup_run(cfg)
    captured = {}

    def capture_step():   # the optimizer step, replaced: keep the raw gradient, change nothing
        g = flat_grad(rt.policy)
        captured["g"] = g
        return True, float(g.norm())

    for s in progress(range(a.warmup_steps), desc="warm-up RL steps (k1:reward)", unit="step"):
        rt.cfg.algorithm.loss.kl = KLConfig(estimator="k1", placement="reward", coef=a.warmup_beta)
        batch, _ = generate_batch(rt, step=s)
        if not train_on_batch(rt.policy, rt.reference, rt.cfg, batch, {}):
            raise FloatingPointError(f"warm-up step {s} skipped (non-finite)")
        rt.engine.update_weights(s + 1)
    rt.policy.step = capture_step
    n_params = sum(p.numel() for p in rt.policy.parameters())
    sums = {c: torch.zeros(n_params, dtype=torch.float64) for c in a.configs}
    sqs = {c: torch.zeros(n_params, dtype=torch.float64) for c in a.configs}
    diff_sq = {c: 0.0 for c in a.configs}   # sum_r |g_c - g_target|^2 (paired: same batch)
    kl_tokens = []
    for r in progress(range(a.repeats), desc="batches", unit="batch"):
        # step seed cfg.seed + 7919 * step: not a warm-up step's; the data moves on too
        batch, _ = generate_batch(rt, step=a.warmup_steps + r)
        batch.rewards = torch.zeros_like(batch.rewards)   # the KL regulariser's gradient alone
        grads = {}
        for name in a.configs:
            est, placement = KL_CONFIGS[name]
            rt.cfg.algorithm.loss.kl = KLConfig(estimator=est, placement=placement, coef=a.beta)
            metrics: dict = {}
            captured.pop("g", None)
            train_on_batch(rt.policy, rt.reference, rt.cfg, batch, metrics)
            g = captured["g"]
            if not torch.isfinite(g).all():
                raise FloatingPointError(f"non-finite gradient for {name} at repetition {r}")
            grads[name] = g
            sums[name] += g
            sqs[name] += g * g
            if name == "exact:reward+loss" and "kl_exact" in metrics:
                kl_tokens.append(float(metrics["kl_exact"]))
        for name in a.configs:
            d = grads[name] - grads[TARGET]
            diff_sq[name] += float(d @ d)
    R = a.repeats
    means = {c: sums[c] / R for c in a.configs}
    tgt = means[TARGET]
    rows = []
    for c in a.configs:
        m = means[c]
        var = float(((sqs[c] - R * m * m) / (R - 1)).sum())   # trace of the covariance, per batch
        norm2 = float(m @ m)
        cos = float(m @ tgt) / max(math.sqrt(norm2 * float(tgt @ tgt)), 1e-300)
        # paired test of E[g_c] = E[g_target]: E|mean(d)|^2 = |bias|^2 + tr Cov(d) / R, so the
        # ratio |mean(d)|^2 / (tr Cov(d) / R) is ~1 without bias and grows with R with one
        dist2 = float((m - tgt) @ (m - tgt))
        var_d = (diff_sq[c] - R * dist2) / (R - 1)
        rows.append({"config": c, "mean_grad_norm": math.sqrt(norm2), "total_variance": var,
                     "variance_over_norm2": var / max(norm2, 1e-300),
                     "cos_with_target": cos, "dist2_to_target": dist2,
                     "diff_variance": var_d,
                     "bias2_estimate": dist2 - var_d / R,
                     "dist2_over_noise": dist2 / (var_d / R) if var_d > 0 else None,
                     "stderr2_of_mean": var / R})
    ref_var = next((r["total_variance"] for r in rows if r["config"] == REFERENCE), None)
    for row in rows:
        row["variance_vs_k1_reward"] = (row["total_variance"] / ref_var) if ref_var else None
    result = {"repeats": R, "beta": a.beta, "seed": a.seed, "num_params": n_params,
              "warmup_steps": a.warmup_steps, "warmup_beta": a.warmup_beta,
              "batch": "32 prompts x 5 samples, max 6 new tokens, temperature 1",
              "model": paths["hf_checkpoint"], "target": TARGET,
              "kl_exact_per_token_mean": (sum(kl_tokens) / len(kl_tokens)) if kl_tokens else None,
              "wall_s": round(time.time() - t0, 1), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    if a.figure:
        plot(result, a.figure)
    return 0


def plot(result: dict, path: str) -> str:
    """|mean gradient|^2 (signal) and total variance per batch (noise), one pair of bars per
    configuration, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([x - 0.2 for x in xs], [r["mean_grad_norm"] ** 2 for r in rows], 0.4,
           label="‖mean gradient‖² (signal)")
    ax.bar([x + 0.2 for x in xs], [r["total_variance"] for r in rows], 0.4,
           label="total variance of one batch's gradient (noise)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["config"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_title(f"KL part of the gradient, {result['repeats']} batches at fixed weights "
                 f"(beta {result['beta']:g})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    lines = [f"KL part of the gradient (task rewards zeroed), beta {result['beta']:g}, at the "
             f"weights after {result['warmup_steps']} RL steps (K1 in reward, beta "
             f"{result['warmup_beta']:g}) from the SFT base model, which is the reference; "
             f"{result['repeats']} independent batches of 32 prompts x 5 samples (the same "
             f"batches for every row), {result['num_params']} parameters. Exact KL to the "
             f"reference at these weights: {result['kl_exact_per_token_mean'] or float('nan'):.3f}"
             " nats/token. Total variance = trace of the covariance of one batch's gradient. "
             "Last column: the squared distance of the config's mean gradient to exact "
             "reward+loss's, over its expected value without bias (tr Cov(g - g_target) / R, "
             "paired on the same batches).", "",
             "| config | ‖mean grad‖ | total variance / batch | variance / ‖mean‖² | "
             "variance vs K1 in reward | cos(mean, exact reward+loss mean) | "
             "‖mean − target mean‖² / noise (≈1: no bias seen) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vk = r["variance_vs_k1_reward"]
        lines.append(f"| {r['config']} | {r['mean_grad_norm']:.3e} | {r['total_variance']:.3e} | "
                     f"{r['variance_over_norm2']:.3g} | "
                     f"{'n/a' if vk is None else f'{vk:.3f}x'} | {r['cos_with_target']:+.3f} | "
                     + ("target |" if r["dist2_over_noise"] is None
                        else f"{r['dist2_over_noise']:.2f} |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
