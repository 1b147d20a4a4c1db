#!/usr/bin/env python
"""The tool-use demo: a tiny model learns, with RL, to multiply with a calculator it calls.

Three-digit by two-digit products (e.g. 417*86) are beyond a tiny character-level model's head
but not beyond its reach with a tool: it writes a calculator call, reads the tool's answer and
copies the number out. On the CPU, in the spirit of the quick start:

1. Data: products a*b, a in [100, 999], b in [10, 99], a training set and a disjoint held-out
   set, as prepared JSONL (task "arithmetic": the last number of the answer is checked).
2. Two base models, the same tiny Qwen2-architecture model (character tokenizer with
   "</tool_call>" as one token) after the same number of supervised steps:
   - "no tool": trained on prompt -> product, evaluated single-turn (what it can do in its head);
   - "tool": trained on tool-use traces, exactly the token layout the agent loop produces
     (prompt | call, mask 1 | "<tool_response>" with the tool's answer, mask 0 | product + eos,
     mask 1), evaluated with the agent loop and the real calculator.
3. RL of the "tool" base with --rollout-function agent --agent-tools calculator: RLOO, K1 in the
   reward (beta 0.05), the policy's tokens alone trained on and charged the KL.
4. Held-out accuracy (mean@k): no tool, tool before RL, tool after RL; printed, written to
   <out>/summary.json and plotted.

    python tools/agent_demo.py [--out outputs/agent_demo] [--rl-steps 30]
"""
import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPT_TEMPLATE = "{prompt}="
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
RESPONSE = "\n<tool_response>\n{result}\n</tool_response>\n"  # the agent loop's plain format


def prepare_data(out: str, train_size: int, eval_size: int) -> tuple[str, str]:
    from megatron_rl.data.records import TaskExample, write_jsonl

    train_path, eval_path = os.path.join(out, "data/train.jsonl"), os.path.join(out, "data/eval.jsonl")
    if not (os.path.exists(train_path) and os.path.exists(eval_path)):
        rng = random.Random(0)
        pairs = set()
        while len(pairs) < train_size + eval_size:
            pairs.add((rng.randint(100, 999), rng.randint(10, 99)))
        rows = [TaskExample(f"{a}*{b}", str(a * b), "arithmetic") for a, b in sorted(pairs)]
        rng.shuffle(rows)
        write_jsonl(eval_path, rows[:eval_size])
        write_jsonl(train_path, rows[eval_size:])
        print(f"[data] {train_size} training and {eval_size} held-out products (disjoint)")
    return train_path, eval_path


def build_base(out: str, name: str, train_path: str, sft_steps: int, tool: bool) -> str:
    """A tiny model after `sft_steps` supervised steps on tool-use traces (tool) or on direct
    answers, exported as HF to <out>/<name> (reused when there)."""
    from megatron_rl.data.prompts import PromptBuilder, load_tokenizer
    from megatron_rl.data.records import read_examples
    from megatron_rl.experiments.sft import warm_up
    from megatron_rl.experiments.tiny_model import make_demo_model
    from megatron_rl.parallel import destroy_distributed

    base = os.path.join(out, name)
    if os.path.exists(os.path.join(base, "model.safetensors")):
        print(f"[{name}] reusing {base}")
        return base
    init = os.path.join(out, "init")
    if not os.path.exists(os.path.join(init, "model.safetensors")):
        make_demo_model(init, special=("</tool_call>",))
    tok = load_tokenizer(init)
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    traces = []
    for ex in read_examples(train_path):
        prompt = tok(builder(ex))["input_ids"]
        answer = enc(ex.answer) + [tok.eos_token_id]
        if tool:
            call, env = enc(CALL.format(expr=ex.prompt)), enc(RESPONSE.format(result=ex.answer))
            traces.append((prompt, call + env + answer,
                           [1] * len(call) + [0] * len(env) + [1] * len(answer)))
        else:
            traces.append((prompt, answer))
    warm_up(init, base, traces, sft_steps, name=name)
    destroy_distributed()  # the next base, or the RL run, starts its own
    return base


def evaluate_weights(cfg) -> dict:
    """The trainer's evaluation of the run's starting weights (step 0), cached in
    <save>/base_eval.json."""
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/agent_demo", help="where data, models, runs go")
    p.add_argument("--sft-steps", type=int, default=500, help="supervised steps of each base")
    p.add_argument("--rl-steps", type=int, default=40, help="RL steps of the tool base")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per RL step")
    p.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    p.add_argument("--eval-interval", type=int, default=10, help="RL steps between evaluations")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out problems evaluated")
    p.add_argument("--fresh", action="store_true", help="discard a previous RL run in <out>/rl")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.time()
    train_path, eval_path = prepare_data(a.out, train_size=20000, eval_size=a.eval_prompts)
    no_tool = build_base(a.out, "base_no_tool", train_path, a.sft_steps, tool=False)
    tool = build_base(a.out, "base_tool", train_path, a.sft_steps, tool=True)

    from megatron_rl.config import parse_config
    from megatron_rl.train import train

    def config(model: str, save: str, *extra: str):
        return parse_config([
            "--hf-checkpoint", model, "--save", save, "--train-data", train_path,
            "--eval-data", eval_path, "--train-iters", str(a.rl_steps),
            "--num-prompts-per-step", str(a.prompts_per_step), "--group-size", "4",
            "--micro-batch-size", "64", "--lr", str(a.lr), "--adam-beta2", "0.99",
            "--kl-estimator", "k1", "--kl-placement", "reward", "--kl-coef", "0.05",
            "--advantage-estimator", "rloo", "--eval-interval", str(a.eval_interval),
            "--eval-samples", "4", "--save-interval", str(a.eval_interval), "--seed", "1",
            "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction", *extra])

    agent = ("--rollout-function", "agent", "--agent-tools", "calculator", "--agent-max-turns",
             "3", "--agent-max-tokens", "250", "--max-new-tokens", "80")
    head = evaluate_weights(config(no_tool, os.path.join(a.out, "eval_no_tool"),
                                   "--max-new-tokens", "8"))
    rl_dir = os.path.join(a.out, "rl")
    if a.fresh and os.path.exists(rl_dir):
        import shutil

        shutil.rmtree(rl_dir)
    cfg = config(tool, rl_dir, *agent)
    before = evaluate_weights(cfg)
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(rl_dir, "metrics.jsonl"))]
    final = [r for r in rows if "eval/mean_at_k" in r][-1]
    k = cfg.eval.eval_samples
    summary = {"no_tool": head["eval/mean_at_k"], "tool_base": before["eval/mean_at_k"],
               "tool_after_rl": final["eval/mean_at_k"], "rl_steps": final["step"],
               "eval_prompts": a.eval_prompts, "k": k,
               "turns_mean": sum(r.get("rollout/agent/turns", 0) for r in rows) / len(rows),
               "seconds": round(time.time() - t_start)}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nheld-out accuracy (mean@{k}, {a.eval_prompts} products): no tool "
          f"{summary['no_tool']:.3f}; with the calculator: base {summary['tool_base']:.3f} -> "
          f"after {final['step']} RL steps {summary['tool_after_rl']:.3f}   "
          f"(total time {summary['seconds']} s)")
    from megatron_rl.experiments.plots import plot_run

    png = plot_run(rows, os.path.join(a.out, "agent_demo.png"),
                   baseline=before["eval/mean_at_k"],
                   title=f"Tool-use demo: calculator, RLOO, K1 in the reward (no tool: "
                         f"{summary['no_tool']:.2f})")
    print(f"plot: {png}")
    return 0 if summary["tool_after_rl"] >= summary["tool_base"] else 1


if __name__ == "__main__":
    sys.exit(main())
