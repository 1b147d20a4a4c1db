#!/usr/bin/env python
"""The CPU demo (the README's main job): a tiny model learns arithmetic with RL, K1 in the reward.

1. Data: reasoning-gym basic_arithmetic (two terms of one or two digits, added), a training set
   and a disjoint held-out set (overlap removed), as prepared JSONL.
2. A tiny Qwen2-architecture model (character tokenizer) gets a supervised warm-up (1600
   steps of 64) on the training problems, copying a careless teacher who writes 70% of its
   answers with the wrong sign (-112 for 112). The base model learns some of the digits (about
   two in five of its samples have them right) and mostly the wrong sign: a habit that
   demonstrations taught and that only the reward (is the answer right?) can teach it out of.
   RL (120 steps) unlearns most of it: held-out accuracy climbs towards the share of samples
   with the right digits. The base is cached in <out>/base with a stamp of the warm-up's
   settings (and <out>/data with the task's), reused only by a run with the same ones.
3. RL with the paper's recommended setup: RLOO, 5 samples per prompt, K1 in the reward
   (beta 0.05), loss normalised by the batch's token count, the local (in-process) engine.
4. Held-out accuracy (mean@k) of the base model and after RL, on the same problems with the
   same sampling seeds; the gain is printed with its standard error paired over the problems
   and its 95% interval, and the curves are plotted.

    python tools/cpu_demo.py [--out outputs/demo] [--seed 1] [--rl-steps 240]
    python tools/cpu_demo.py --compare-placements   # K1/K3, reward/loss, from the same base

Uses OMP_NUM_THREADS threads (scripts/quickstart.sh: 2 where there are 2 cores).
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import torch

# A tiny character-level model needs no instruction: the bare problem, then "=" and the number.
PROMPT_TEMPLATE = "{prompt}="
TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+",),
            allow_parentheses=False, allow_negation=False, whitespace="no_space")
# the warm-up teacher's share of answers with the wrong sign
WRONG_SIGN_SHARE = 0.7
# What a run prints on a 2-core x86 machine (README, "Quick start": 3 seeds x 2 CPU code paths)
EXPECTED = ("base 0.07-0.17 -> after 0.25-0.56, gain +0.18 to +0.39 (10-17 standard errors); "
            "in the plot the train reward climbs from ~0.1 to ~0.3 within 30 steps")


def _stamped(path: str, settings: dict) -> bool:
    """Whether `path` was made with `settings` (its settings.json); otherwise remove it, so that
    it is made again."""
    stamp = os.path.join(path, "settings.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == settings:
                return True
    shutil.rmtree(path, ignore_errors=True)
    return False


def _stamp(path: str, settings: dict) -> None:
    with open(os.path.join(path, "settings.json"), "w") as f:
        json.dump(settings, f, indent=1)


def prepare_data(out: str, train_size: int, eval_size: int, task: dict | None = None
                 ) -> tuple[str, str]:
    """basic_arithmetic problems of `task` (reasoning-gym's settings; default TASK) in
    <out>/data: train.jsonl and a held-out eval.jsonl, disjoint."""
    from megatron_rl.data.prepare import HELD_OUT_SEED, remove_overlap
    from megatron_rl.data.records import normalize_problem, write_jsonl
    from megatron_rl.data.sources import generate_arithmetic

    data = os.path.join(out, "data")
    train_path, eval_path = os.path.join(data, "train.jsonl"), os.path.join(data, "eval.jsonl")
    task = TASK if task is None else task
    settings = {"task": {k: list(v) if isinstance(v, tuple) else v for k, v in task.items()},
                "train_size": train_size, "eval_size": eval_size}
    if not _stamped(data, settings):
        held_out = generate_arithmetic(eval_size, HELD_OUT_SEED, **task)
        train, removed = remove_overlap(generate_arithmetic(train_size, 0, **task),
                                        {normalize_problem(e.prompt) for e in held_out})
        print(f"[data] {len(train)} training problems ({removed} overlapping the held-out set "
              f"removed), {len(held_out)} held-out problems")
        write_jsonl(eval_path, held_out)
        write_jsonl(train_path, train)
        _stamp(data, settings)
    return train_path, eval_path


def careless_answer(answer: str, wrong_sign: bool) -> str:
    """The teacher's answer: `answer` with its sign flipped where `wrong_sign` (0 stays 0)."""
    if not wrong_sign or answer.lstrip("-") == "0":
        return answer
    return answer[1:] if answer.startswith("-") else "-" + answer


def build_base_model(out: str, train_path: str, sft_steps: int, seed: int, *,
                     wrong_sign_share: float = WRONG_SIGN_SHARE,
                     lr_decay_style: str = "cosine") -> str:
    """Tiny model + character tokenizer, supervised warm-up on the careless teacher's answers
    (seeded by `seed`: initial weights, teacher, batches; `wrong_sign_share` of its answers with
    the wrong sign: 0 for a truthful teacher, as tools/reproduce.py's studies use), exported as
    HF to <out>/base."""
    import random

    from megatron_rl.data.prompts import PromptBuilder, load_tokenizer
    from megatron_rl.data.records import read_examples
    from megatron_rl.experiments.sft import warm_up
    from megatron_rl.experiments.tiny_model import make_demo_model

    base = os.path.join(out, "base")
    with open(os.path.join(os.path.dirname(train_path), "settings.json")) as f:
        data = json.load(f)  # prepare_data's stamp: the task and the sizes
    settings = {"data": data, "sft_steps": sft_steps, "seed": seed,
                "lr": 2e-3, "lr_decay_style": lr_decay_style,
                "wrong_sign_share": wrong_sign_share}
    if _stamped(base, settings) and os.path.exists(os.path.join(base, "model.safetensors")):
        print(f"[base] reusing {base}")
        return base
    init = os.path.join(out, "init")
    make_demo_model(init, seed=seed)
    tok = load_tokenizer(init)
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    rng = random.Random(seed)
    pairs = [(tok(builder(ex))["input_ids"],
              tok(careless_answer(ex.answer, rng.random() < wrong_sign_share))["input_ids"]
              + [tok.eos_token_id])
             for ex in read_examples(train_path)]
    warm_up(init, base, pairs, sft_steps, lr=settings["lr"],
            lr_decay_style=settings["lr_decay_style"], seed=seed)
    _stamp(base, settings)
    return base


# --compare-placements: where the KL penalty enters, the paper's Table 1 rows that matter most
# (name -> --kl-estimator, --kl-placement; "no KL" runs with --kl-coef 0 as the reference line)
PLACEMENTS = {"K1 in the reward": ("k1", "reward"), "K1 in the loss": ("k1", "loss"),
              "K3 in the loss": ("k3", "loss"), "no KL": ("k1", "reward")}


def rl_config(a, base: str, train_path: str, eval_path: str, save: str, *,
              estimator: str = "k1", placement: str = "reward", kl_coef: float = 0.05,
              steps: int | None = None):
    """The demo's RL run: RLOO, 5 samples per prompt, the KL penalty as given."""
    from megatron_rl.config import parse_config

    return parse_config([
        "--hf-checkpoint", base, "--save", save, "--train-data", train_path,
        "--eval-data", eval_path, "--train-iters", str(steps or a.rl_steps),
        "--num-prompts-per-step", str(a.prompts_per_step), "--group-size", "5",
        "--micro-batch-size", "80", "--lr", str(a.lr), "--adam-beta2", "0.99",
        "--lr-warmup-iters", str(a.lr_warmup),
        "--kl-estimator", estimator, "--kl-placement", placement, "--kl-coef", str(kl_coef),
        "--advantage-estimator", "rloo", "--max-new-tokens", "6",
        "--eval-interval", str(a.eval_interval), "--eval-samples", str(a.eval_samples),
        "--save-interval", str(a.eval_interval), "--seed", str(a.seed),
        "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/demo", help="where the data, models and runs go")
    p.add_argument("--seed", type=int, default=1,
                   help="seeds the RL run and, unless --base-seed, the base model")
    p.add_argument("--base-seed", type=int, default=None,
                   help="seeds the base model (initial weights, the teacher's signs, warm-up "
                        "batches); default: --seed")
    p.add_argument("--sft-steps", type=int, default=1600, help="supervised warm-up steps")
    p.add_argument("--wrong-sign-share", type=float, default=WRONG_SIGN_SHARE,
                   help="the warm-up teacher's share of answers with the wrong sign")
    p.add_argument("--rl-steps", type=int, default=120, help="RL steps")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per RL step")
    p.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    p.add_argument("--lr-warmup", type=int, default=10, help="RL steps of linear lr warm-up")
    p.add_argument("--eval-interval", type=int, default=20, help="RL steps between evaluations")
    p.add_argument("--eval-prompts", type=int, default=256, help="held-out problems")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem")
    p.add_argument("--fresh", action="store_true", help="discard a previous RL run in <out>")
    p.add_argument("--compare-placements", action="store_true",
                   help="instead of the demo: the same RL from the same base with K1 in the "
                        "reward, K1 in the loss, K3 in the loss and no KL, at --compare-kl-coef "
                        "for --compare-steps steps, plotted to <out>/placements.png")
    p.add_argument("--compare-kl-coef", type=float, default=0.3,
                   help="the KL coefficient of --compare-placements")
    p.add_argument("--compare-steps", type=int, default=120,
                   help="RL steps of each --compare-placements run")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.time()
    train_path, eval_path = prepare_data(a.out, train_size=20000, eval_size=a.eval_prompts)
    base = build_base_model(a.out, train_path, a.sft_steps,
                            a.seed if a.base_seed is None else a.base_seed,
                            wrong_sign_share=a.wrong_sign_share)
    t_base = time.time()
    if a.compare_placements:
        return compare_placements(a, base, train_path, eval_path)

    from megatron_rl.train import train

    cfg = rl_config(a, base, train_path, eval_path, os.path.join(a.out, "rl"))
    discard_stale_run(cfg, a.fresh)
    # the base model's accuracy, problem by problem, sampled as the trainer's evaluation samples
    before = held_out_scores(cfg, "base_eval.json")
    train(cfg)
    after = held_out_scores(cfg, f"eval_{a.rl_steps}.json")
    t_end = time.time()
    rows = read_rows(cfg)
    gain, se = paired_gain(before, after)
    k = cfg.eval.eval_samples
    print(f"\nheld-out accuracy (mean@{k}, {len(before)} problems): base {mean(before):.3f} -> "
          f"after {a.rl_steps} RL steps {mean(after):.3f}\n"
          f"{gain_line(gain, se)}\n"
          f"time {t_end - t_start:.0f} s ({t_base - t_start:.0f} s data and base model, "
          f"{t_end - t_base:.0f} s RL with its evaluations)\n"
          f"expected on a 2-core x86 machine: {EXPECTED}")
    from megatron_rl.experiments.plots import plot_run

    png = plot_run(rows, os.path.join(a.out, "demo.png"), baseline=mean(before),
                   title="CPU demo: RLOO, K1 in the reward (beta 0.05)")
    print(f"plot: {png}")
    return 0 if gain - 1.96 * se > 0 else 1  # status 1: no gain beyond noise


def compare_placements(a, base: str, train_path: str, eval_path: str) -> int:
    """The same RL (seed, base, data order, sampling seeds) under each of PLACEMENTS at
    --compare-kl-coef, each run in <out>/placements/<name>; one figure of the per-token k1 KL to
    the reference (train batches) and held-out mean@k per step, and a table of the last
    evaluation and the mean KL of the last 20 steps, also in <out>/placements/summary.json."""
    from megatron_rl.experiments.plots import plot_run
    from megatron_rl.train import train

    t0 = time.time()
    runs, summary, before = {}, {}, None
    for name, (estimator, placement) in PLACEMENTS.items():
        save = os.path.join(a.out, "placements", name.replace(" ", "_"))
        cfg = rl_config(a, base, train_path, eval_path, save, estimator=estimator,
                        placement=placement, steps=a.compare_steps,
                        kl_coef=0.0 if name == "no KL" else a.compare_kl_coef)
        discard_stale_run(cfg, a.fresh)
        if before is None:
            before = mean(held_out_scores(cfg, "base_eval.json"))
        print(f"\n[placements] {name} (--kl-estimator {estimator} --kl-placement {placement} "
              f"--kl-coef {cfg.algorithm.loss.kl.coef:g})")
        train(cfg)
        rows = runs[name] = read_rows(cfg)
        last = [r["kl_k1"] for r in rows if "kl_k1" in r][-20:]
        summary[name] = {"held_out": [r["eval/mean_at_k"] for r in rows
                                      if "eval/mean_at_k" in r][-1],
                         "kl_k1_last20": mean(last)}
    seconds = time.time() - t0
    with open(os.path.join(a.out, "placements", "summary.json"), "w") as f:
        json.dump({"kl_coef": a.compare_kl_coef, "steps": a.compare_steps, "base": before,
                   "seconds": round(seconds), "runs": summary}, f, indent=1)
    print(f"\nbeta {a.compare_kl_coef}, {a.compare_steps} RL steps from the same base "
          f"(held-out {before:.3f}), {seconds:.0f} s:")
    print(f"{'':20s} {'held-out mean@k':>16s} {'KL/token (last 20)':>19s}")
    for name, r in summary.items():
        print(f"{name:20s} {r['held_out']:16.3f} {r['kl_k1_last20']:19.4f}")
    png = plot_run(runs, os.path.join(a.out, "placements.png"), baseline=before,
                   panels=("kl_k1", "eval/mean_at_k"),
                   title=f"Where the KL enters (beta {a.compare_kl_coef}, same base and seed)")
    print(f"plot: {png}")
    return 0


def read_rows(cfg) -> list[dict]:
    with open(os.path.join(cfg.checkpoint.save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def discard_stale_run(cfg, fresh: bool) -> None:
    """Remove <save> (the RL run and its cached evaluations) when `fresh` or when it started
    from another base model than cfg's (by the base's settings.json), else keep it to resume."""
    rl_dir = cfg.checkpoint.save
    with open(os.path.join(cfg.model.hf_checkpoint, "settings.json")) as f:
        settings = {"base": json.load(f)}
    if fresh or not _stamped(rl_dir, settings):
        shutil.rmtree(rl_dir, ignore_errors=True)
        os.makedirs(rl_dir)
        _stamp(rl_dir, settings)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """The mean per-problem gain and its standard error: both evaluations score the same
    problems, so the error is the per-problem difference's standard deviation / sqrt(#problems)
    (problems are the independent draws; an unpaired error would count their spread twice)."""
    diff = [y - x for x, y in zip(before, after)]
    m = mean(diff)
    var = sum((d - m) ** 2 for d in diff) / (len(diff) - 1)
    return m, math.sqrt(var / len(diff))


def gain_line(gain: float, se: float) -> str:
    """The gain, its 95% interval and its size in standard errors, as the demos print it."""
    size = f"{gain / se:.1f} standard errors" if se > 0 else "no spread"
    return (f"gain {gain:+.3f}, 95% interval [{gain - 1.96 * se:+.3f}, {gain + 1.96 * se:+.3f}] "
            f"({size}, paired over the problems)")


def held_out_scores(cfg, name: str) -> list[float]:
    """Each held-out problem's share of correct samples (of --eval-samples) with the run's
    latest weights (the base model before RL), cached in <save>/`name`. Sampled with the
    trainer's own evaluation seeds (evaluation.evaluate on one rank: a chunk of 16 problems per
    call, each seeded from cfg.seed + 104729), so the mean is the trainer's eval/mean_at_k."""
    path = os.path.join(cfg.checkpoint.save, name)
    if os.path.exists(path):
        return json.load(open(path))
    from megatron_rl.rollout.base import prompt_seed
    from megatron_rl.rollout.functions import RolloutContext, run_rollout
    from megatron_rl.runtime import setup_run

    run = setup_run(cfg)
    data = run.eval_data
    assert data is not None
    records = [data.record(0, i) for i in range(len(data))]
    scores = []
    for start in range(0, len(records), 16):
        ctx = RolloutContext(run.engine, run.sampling_params(prompt_seed(cfg.seed + 104729, start)),
                             cfg.eval.eval_samples, run.codec, run.scorer, run.start_step,
                             evaluation=True, agent=cfg.agent,
                             args=cfg.rollout.rollout_function_args)
        for group in run_rollout(cfg.rollout.rollout_function, ctx, records[start:start + 16]):
            scores.append(sum(t.reward >= 1.0 for t in group) / len(group))
    run.close()
    with open(path, "w") as f:
        json.dump(scores, f)
    return scores


if __name__ == "__main__":
    sys.exit(main())
