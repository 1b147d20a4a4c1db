#!/usr/bin/env python
"""The CPU demo (the README's main job): a tiny model learns arithmetic with RL, K1 in the reward.

1. Data: reasoning-gym basic_arithmetic (two terms, up to two digits, + and -), a training set and
   a disjoint held-out set (overlap removed), as prepared JSONL.
2. A tiny Qwen2-architecture model (character tokenizer) gets a short supervised warm-up: the
   weak "base model" (cached in <out>/base, reused on the next run).
3. RL with the paper's recommended setup: RLOO, 5 samples per prompt, K1 in the reward
   (beta 0.05), loss normalised by the batch's token count, the local (in-process) engine.
4. Held-out accuracy (mean@k) of the base model vs after RL is printed and plotted.

    python tools/cpu_demo.py [--out outputs/demo] [--rl-steps 40]
"""
import argparse
import json
import os
import sys
import time

import torch

# A tiny character-level model needs no instruction: the bare problem, then "=" and the number.
PROMPT_TEMPLATE = "{prompt}="

def prepare_data(out: str, train_size: int, eval_size: int) -> tuple[str, str]:
    from megatron_rl.data.prepare import HELD_OUT_SEED, remove_overlap, normalize_problem
    from megatron_rl.data.records import write_jsonl
    from megatron_rl.data.sources import generate_arithmetic

    easy = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                allow_parentheses=False, allow_negation=False, whitespace="no_space")
    train_path, eval_path = os.path.join(out, "data/train.jsonl"), os.path.join(out, "data/eval.jsonl")
    if not (os.path.exists(train_path) and os.path.exists(eval_path)):
        held_out = generate_arithmetic(eval_size, HELD_OUT_SEED, **easy)
        train, removed = remove_overlap(generate_arithmetic(train_size, 0, **easy),
                                        {normalize_problem(e.prompt) for e in held_out})
        print(f"[data] {len(train)} training problems ({removed} overlapping the held-out set "
              f"removed), {len(held_out)} held-out problems")
        write_jsonl(eval_path, held_out)
        write_jsonl(train_path, train)
    return train_path, eval_path


def build_base_model(out: str, train_path: str, sft_steps: int) -> str:
    """Tiny model + character tokenizer, supervised warm-up, exported as HF to <out>/base."""
    from megatron_rl.data.prompts import PromptBuilder, load_tokenizer
    from megatron_rl.data.records import read_examples
    from megatron_rl.experiments.sft import warm_up
    from megatron_rl.experiments.tiny_model import make_demo_model

    base = os.path.join(out, "base")
    if os.path.exists(os.path.join(base, "model.safetensors")):
        print(f"[base] reusing {base}")
        return base
    init = os.path.join(out, "init")
    make_demo_model(init)
    tok = load_tokenizer(init)
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    pairs = [(tok(builder(ex))["input_ids"], tok(ex.answer)["input_ids"] + [tok.eos_token_id])
             for ex in read_examples(train_path)]
    warm_up(init, base, pairs, sft_steps)
    return base


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--rl-steps", type=int, default=80)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--fresh", action="store_true", help="discard a previous RL run in <out>/rl")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.time()
    train_path, eval_path = prepare_data(a.out, train_size=20000, eval_size=a.eval_prompts)
    base = build_base_model(a.out, train_path, a.sft_steps)

    from megatron_rl.config import parse_config
    from megatron_rl.train import train

    rl_dir = os.path.join(a.out, "rl")
    if a.fresh and os.path.exists(rl_dir):
        import shutil

        shutil.rmtree(rl_dir)
    cfg = parse_config([
        "--hf-checkpoint", base, "--save", rl_dir, "--train-data", train_path,
        "--eval-data", eval_path, "--train-iters", str(a.rl_steps),
        "--num-prompts-per-step", str(a.prompts_per_step), "--group-size", "5",
        "--micro-batch-size", "80", "--lr", str(a.lr), "--adam-beta2", "0.99",
        "--kl-estimator", "k1", "--kl-placement", "reward", "--kl-coef", "0.05",
        "--advantage-estimator", "rloo", "--max-new-tokens", "6",
        "--eval-interval", str(a.eval_interval), "--eval-samples", "4",
        "--save-interval", str(a.eval_interval), "--seed", "1",
        "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction"])
    # base-model accuracy, measured with exactly the evaluation the trainer runs
    base_metrics = evaluate_weights(cfg)
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(rl_dir, "metrics.jsonl"))]
    final = [r for r in rows if "eval/mean_at_k" in r][-1]
    print(f"\nheld-out accuracy (mean@{cfg.eval.eval_samples}, {a.eval_prompts} problems): "
          f"base {base_metrics['eval/mean_at_k']:.3f} -> after {final['step']} RL steps "
          f"{final['eval/mean_at_k']:.3f}   (total time {time.time() - t_start:.0f} s)")
    from megatron_rl.experiments.plots import plot_run

    png = plot_run(rows, os.path.join(a.out, "demo.png"), baseline=base_metrics["eval/mean_at_k"],
                   title="CPU demo: RLOO, K1 in the reward (beta 0.05)")
    print(f"plot: {png}")
    return 0 if final["eval/mean_at_k"] > base_metrics["eval/mean_at_k"] else 1


def evaluate_weights(cfg) -> dict:
    """Evaluate the initial weights (step 0) once; cached in <save>/base_eval.json."""
    path = os.path.join(cfg.checkpoint.save, "base_eval.json")
    if os.path.exists(path):
        return json.load(open(path))
    from megatron_rl.evaluation import evaluate
    from megatron_rl.runtime import setup_run

    run = setup_run(cfg)
    res = evaluate(run, 0)
    run.close()
    with open(path, "w") as f:
        json.dump(res, f)
    return res


if __name__ == "__main__":
    sys.exit(main())
