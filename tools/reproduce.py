#!/usr/bin/env python
"""Reproduce the paper's estimator x placement study from scratch: one command.

    python tools/reproduce.py [--quick] [--slice grid|exact|losses] [--configs ...] [--betas ...]
                              [--seeds ...] [--policy-losses ...] [--steps N]

1. The exact toy study (`megatron-rl toy`): table + figure (docs/figures/toy_kl_gradients.png).
2. The tiny base model, built with tools/cpu_demo.py's `prepare_data` and `build_base_model`
   (its model and warm-up, with a truthful teacher, on TINY_TASK: + and -), cached in
   <out>/base; an out-of-domain eval set (three-term basic_arithmetic, held-out seed) next to
   the in-domain one. With --hf-checkpoint a real model
   and prepared data files are used instead (scripts/reproduce_gpu.sh).
3. The sweep (megatron_rl.experiments.sweep.build_sweep): every run is `python -m megatron_rl.train`
   in <out>/runs/<run_id>, with periodic in-domain eval; OOD accuracy of the final checkpoint
   comes from `megatron-rl eval` (both sets use the reward task "arithmetic", and the trainer
   keys eval metrics by task, which rows can only name from the fixed TASKS list). Resumable:
   a run whose metrics and OOD result are complete is skipped; an interrupted one resumes from
   its newest checkpoint (or restarts when it has none).
4. Verdicts (instability/collapse, criteria in megatron_rl/experiments/sweep.py), tables (mean +- std
   over seeds) and training-curve figures, written between the GENERATED markers of
   docs/results.md (the hand-written analysis around them is kept).

--slice exact runs the issue-14 slice instead of the paper's grid (experiments.SLICES: the
exact estimator in reward and reward+loss beside K1 in reward, K3 in loss and no KL; no toy,
no async slice unless asked) and writes its own block (markers tagged "--slice exact") and figures
(prefixed "exact_"), so the grid's block and figures stay as they are.

--slice losses crosses --policy-losses (default ppo-clip, gspo, cispo; each with its own clip
range, experiments.POLICY_LOSS_CLIPS, stated in the block) with K1 in the reward and K3 in the
loss, into its own block (markers tagged "--slice losses", figures prefixed "losses_"). Any slice
takes --policy-losses; runs of a non-default loss carry it in their run id.

Run it under `nice -n 19` with OMP_NUM_THREADS=1 on a shared CPU (scripts/reproduce_cpu.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

from megatron_rl.experiments import sweep as ex  # noqa: E402

# The RL settings of tools/cpu_demo.py (its parse_config call, at its defaults): the tiny
# character-level model answers after "=" in at most 6 characters.
TINY_PROMPT_TEMPLATE = "{prompt}="
TINY_TRAIN_ARGS = ["--num-prompts-per-step", "32", "--group-size", "5", "--micro-batch-size", "80",
                   "--lr", "3e-4", "--adam-beta2", "0.99", "--advantage-estimator", "rloo",
                   "--max-new-tokens", "6", "--eval-samples", "4",
                   "--prompt-template", TINY_PROMPT_TEMPLATE, "--no-task-instruction"]
TINY_EVAL_ARGS = ["--samples", "4", "--max-new-tokens", "6",
                  "--prompt-template", TINY_PROMPT_TEMPLATE, "--no-task-instruction"]
TINY_SFT_STEPS, TINY_TRAIN_SIZE, TINY_EVAL_SIZE = 800, 20000, 128
# Out of domain for a model trained on two terms with + and -: three one-digit terms (+, -) and
# two one-digit terms with '*' (never seen), 128 of each in one file. The base model scores
# ~0.02 and ~0.07 on them (two-digit three-term problems: ~0.01, too close to zero to move).
_RG = dict(allow_parentheses=False, allow_negation=False, whitespace="no_space")
OOD_ARITHMETIC = (dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1, operators=("+", "-"), **_RG),
                  dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("*",), **_RG))
# In domain: two terms of one or two digits, + and - (the quick start's task is addition alone)
TINY_TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"), **_RG)
OOD_SEED = 7_777_777   # not the training seed (0) nor the in-domain held-out seed
BEGIN, END = "<!-- BEGIN GENERATED (tools/reproduce.py) -->", "<!-- END GENERATED -->"


def markers(slice_name: str = "grid") -> tuple[str, str]:
    """The generated block's markers: the grid's (unchanged), or tagged with the slice."""
    if slice_name == "grid":
        return BEGIN, END
    return (f"<!-- BEGIN GENERATED (tools/reproduce.py --slice {slice_name}) -->",
            f"<!-- END GENERATED (--slice {slice_name}) -->")
CURVES = [("reward/mean", "train reward (5-step avg)", 5), ("eval/mean_at_k", "held-out mean@k", 1),
          ("kl_k1", "KL to ref (k1, nats/token)", 1), ("entropy", "entropy (nats/token)", 1),
          ("grad_norm", "grad norm (pre-clip)", 1), ("response/length_mean", "response length", 1)]


def log(msg: str) -> None:
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# 1. toy study
# ----------------------------------------------------------------------------------------------
def run_toy(out: str, figures: str) -> dict:
    toy_dir = os.path.join(out, "toy")
    if not os.path.exists(os.path.join(toy_dir, "results.json")):
        t0 = time.time()
        _run([sys.executable, "-m", "megatron_rl.cli", "toy", "--out", toy_dir],
             os.path.join(out, "toy.log"))
        log(f"toy study: {time.time() - t0:.0f} s")
    os.makedirs(figures, exist_ok=True)
    shutil.copyfile(os.path.join(toy_dir, "figure.png"), os.path.join(figures, "toy_kl_gradients.png"))
    with open(os.path.join(toy_dir, "table.md")) as f:
        return {"table": f.read()}


# ----------------------------------------------------------------------------------------------
# 2. base model and data
# ----------------------------------------------------------------------------------------------
def prepare_tiny(out: str) -> dict:
    """cpu_demo's data and base model (in a child process: it initialises torch.distributed),
    plus the OOD set. Returns paths."""
    data = os.path.join(out, "data")
    ood = os.path.join(data, "ood.jsonl")
    if not os.path.exists(os.path.join(out, "base", "model.safetensors")):
        # the studies' base: cpu_demo's model and warm-up with a truthful teacher (seed 0,
        # constant learning rate), not the quick start's sign habit
        code = ("import sys; sys.path.insert(0, %r); import cpu_demo as d; "
                "t, _ = d.prepare_data(%r, %d, %d, task=%r); d.build_base_model(%r, t, %d, 0, "
                "wrong_sign_share=0.0, lr_decay_style='constant')"
                % (os.path.join(REPO, "tools"), out, TINY_TRAIN_SIZE, TINY_EVAL_SIZE, TINY_TASK,
                   out, TINY_SFT_STEPS))
        t0 = time.time()
        _run([sys.executable, "-c", code], os.path.join(out, "base_build.log"))
        log(f"base model: {time.time() - t0:.0f} s")
    if not os.path.exists(ood):
        from megatron_rl.data.records import normalize_problem, read_examples, write_jsonl
        from megatron_rl.data.sources import generate_arithmetic

        train = {normalize_problem(e.prompt) for e in read_examples(os.path.join(data, "train.jsonl"))}
        rows = [e for i, cfg in enumerate(OOD_ARITHMETIC)
                for e in generate_arithmetic(TINY_EVAL_SIZE, OOD_SEED + i, **cfg)
                if normalize_problem(e.prompt) not in train]
        write_jsonl(ood, rows)
    return {"hf_checkpoint": os.path.join(out, "base"),
            "train_data": [os.path.join(data, "train.jsonl")],
            "eval_data": [os.path.join(data, "eval.jsonl")], "ood_data": [ood]}


def evaluate_checkpoint(a, paths: dict, eval_data: list[str], out_json: str, load: str | None,
                        seeds: list[int], log_path: str) -> float:
    """`megatron-rl eval` of the base weights or a run's checkpoint; returns overall mean@k."""
    if not os.path.exists(out_json):
        cmd = [*a.launcher, "-m", "megatron_rl.cli", "eval", "--hf-checkpoint",
               paths["hf_checkpoint"], "--eval-data", *eval_data, "--seeds", *map(str, seeds),
               "--out", out_json, *a.eval_args_list]
        if load:
            cmd += ["--load", load]
        rc = _run(cmd, log_path)
        if rc != 0:
            raise RuntimeError(f"eval failed (exit {rc}); see {log_path}")
    with open(out_json) as f:
        return float(json.load(f)["mean"]["all"]["mean_at_k"])


# ----------------------------------------------------------------------------------------------
# 3. the sweep
# ----------------------------------------------------------------------------------------------
def _run(cmd: list[str], log_path: str) -> int:
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _has_checkpoint(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, "latest"))


def run_one(a, paths: dict, spec: ex.RunSpec) -> dict | None:
    """Train (or resume) one run, then its OOD eval. Returns its summary (None if it failed to
    produce metrics)."""
    run_dir = os.path.join(a.out, "runs", spec.run_id)
    status_path = os.path.join(run_dir, "status.json")
    ood_path = os.path.join(run_dir, "ood.json")
    status = json.load(open(status_path)) if os.path.exists(status_path) else {}
    rows = read_rows(run_dir)
    aborted = status.get("aborted", False)   # a NaN abort is a result, not something to redo
    if not aborted and not ex.is_complete(rows, a.steps, {} , need_ood=False):
        if not _has_checkpoint(run_dir) and os.path.exists(run_dir):
            shutil.rmtree(run_dir)   # no checkpoint to resume from: start clean
        os.makedirs(run_dir, exist_ok=True)
        interval = a.eval_interval
        cmd = [*a.launcher, "-m", "megatron_rl.train", "--hf-checkpoint", paths["hf_checkpoint"],
               "--train-data", *paths["train_data"], "--eval-data", *paths["eval_data"],
               "--save", run_dir, "--train-iters", str(a.steps), "--eval-interval", str(interval),
               "--save-interval", str(interval), *a.train_args_list, *spec.train_flags()]
        log(f"train {spec.run_id} ({a.steps} steps)")
        t0 = time.time()
        rc = _run(cmd, os.path.join(run_dir, "train.log"))
        tail = open(os.path.join(run_dir, "train.log")).read()[-4000:]
        status = {"returncode": rc, "wall_s": round(time.time() - t0, 1) + status.get("wall_s", 0),
                  "aborted": rc != 0 and "FloatingPointError" in tail, "command": shlex.join(cmd)}
        with open(status_path, "w") as f:
            json.dump(status, f, indent=2)
        rows = read_rows(run_dir)
        if rc != 0 and not status["aborted"]:
            log(f"  FAILED (exit {rc}); see {run_dir}/train.log")
            return None
        log(f"  done in {status['wall_s']:.0f} s: final eval "
            f"{rows[-1].get('eval/mean_at_k', float('nan')) if rows else float('nan'):.3f}")
    ood = None
    if paths["ood_data"] and _has_checkpoint(run_dir):
        ood = evaluate_checkpoint(a, paths, paths["ood_data"], ood_path, run_dir, [0],
                                  os.path.join(run_dir, "ood_eval.log"))
    elif os.path.exists(ood_path):
        ood = float(json.load(open(ood_path))["mean"]["all"]["mean_at_k"])
    if ood is not None and not a.keep_checkpoints:
        for name in os.listdir(run_dir):
            if name.startswith("iter_") or name == "latest":
                p = os.path.join(run_dir, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    return ex.summarize_run(spec, rows, ood, status.get("returncode", 0),
                            base_eval=a.base["eval"] if a.base else None)


# ----------------------------------------------------------------------------------------------
# 4. figures and the report
# ----------------------------------------------------------------------------------------------
def plot_group(runs: dict[str, list[list[dict]]], path: str, title: str, base: float | None) -> str:
    """Training curves (mean over seeds) of several configs, one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, label, smooth) in zip(axes.flat, CURVES):
        for name, seed_rows in runs.items():
            pts = ex.mean_curve(seed_rows, key)
            if not pts:
                continue
            if key == "eval/mean_at_k" and base is not None:
                pts = [(0, base)] + pts   # step 0: the base model (megatron-rl eval, 3 seeds)
            xs, ys = zip(*pts)
            ys = ex.moving_average(list(ys), smooth)
            ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, ms=3, lw=1.2,
                    label=name)
        if key == "eval/mean_at_k" and base is not None:
            ax.axhline(base, color="gray", ls="--", lw=1, label="base model")
        if key == "grad_norm":
            ax.set_yscale("log")
            ax.set_ylim(bottom=1e-2)   # an all-equal-reward minibatch has a zero gradient
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_summary(table: list[dict], path: str, base: dict | None, by_loss: bool = False) -> str:
    """Final in-domain and OOD mean@k per (regime, beta, config), mean +- std over seeds;
    ``by_loss``: per policy loss too (the loss leads each label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['config']}" + ("" if r["config"] == "none" else f" b={r['beta']:g}")
              + ("" if r["regime"] == "on" else f" [{r['regime']}]") for r in table]
    if by_loss:
        labels = [f"{r['policy_loss']} {label}" for r, label in zip(table, labels)]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(table) + 2), 4))
    xs = range(len(table))
    for off, key, name in ((-0.2, "eval_mean_at_k", "in-domain"), (0.2, "ood_mean_at_k", "OOD")):
        means = [r[key][0] if r[key][0] is not None else 0.0 for r in table]
        errs = [r[key][1] or 0.0 for r in table]
        ax.bar([x + off for x in xs], means, 0.4, yerr=errs, label=name, capsize=2)
    if base:
        ax.axhline(base["eval"], color="C0", ls="--", lw=1, label="base in-domain")
        ax.axhline(base["ood"], color="C1", ls="--", lw=1, label="base OOD")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("final mean@k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_beta_sweep(table: list[dict], path: str, base: dict | None) -> str | None:
    """Final KL and OOD mean@k against beta, one line per KL configuration (mean +- std over
    seeds), one column per regime with more than one beta; no KL and the base model dashed."""
    regimes = [g for g in dict.fromkeys(r["regime"] for r in table)
               if len({r["beta"] for r in table if r["regime"] == g and r["config"] != "none"}) > 1]
    if not regimes:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(regimes), figsize=(5.5 * len(regimes), 7), squeeze=False)
    for col, regime in enumerate(regimes):
        rows = [r for r in table if r["regime"] == regime]
        configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != "none"]
        none = next((r for r in rows if r["config"] == "none"), None)
        for row_i, (key, name) in enumerate((("kl_k1_final", "final KL (k1 / token)"),
                                             ("ood_mean_at_k", "OOD mean@k"))):
            ax = axes[row_i][col]
            for i, config in enumerate(configs):
                pts = sorted((r["beta"], r[key]) for r in rows if r["config"] == config
                             and r[key][0] is not None)
                ax.errorbar([b for b, _ in pts], [v[0] for _, v in pts],
                            yerr=[v[1] or 0.0 for _, v in pts], marker="o", capsize=2,
                            label=config, color=f"C{i}", ls="-" if config.startswith("k1") else "--")
            if none is not None and none[key][0] is not None:
                ax.axhline(none[key][0], color="k", ls=":", lw=1, label="no KL")
            if key == "ood_mean_at_k" and base:
                ax.axhline(base["ood"], color="grey", ls="--", lw=1, label="base model")
            ax.set_xscale("log")
            if key == "kl_k1_final":
                ax.set_yscale("log")
            ax.set_xlabel("beta")
            ax.set_ylabel(name)
            ax.set_title(f"{regime}-policy" if regime in ("on", "off") else regime)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_report(a, toy: dict | None, specs: list[ex.RunSpec], summaries: list[dict],
                 all_rows: dict[str, list[dict]], wall: dict) -> None:
    figures = a.figures
    os.makedirs(figures, exist_ok=True)
    table = ex.aggregate(summaries)
    k = a.eval_k
    begin, end = markers(a.slice)
    px = a.figure_prefix
    lines = [begin, "", f"_Generated by `python tools/reproduce.py {' '.join(a.argv)}` on "
             f"{time.strftime('%Y-%m-%d %H:%M')}; do not edit between the markers._", ""]
    if toy is not None:
        lines += ["### Toy study (exact, `megatron-rl toy`)", "", toy["table"].strip(), "",
                  "![toy](figures/toy_kl_gradients.png)", ""]
    if summaries:
        done = {s["run_id"] for s in summaries}
        losses = ("" if not a.by_loss else "; policy losses " + ", ".join(
            f"{x} (--clip-low/--clip-high {ex.clip_range(x)[0]:g}/{ex.clip_range(x)[1]:g}"
            + (", the trainer's defaults)" if ex.POLICY_LOSS_CLIPS[x] is None else ")")
            for x in a.policy_losses))
        lines += ["### LLM sweep" + ("" if a.slice == "grid" else f" (slice `{a.slice}`)"), "",
                  f"Model: `{a.model_name}`. {len(done)} of {len(specs)} runs finished, "
                  f"{a.steps} RL steps each, eval every {a.eval_interval} steps. Configs: "
                  f"{', '.join(a.configs)}{losses}; betas {', '.join(f'{b:g}' for b in a.betas)}; seeds "
                  f"{', '.join(map(str, a.seeds))}; regimes {', '.join(a.regimes)}"
                  + (f"; async levels {', '.join(map(str, a.async_levels))}" if a.async_levels else "")
                  + f". Training wall time {wall['train_s'] / 60:.1f} min (sum over runs).", "",
                  f"In-domain mean@{k}: the trainer's eval at the last step "
                  f"({a.eval_desc}); OOD mean@{k}: `megatron-rl eval` of the final checkpoint "
                  f"({a.ood_desc}). mean ± sample std over seeds (no ± with one seed). "
                  "Final KL: mean of the last 5 steps' `kl_k1`"
                  + (", final train reward of `reward/mean`" if a.by_loss else "")
                  + ". Verdict criteria: "
                  f"`{ex.StabilityCriteria()}`, `{ex.CollapseCriteria()}` "
                  "(megatron_rl/experiments/sweep.py).", "",
                  ex.markdown_table(table, k, a.base, policy_losses=a.by_loss), ""]
        if plot_beta_sweep(table, os.path.join(figures, f"{px}beta_sweep.png"), a.base):
            lines += [f"![final KL and OOD accuracy against beta](figures/{px}beta_sweep.png)", ""]
        plot_summary(table, os.path.join(figures, f"{px}sweep_summary.png"), a.base, a.by_loss)
        lines += [f"![summary](figures/{px}sweep_summary.png)", ""]
        by_fig: dict[tuple, dict[str, list]] = {}
        for s in summaries:
            spec = next(x for x in specs if x.run_id == s["run_id"])
            betas = [spec.beta] if spec.config != "none" else sorted(
                {x.beta for x in specs if x.config != "none" and x.regime == spec.regime}) or [0.0]
            name = f"{spec.policy_loss} {spec.config}" if a.by_loss else spec.config
            for beta in betas:
                by_fig.setdefault((spec.regime, beta), {}).setdefault(name, []).append(
                    all_rows[s["run_id"]])
        for (regime, beta), runs in sorted(by_fig.items(), key=lambda kv: (
                ex.regime_order(kv[0][0]), kv[0][1])):
            name = f"{px}curves_{regime}_beta{beta:g}.png"
            plot_group(runs, os.path.join(figures, name),
                       f"{regime}-policy, beta={beta:g} (mean over seeds; 'none' has no KL)",
                       a.base["eval"] if a.base else None)
            lines += [f"![{regime} beta {beta:g}](figures/{name})", ""]
        lines += ["<details><summary>Per-run verdicts</summary>", "",
                  "| run | in-domain | OOD | final KL | verdict | reasons | wall (s) |",
                  "|---|---|---|---|---|---|---|"]
        for s in summaries:
            fmt = lambda v, d=3: "n/a" if v is None else f"{v:.{d}f}"  # noqa: E731
            lines.append(f"| {s['run_id']} | {fmt(s['eval_mean_at_k'])} | "
                         f"{fmt(s['ood_mean_at_k'])} | {fmt(s['kl_k1_final'], 4)} | "
                         f"{s['verdict']} | {', '.join(s['instability'] + s['collapse'])} | "
                         f"{wall['runs'].get(s['run_id'], 0):.0f} |")
        lines += ["", "</details>", ""]
    lines.append(end)
    block = "\n".join(lines)
    report = a.report
    text = open(report).read() if os.path.exists(report) else (
        "# Results\n\n(Analysis goes here; the generated block below is rewritten by "
        "tools/reproduce.py.)\n\n")
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
    with open(report, "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "summary.json" if a.slice == "grid"
                           else f"summary_{a.slice}.json"), "w") as f:
        json.dump({"runs": summaries, "groups": table, "base": a.base}, f, indent=2, default=str)
    log(f"wrote {report} and figures in {figures}")


# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/reproduce", help="runs, data, base model, logs")
    p.add_argument("--report", default=os.path.join(REPO, "docs", "results.md"))
    p.add_argument("--figures", default=os.path.join(REPO, "docs", "figures"))
    p.add_argument("--slice", default="grid", choices=list(ex.SLICES),
                   help="grid: the paper's Table 1 (default); exact: the exact estimator in reward "
                        "and reward+loss beside k1:reward, k3:loss and none (own report block/figures)")
    p.add_argument("--configs", nargs="+", default=None, choices=list(ex.CONFIGS),
                   help="default: the --slice's configs (megatron_rl/experiments/sweep.py SLICES)")
    p.add_argument("--policy-losses", nargs="+", default=None, choices=list(ex.POLICY_LOSS_CLIPS),
                   help="--policy-loss values crossed with the configs, each with its clip range "
                        "(experiments.POLICY_LOSS_CLIPS); default: ppo-clip gspo cispo with "
                        "--slice losses, the trainer's default (ppo-clip) otherwise")
    p.add_argument("--betas", nargs="+", type=float, default=list(ex.DEFAULT_BETAS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(ex.DEFAULT_SEEDS))
    p.add_argument("--regimes", nargs="*", default=["on", "off"], help="on, off")
    p.add_argument("--async-levels", nargs="*", type=int, default=None,
                   help="the async slice (none, k1:reward, k3:loss, k1:reward+seq-is); "
                        "default 2 with --slice grid, none otherwise")
    p.add_argument("--async-betas", nargs="+", type=float, default=None,
                   help="betas of the async slice (default: the first of --betas)")
    p.add_argument("--steps", type=int, default=100, help="RL steps per run")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--quick", action="store_true",
                   help="seed 1, betas 0.05 and 1, the 7 configs on-policy, 40 steps, no async")
    p.add_argument("--max-runs", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--skip-toy", action="store_true")
    p.add_argument("--report-only", action="store_true", help="aggregate what exists, train nothing")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoints after its OOD eval (default: delete)")
    # a real model (scripts/reproduce_gpu.sh)
    p.add_argument("--hf-checkpoint", help="a HF model dir instead of the tiny CPU base model")
    p.add_argument("--train-data", nargs="+")
    p.add_argument("--eval-data", nargs="+")
    p.add_argument("--ood-data", nargs="*", default=[])
    p.add_argument("--train-args", default="", help="extra megatron_rl.train flags (one string)")
    p.add_argument("--eval-args", default="", help="extra `megatron-rl eval` flags (one string)")
    p.add_argument("--launcher", default="",
                   help="prefix instead of the current python, e.g. 'torchrun --nproc-per-node 8'")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.configs is None:
        a.configs = list(ex.SLICES[a.slice])
    if a.policy_losses is None:
        a.policy_losses = list(ex.SLICE_POLICY_LOSSES.get(a.slice, (ex.DEFAULT_POLICY_LOSS,)))
    # the report's loss column, curves and labels only when some run is not the default loss
    a.by_loss = a.policy_losses != [ex.DEFAULT_POLICY_LOSS]
    if a.async_levels is None:
        a.async_levels = [2] if a.slice == "grid" else []
    if a.slice != "grid":
        a.skip_toy = True   # the toy table lives in the grid's block
    a.figure_prefix = "" if a.slice == "grid" else f"{a.slice}_"
    if a.quick:
        a.seeds, a.betas, a.regimes, a.async_levels, a.steps = [1], [0.05, 1.0], ["on"], [], 40
    for r in a.regimes:
        if r not in ("on", "off"):
            raise ValueError(f"--regimes {r!r}; valid: on, off (async: --async-levels)")
    if a.steps % a.eval_interval:
        raise ValueError("--eval-interval must divide --steps (the last step is evaluated and saved)")
    a.launcher = shlex.split(a.launcher) if a.launcher else [sys.executable]
    a.out = os.path.abspath(a.out)
    if a.hf_checkpoint:
        if not (a.train_data and a.eval_data):
            raise ValueError("--hf-checkpoint needs --train-data and --eval-data (prepared JSONL)")
        a.train_args_list, a.eval_args_list = shlex.split(a.train_args), shlex.split(a.eval_args)
        a.model_name = a.hf_checkpoint
    else:
        a.train_args_list = TINY_TRAIN_ARGS + shlex.split(a.train_args)
        a.eval_args_list = TINY_EVAL_ARGS + shlex.split(a.eval_args)
        a.model_name = (f"tiny char-level Qwen2 (4 layers, hidden 128), {TINY_SFT_STEPS} SFT steps "
                        "(tools/cpu_demo.py); RLOO, 5 samples x 32 prompts/step, lr 3e-4")
    a.eval_k = int(_flag_value(a.eval_args_list, "--samples", _flag_value(
        a.train_args_list, "--eval-samples", "4")))
    return a


def _flag_value(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    toy = None if a.skip_toy else run_toy(a.out, a.figures)
    if a.hf_checkpoint:
        paths = {"hf_checkpoint": a.hf_checkpoint, "train_data": a.train_data,
                 "eval_data": a.eval_data, "ood_data": a.ood_data}
        a.eval_desc = ", ".join(map(os.path.basename, a.eval_data))
        a.ood_desc = ", ".join(map(os.path.basename, a.ood_data)) or "none"
    else:
        paths = prepare_tiny(a.out)
        a.eval_desc = (f"{TINY_EVAL_SIZE} held-out two-term problems, k=4 samples, temperature 1")
        a.ood_desc = (f"{TINY_EVAL_SIZE} three-term one-digit +/- problems and {TINY_EVAL_SIZE} "
                      "two-term one-digit '*' problems (held-out seeds), k=4, one sampling seed")
    # the base model on both sets (3 sampling seeds each)
    base_dir = os.path.join(a.out, "base_eval")
    a.base = {"eval": evaluate_checkpoint(a, paths, paths["eval_data"],
                                          os.path.join(base_dir, "eval.json"), None, [0, 1, 2],
                                          os.path.join(base_dir, "eval.log"))}
    a.base["ood"] = (evaluate_checkpoint(a, paths, paths["ood_data"], os.path.join(base_dir, "ood.json"),
                                         None, [0, 1, 2], os.path.join(base_dir, "eval.log"))
                     if paths["ood_data"] else float("nan"))
    log(f"base model: in-domain {a.base['eval']:.3f}, OOD {a.base['ood']:.3f}")

    specs = ex.build_sweep(a.configs, a.betas, a.seeds, a.regimes, a.async_levels,
                           async_betas=a.async_betas, policy_losses=a.policy_losses)
    log(f"{len(specs)} runs in the sweep")
    summaries, all_rows, wall = [], {}, {"train_s": 0.0, "runs": {}}
    launched = 0
    for spec in specs:
        run_dir = os.path.join(a.out, "runs", spec.run_id)
        if a.report_only or (a.max_runs and launched >= a.max_runs):
            rows = read_rows(run_dir)
            ood_path = os.path.join(run_dir, "ood.json")
            ood = json.load(open(ood_path))["mean"]["all"]["mean_at_k"] if os.path.exists(ood_path) else None
            st_path = os.path.join(run_dir, "status.json")
            status = json.load(open(st_path)) if os.path.exists(st_path) else {}
            if not (status.get("aborted") or ex.is_complete(rows, a.steps, ood,
                                                             need_ood=bool(paths["ood_data"]))):
                continue
            summary = ex.summarize_run(spec, rows, ood, status.get("returncode", 0), a.base["eval"])
        else:
            was_complete = ex.is_complete(read_rows(run_dir), a.steps, {}, need_ood=False)
            summary = run_one(a, paths, spec)
            launched += not was_complete
            if summary is None:
                continue
        summaries.append(summary)
        all_rows[spec.run_id] = read_rows(run_dir)
        st = os.path.join(run_dir, "status.json")
        w = json.load(open(st)).get("wall_s", 0.0) if os.path.exists(st) else 0.0
        wall["runs"][spec.run_id] = w
        wall["train_s"] += w
        # rewrite the report after every run trained: an interrupted sweep still leaves a report
        # (not per run when only aggregating: every rewrite redraws all figures)
        if not a.report_only:
            write_report(a, toy, specs, summaries, all_rows, wall)
    if a.report_only or not summaries:
        write_report(a, toy, specs, summaries, all_rows, wall)
    log(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
