#!/usr/bin/env python
"""The tool-use demo: RL teaches a tiny model to use the calculator it was shown using badly.

Three-digit by two-digit products (e.g. 417*86) are beyond a tiny character-level model's head
but not beyond its reach with a tool: it writes a calculator call, reads the tool's answer and
copies the number out. On the CPU, in the spirit of the quick start:

1. Data: products a*b, a in [100, 999], b in [10, 99], a training set and a disjoint held-out
   set, as prepared JSONL (task "arithmetic": the last number of the answer is checked).
2. A base model: the quick start's tiny Qwen2-architecture model (character tokenizer; the
   call's fixed opening, "</tool_call>" and the tool-response tags one token each) after a
   supervised warm-up on a careless teacher's traces, laid out exactly as the agent loop lays
   out its episodes (the tool's response has mask 0; each trace's tool response is the real
   calculator's answer to the call written). The teacher, per problem:
   - HEAD (40%): answers from its head, without the tool (a product with one digit wrong);
   - MISCOPY (35%): calls the calculator with one operand digit copied wrong, copies its answer;
   - the rest (25%): the right call, the tool's answer copied out.
   So the base model calls the tool on some problems and answers from its head on others, and
   copies operands wrongly: RL, rewarded for the right product alone, has both to unlearn (and
   whatever calls of its own do not parse: the plot shows their share).
3. RL with --rollout-function agent --agent-tools calculator (the real tool, the real agent
   loop): RLOO, 5 episodes per prompt, K1 in the reward (beta 0.05), the policy's tokens alone
   trained on and charged the KL.
4. Held-out accuracy (mean@k) before and after RL on the same problems with the same sampling
   seeds, the gain with its 95% interval (paired over the problems); plotted over the RL steps
   with the share of episodes that call the tool, the share of calls that parse and the turns
   per episode; all in <out>/summary.json.

    python tools/agent_demo.py [--out outputs/agent_demo] [--seed 1] [--rl-steps 60]
"""
import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_demo import (_stamp, _stamped, discard_stale_run, gain_line,  # noqa: E402
                      held_out_scores, mean, paired_gain, read_rows)

PROMPT_TEMPLATE = "{prompt}="
# the call up to its argument, one token of the tokenizer; the argument and '"}}\n' are written
# character by character, then "</tool_call>" (one token) ends the policy's turn
CALL_OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}\n'
SPECIAL_TOKENS = (CALL_OPEN, "</tool_call>", "<tool_response>", "</tool_response>")
# the careless teacher's shares of traces (the rest: the right call, its answer copied out)
TEACHER = {"head": 0.4, "miscopy": 0.35}
# what a run prints on a 2-core x86 machine (docs/agent.md: 3 seeds)
EXPECTED = ("base 0.30-0.35 -> after 0.86-0.91, gain +0.52 to +0.59 (21-34 standard errors); in "
            "the plot the share of episodes that call the tool rises to 1.0 within 20 steps")


def prepare_data(out: str, train_size: int, eval_size: int) -> tuple[str, str]:
    from megatron_rl.data.records import TaskExample, write_jsonl

    data = os.path.join(out, "data")
    train_path, eval_path = os.path.join(data, "train.jsonl"), os.path.join(data, "eval.jsonl")
    settings = {"train_size": train_size, "eval_size": eval_size}
    if not _stamped(data, settings):
        os.makedirs(data)
        rng = random.Random(0)
        pairs = set()
        while len(pairs) < train_size + eval_size:
            pairs.add((rng.randint(100, 999), rng.randint(10, 99)))
        rows = [TaskExample(f"{a}*{b}", str(a * b), "arithmetic") for a, b in sorted(pairs)]
        rng.shuffle(rows)
        write_jsonl(eval_path, rows[:eval_size])
        write_jsonl(train_path, rows[eval_size:])
        _stamp(data, settings)
        print(f"[data] {train_size} training and {eval_size} held-out products (disjoint)")
    return train_path, eval_path


def _wrong_digit(number: str, rng: random.Random) -> str:
    """`number` with one digit replaced by another (never a leading zero)."""
    i = rng.randrange(len(number))
    digits = [d for d in "0123456789" if d != number[i] and (i or d != "0")]
    return number[:i] + rng.choice(digits) + number[i + 1:]


def teacher_trace(a: int, b: int, rng: random.Random) -> tuple[str, list[str | None]]:
    """The careless teacher's behaviour on a*b (one of TEACHER's, or "right") and its turns: the
    answer alone, or a call and None (the tool's answer, copied out, is the second turn)."""
    kind = rng.choices([*TEACHER, "right"], [*TEACHER.values(), 1 - sum(TEACHER.values())])[0]
    head = _wrong_digit(str(a * b), rng)
    if kind == "head":
        return kind, [head]
    x, y = str(a), str(b)
    if kind == "miscopy":
        if rng.random() < 0.5:
            x = _wrong_digit(x, rng)
        else:
            y = _wrong_digit(y, rng)
    return kind, [f"{CALL_OPEN}{x}*{y}{CALL_CLOSE}</tool_call>", None]


def build_base(out: str, train_path: str, sft_steps: int, seed: int) -> str:
    """The tiny model after `sft_steps` supervised steps on the careless teacher's traces
    (seeded by `seed`: initial weights, teacher, batches), exported as HF to <out>/base."""
    from megatron_rl.agent.calculator import calculator_tool
    from megatron_rl.agent.loop import ChatFormat
    from megatron_rl.agent.parsing import parse_tool_calls
    from megatron_rl.agent.tools import ToolRegistry, execute_tool_call
    from megatron_rl.data.prompts import PromptBuilder, load_tokenizer
    from megatron_rl.data.records import read_examples
    from megatron_rl.experiments.sft import warm_up
    from megatron_rl.experiments.tiny_model import make_demo_model
    from megatron_rl.parallel import destroy_distributed

    base = os.path.join(out, "base")
    settings = {"sft_steps": sft_steps, "seed": seed, "teacher": TEACHER,
                "special_tokens": list(SPECIAL_TOKENS)}
    if _stamped(base, settings) and os.path.exists(os.path.join(base, "model.safetensors")):
        print(f"[base] reusing {base}")
        return base
    init = os.path.join(out, "init")
    make_demo_model(init, special=SPECIAL_TOKENS, seed=seed)
    tok = load_tokenizer(init)
    fmt = ChatFormat(tok)
    tools = ToolRegistry([calculator_tool()])
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rng = random.Random(seed)
    traces, kinds = [], {}
    for ex in read_examples(train_path):
        a, b = map(int, ex.prompt.split("*"))
        kind, turns = teacher_trace(a, b, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        ids, mask = [], []
        if len(turns) == 2:  # a call, the tool's answer (mask 0), then that answer copied out
            call = enc(turns[0])
            result = execute_tool_call(tools, parse_tool_calls(turns[0])[0])
            env = fmt.encode_after_turn([result.text], call[-1])
            ids, mask = call + env, [1] * len(call) + [0] * len(env)
            turns = [result.text]
        answer = enc(turns[0]) + [tok.eos_token_id]
        traces.append((tok(builder(ex))["input_ids"], ids + answer, mask + [1] * len(answer)))
    print("[base] the teacher's traces: " + ", ".join(f"{k} {v / len(traces):.0%}"
                                                      for k, v in sorted(kinds.items())))
    warm_up(init, base, traces, sft_steps, lr=2e-3, lr_decay_style="cosine", seed=seed)
    destroy_distributed()  # the RL run starts its own
    _stamp(base, settings)
    return base


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="outputs/agent_demo", help="where data, models, runs go")
    p.add_argument("--seed", type=int, default=1, help="seeds the base model and the RL run")
    p.add_argument("--sft-steps", type=int, default=600, help="supervised warm-up steps")
    p.add_argument("--rl-steps", type=int, default=60, help="RL steps")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per RL step")
    p.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    p.add_argument("--eval-interval", type=int, default=10, help="RL steps between evaluations")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out problems")
    p.add_argument("--eval-samples", type=int, default=8, help="episodes per held-out problem")
    p.add_argument("--fresh", action="store_true", help="discard a previous RL run in <out>/rl")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.time()
    train_path, eval_path = prepare_data(a.out, train_size=20000, eval_size=a.eval_prompts)
    base = build_base(a.out, train_path, a.sft_steps, a.seed)
    t_base = time.time()

    from megatron_rl.config import parse_config
    from megatron_rl.train import train

    cfg = parse_config([
        "--hf-checkpoint", base, "--save", os.path.join(a.out, "rl"),
        "--train-data", train_path, "--eval-data", eval_path, "--train-iters", str(a.rl_steps),
        "--num-prompts-per-step", str(a.prompts_per_step), "--group-size", "5",
        "--micro-batch-size", "80", "--lr", str(a.lr), "--adam-beta2", "0.99",
        "--lr-warmup-iters", "5",
        "--kl-estimator", "k1", "--kl-placement", "reward", "--kl-coef", "0.05",
        "--advantage-estimator", "rloo", "--eval-interval", str(a.eval_interval),
        "--eval-samples", str(a.eval_samples), "--save-interval", str(a.eval_interval),
        "--seed", str(a.seed), "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction",
        "--rollout-function", "agent", "--agent-tools", "calculator", "--agent-max-turns", "3",
        "--agent-max-tokens", "200", "--max-new-tokens", "16"])
    discard_stale_run(cfg, a.fresh)
    before = held_out_scores(cfg, "base_eval.json")
    train(cfg)
    after = held_out_scores(cfg, f"eval_{a.rl_steps}.json")
    t_end = time.time()
    rows = read_rows(cfg)
    for r in rows:  # the share of calls that parse, from the per-episode means
        if r.get("rollout/agent/tool_calls"):
            r["agent/calls_parsed"] = 1 - (r.get("rollout/agent/tool_unparseable_call", 0.0)
                                           / r["rollout/agent/tool_calls"])
    gain, se = paired_gain(before, after)
    summary = {"seed": a.seed, "base": mean(before), "after": mean(after), "gain": gain,
               "se": se, "rl_steps": a.rl_steps, "eval_prompts": len(before),
               "k": cfg.eval.eval_samples, "seconds": round(t_end - t_start),
               "seconds_base": round(t_base - t_start)}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nheld-out accuracy with the calculator (mean@{summary['k']}, {len(before)} products): "
          f"base {mean(before):.3f} -> after {a.rl_steps} RL steps {mean(after):.3f}\n"
          f"{gain_line(gain, se)}\n"
          f"time {t_end - t_start:.0f} s ({t_base - t_start:.0f} s data and base model)\n"
          f"expected on a 2-core x86 machine: {EXPECTED}")
    from megatron_rl.experiments.plots import plot_run

    png = plot_run(rows, os.path.join(a.out, "agent_demo.png"), baseline=mean(before),
                   panels=("reward/mean", "eval/mean_at_k", "rollout/agent/called_tools",
                           "agent/calls_parsed", "rollout/agent/turns", "kl_k1"),
                   title="Tool-use demo: calculator, RLOO, K1 in the reward (beta 0.05)")
    print(f"plot: {png}")
    return 0 if gain - 1.96 * se > 0 else 1  # status 1: no gain beyond noise


if __name__ == "__main__":
    sys.exit(main())
