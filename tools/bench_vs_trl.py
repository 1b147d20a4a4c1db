#!/usr/bin/env python
"""Throughput of full RL steps (rollout + update), megatron-rl vs TRL's GRPOTrainer, on CPU or
one GPU.

Both sides train the same tiny HF Qwen2 with a character tokenizer (megatron_rl.experiments.tiny_model, the
CPU demo's architecture) on the same prompts (reasoning-gym basic_arithmetic, the demo's easy
setting, prompt "<problem>="), with the same batch (prompts x samples), max new tokens, sampling
(temperature 1, no truncation), learning rate, KL beta and objective:

    GRPO advantages (group mean / std), PPO-clip 0.2, K3 KL in the loss with beta, loss summed over
    tokens / tokens in the batch (TRL loss_type "dapo" = megatron-rl token-sum-over-batch-tokens),
    one optimizer step per rollout batch, Adam (0.9, 0.999), no weight decay, grad clip 1, fp32,
    constant learning rate.

The reward is megatron_rl.rewards.simple.score_last_number on both sides (megatron-rl scores in
its reward process pool, TRL in-process). Each side runs in its own subprocess with the same
OMP_NUM_THREADS / torch threads: megatron-rl with `python -m megatron_rl.train`'s main() (flags
below) in the project environment, TRL in its own venv (`--setup` creates it). Rounds alternate
the two sides (M T M T ...) so a slow phase of a shared machine hits both.

Measured per step, warm-up steps excluded: generated response tokens (EOS included) / wall time
of the step, from before generation to after the optimizer step (megatron-rl: its own
`throughput/tokens_per_s` metric; TRL: a callback timing on_step_begin -> on_step_end and the
completion token ids). The median over timed steps is reported, with a phase breakdown.

    python tools/bench_vs_trl.py --setup                 # once: .venv-trl with pinned TRL
    python tools/bench_vs_trl.py --out outputs/bench_vs_trl --report benchmarks/BENCH_VS_TRL.md

On one GPU (`--device cuda`, what scripts/gpu_check.sh runs): both sides in the current Python
(TRL and megatron-core from the carried wheels, `--trl-python` to change), bf16 (megatron-rl:
bf16 weights with fp32 main parameters and gradients, `--bf16`; TRL: the model loaded in bf16,
its reference model likewise, `bf16=True`), by default a Qwen2.5-0.5B-shaped model
(`--model-shape qwen2.5-0.5b`: 24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864, tied
151936-token vocabulary, random weights, a character tokenizer padded to the vocabulary) and a
larger batch (16 prompts x 8 samples x 128 new tokens, 1 round of 1 + 3 steps). A random model
never samples EOS, so every response has exactly max-new-tokens tokens on both sides. Phase
timers synchronise the device. Without reasoning-gym (not carried to GPU machines) the prompts
are two-term sums made here.

    python tools/bench_vs_trl.py --device cuda --out /tmp/bench_rl --json summary.json
    python tools/bench_vs_trl.py --device cuda --dry-run   # print the plan, parse both flag sets

Worker modes (used by the driver): --worker megatron|trl --workdir DIR.
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
PROMPT_TEMPLATE = "{prompt}="
# The TRL environment: versions resolved together on 2026-11-22 for torch 2.13.0 CPU, Python 3.11.
TRL_PINS = ["trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0"]
TORCH_PIN = "torch==2.13.0"
CUDA_LINKED = ["torchvision", "torchaudio", "torchcodec"]
# HF config overrides per --model-shape (qwen2 family, random weights)
MODEL_SHAPES = {
    "tiny": {},  # the CPU demo's architecture, sized by --hidden-size / --num-layers
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, initializer_range=0.02),
}
# defaults per device for the flags left unset: (prompts, group size, max new tokens, timed
# steps, warm-up steps, rounds, model shape, threads)
DEVICE_DEFAULTS = {"cpu": (8, 5, 32, 6, 2, 2, "tiny", 1),
                   "cuda": (16, 8, 128, 3, 1, 1, "qwen2.5-0.5b", 8)}


# ------------------------------------------------------------------------------------------------
# setup: the TRL venv
# ------------------------------------------------------------------------------------------------
def setup_trl_venv(venv: str) -> None:
    """Create `venv` with TRL and the local CPU torch; refuse a CUDA torch."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    with open(os.path.join(venv, ".gitignore"), "w") as f:
        f.write("*\n")
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    # torch first, alone: FINDINGS: torch==2.13.0 resolves to the local CPU build; any other
    # version would download a CUDA build, so TRL's requirements must find it already satisfied.
    out = subprocess.run(pip + [TORCH_PIN], check=True, capture_output=True, text=True).stdout
    print(out.strip().splitlines()[-1] if out.strip() else "torch installed")
    out = subprocess.run(pip + [TORCH_PIN, *TRL_PINS], check=True, capture_output=True,
                         text=True).stdout
    print(out.strip().splitlines()[-1] if out.strip() else "trl installed")
    if "nvidia-" in out or "+cu" in out:
        raise SystemExit("setup: pip pulled CUDA packages:\n" + out)
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", *CUDA_LINKED],
                   capture_output=True)  # absent is fine; present breaks imports beside CPU torch
    check = ("import torch, trl, transformers; assert torch.version.cuda is None, torch.__version__;"
             "print('torch', torch.__version__, 'trl', trl.__version__, "
             "'transformers', transformers.__version__)")
    subprocess.run([py, "-c", check], check=True)


# ------------------------------------------------------------------------------------------------
# inputs: model, tokenizer, data (project environment)
# ------------------------------------------------------------------------------------------------
def make_inputs(work: str, a) -> dict:
    from megatron_rl.data.prompts import PromptBuilder
    from megatron_rl.data.records import write_jsonl
    from megatron_rl.data.sources import generate_arithmetic
    from megatron_rl.experiments.tiny_model import make_char_model

    model = os.path.join(work, "model_long_tail" if a.long_tail else "model")
    shape = model_config(a)
    if not os.path.exists(os.path.join(model, "config.json")):
        make_char_model(model, **shape)  # tied, eos 1, pad 0 (CHAR_MODEL), sized by `shape`
        if a.long_tail:
            zero_eos_embedding(model)
    easy = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                allow_parentheses=False, allow_negation=False, whitespace="no_space")
    try:
        examples = generate_arithmetic(2000, 0, **easy)
    except ImportError:  # reasoning-gym is not carried to GPU machines
        examples = builtin_arithmetic(2000, 0)
    train = os.path.join(work, "train.jsonl")
    write_jsonl(train, examples)
    builder = PromptBuilder(template=PROMPT_TEMPLATE, task_instruction=False)
    trl_rows = os.path.join(work, "trl_train.jsonl")
    with open(trl_rows, "w") as f:  # the exact prompt strings megatron-rl builds
        for ex in examples:
            f.write(json.dumps({"prompt": builder(ex), "answer": ex.answer}) + "\n")
    return {"model": model, "train": train, "trl_train": trl_rows}


def zero_eos_embedding(model: str, eos_id: int = 1) -> None:
    """--long-tail: set the (tied) embedding row of EOS to zero. Its logit is then 0 at every
    step while the others are small random numbers (initialisation std 0.02): EOS comes with
    probability ~1/vocab per token, so response lengths are geometric (median ~0.69 x vocab
    tokens, a long tail cut at --max-new-tokens), the same model on both sides."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model, "model.safetensors")
    weights = load_file(path)
    weights["model.embed_tokens.weight"][eos_id] = 0.0
    save_file(weights, path, metadata={"format": "pt"})


def model_config(a) -> dict:
    """make_tiny_hf_checkpoint overrides for --model-shape."""
    if a.model_shape == "tiny":
        return dict(vocab_size=128, hidden_size=a.hidden_size, intermediate_size=3 * a.hidden_size,
                    num_hidden_layers=a.num_layers, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512 if a.long_tail else 256,
                    initializer_range=0.02)
    return dict(MODEL_SHAPES[a.model_shape])


def builtin_arithmetic(size: int, seed: int) -> list:
    """Two-term sums and differences of 1-2 digit numbers, as reasoning-gym's easy setting."""
    import random

    from megatron_rl.data.records import TaskExample

    rng = random.Random(seed)
    out = []
    for _ in range(size):
        x, y, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
        out.append(TaskExample(f"Calculate {x}{op}{y}.", str(x + y if op == "+" else x - y),
                               "arithmetic"))
    return out


# megatron-rl's sides: (rollout engine, extra flags, CPU cores of the trainer, threads). "megatron"
# is --engine with --threads on whatever cores the OS gives; "sync" and "async" put the trainer
# on core 0 and the process engine's generator on core 1, one thread each, without and with
# overlap (--async-level 1); TRL gets --trl-threads (both cores) against them.
MEGATRON_SIDES = ("megatron", "padded", "sync", "async")
SIDES = MEGATRON_SIDES + ("trl",)
# "padded": the megatron side with right-padded microbatches scored from the logits instead of
# the defaults (packed sequences, fused LM head)
PADDED_FLAGS = ["--no-sequence-packing", "--no-fused-lm-head"]


def side_flags(side: str, a) -> list[str]:
    if side == "megatron":
        return ["--rollout-engine", a.engine]
    if side == "padded":
        return ["--rollout-engine", a.engine, *PADDED_FLAGS]
    level = "1" if side == "async" else "0"
    return ["--rollout-engine", "process", "--rollout-process-cores", "1", "--async-level", level]


def side_threads(side: str, a) -> int:
    if side == "trl":
        return a.trl_threads or a.threads
    return a.threads if side in ("megatron", "padded") else 1


def megatron_flags(a, inputs: dict, save: str, side: str = "megatron") -> list[str]:
    batch = a.prompts * a.group_size
    return ["--hf-checkpoint", inputs["model"], "--train-data", inputs["train"], "--save", save,
            "--train-iters", str(a.warmup + a.steps),
            "--num-prompts-per-step", str(a.prompts), "--group-size", str(a.group_size),
            "--micro-batch-size", str(batch), "--ppo-minibatches", "1", "--ppo-epochs", "1",
            "--advantage-estimator", "grpo", "--loss-aggregation", "token-sum-over-batch-tokens",
            "--clip-low", "0.2", "--clip-high", "0.2",
            "--kl-estimator", "k3", "--kl-placement", "loss", "--kl-coef", str(a.beta),
            "--lr", str(a.lr), "--weight-decay", "0", "--clip-grad", "1.0", "--adam-beta2", "0.999",
            "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", str(a.max_new_tokens),
            "--prompt-template", PROMPT_TEMPLATE, "--no-task-instruction",
            *side_flags(side, a), "--seed", str(a.seed),
            *(["--bf16"] if a.device == "cuda" else [])]


def cpu_busy() -> dict[int, tuple[int, int]]:
    """{cpu index: (busy jiffies, total jiffies)} from /proc/stat ({} where it does not exist)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name != "cpu":
                    v = [int(x) for x in vals]
                    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
                    out[int(name[3:])] = (sum(v[:8]) - idle, sum(v[:8]))
    except OSError:
        pass
    return out


def cpu_util(before: dict, after: dict) -> dict[str, float]:
    """{"cpu/<i>": busy share of core i between two cpu_busy() readings}."""
    out = {}
    for i, (busy, total) in after.items():
        b0, t0 = before.get(i, (busy, total))
        out[f"cpu/{i}"] = (busy - b0) / (total - t0) if total > t0 else 0.0
    return out


def _sync() -> None:
    """Wait for the GPU (if any) so that wall-clock timers include the queued kernels."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# worker: megatron-rl (project environment)
# ------------------------------------------------------------------------------------------------
def run_megatron_worker(argv: list[str]) -> None:
    """megatron_rl.train.main(argv), with phase timers merged into each metrics.jsonl row."""
    import torch

    from megatron_rl import metrics_log, train
    from megatron_rl.models.policy import Policy
    from megatron_rl.rewards.scorer import RewardScorer
    from megatron_rl.rollout.local import LocalEngine

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import threading

    timers: dict[str, float] = {}
    lock = threading.Lock()
    # time only the outermost timed call of a thread: forward_backward also runs inside the
    # engine's decode steps and token_logprobs, and must not be counted twice; under
    # --async-level the rollout thread's generate runs beside the trainer's calls
    depth = threading.local()

    def timed(cls, name, key):
        fn = getattr(cls, name)

        def wrapper(*args, **kw):
            if getattr(depth, "n", 0):
                return fn(*args, **kw)
            depth.n = 1
            _sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                _sync()
                depth.n = 0
                with lock:
                    timers[key] = timers.get(key, 0.0) + time.perf_counter() - t

        setattr(cls, name, wrapper)

    timed(LocalEngine, "generate", "phase/generate")
    from megatron_rl.rollout.process import ProcessEngine
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    # engines with weights of their own: generate (a child process or HTTP), weight sync
    for engine_cls in (ProcessEngine, VLLMEngine, SGLangEngine):
        timed(engine_cls, "generate", "phase/generate")
        timed(engine_cls, "update_weights", "phase/weight_sync")
    timed(RewardScorer, "score", "phase/reward")
    # reference log-probs, plus the behaviour policy's where recomputed (--old-logprobs)
    timed(Policy, "token_logprobs", "phase/logprobs")
    timed(Policy, "forward_backward", "phase/train_forward_backward")
    timed(Policy, "step", "phase/optimizer")
    log = metrics_log.MetricsLogger.log

    last_cpu = [cpu_busy()]

    def log_with_phases(self, step, metrics):
        with lock:
            metrics.update(timers)
            timers.clear()
        now = cpu_busy()
        metrics.update(cpu_util(last_cpu[0], now))
        last_cpu[0] = now
        log(self, step, metrics)

    metrics_log.MetricsLogger.log = log_with_phases
    train.main(argv)


# ------------------------------------------------------------------------------------------------
# worker: TRL (TRL venv; imports nothing from megatron-core)
# ------------------------------------------------------------------------------------------------
def run_trl_worker(work: str, a) -> None:
    import torch
    # datasets and trl live in the TRL venv (.venv-trl), which the type checker does not read
    from datasets import Dataset  # pyright: ignore[reportMissingImports]
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportMissingImports]

    sys.path.insert(0, REPO)
    from megatron_rl.rewards.simple import score_last_number  # pure Python, no megatron import

    torch.set_num_threads(a.threads)
    inputs = json.load(open(os.path.join(work, "inputs.json")))
    rows = [json.loads(line) for line in open(inputs["trl_train"])]
    tok = AutoTokenizer.from_pretrained(inputs["model"])
    gpu = a.device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(
        inputs["model"], dtype=torch.bfloat16 if gpu else torch.float32)
    state = {"tokens": 0, "generate": 0.0, "reward": 0.0}

    def reward(completions, answer, completion_ids, **_):
        t = time.perf_counter()
        state["tokens"] += sum(len(ids) for ids in completion_ids)
        out = [score_last_number(c, g, {}).reward for c, g in zip(completions, answer)]
        state["reward"] += time.perf_counter() - t
        return out

    generate = model.generate  # pyright: ignore[reportAttributeAccessIssue] (a causal LM)

    def timed_generate(*args, **kw):
        _sync()
        t = time.perf_counter()
        try:
            return generate(*args, **kw)
        finally:
            _sync()
            state["generate"] += time.perf_counter() - t

    model.generate = timed_generate  # pyright: ignore[reportAttributeAccessIssue]
    steps_path = os.path.join(work, "trl_steps.jsonl")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            _sync()
            state.update(t0=time.perf_counter(), tokens=0, generate=0.0, reward=0.0,
                         cpu=cpu_busy())
            state["score"] = 0.0

        def on_step_end(self, args, st, control, **kw):
            _sync()
            dt = time.perf_counter() - state["t0"]
            with open(steps_path, "a") as f:
                f.write(json.dumps({"step": st.global_step, "time": dt, "tokens": state["tokens"],
                                    "tokens_per_s": state["tokens"] / dt,
                                    "phase/generate": state["generate"],
                                    "phase/reward": state["reward"],
                                    "phase/generate_and_score": state["score"],
                                    # reference log-probs, advantages, padding, bookkeeping
                                    "phase/ref_logprobs_and_rest": state["score"]
                                    - state["generate"] - state["reward"],
                                    # policy forward/backward (loss), optimizer step
                                    "phase/train_fwd_bwd_and_optimizer": dt - state["score"],
                                    **cpu_util(state["cpu"], cpu_busy())})
                        + "\n")

    class Trainer(GRPOTrainer):
        # generation + rewards + reference log-probs + advantages, for the breakdown
        def _generate_and_score_completions(self, *args, **kw):
            _sync()
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kw)
            finally:
                _sync()
                state["score"] += time.perf_counter() - t

    batch = a.prompts * a.group_size
    cfg = GRPOConfig(
        output_dir=os.path.join(work, "trl_out"), use_cpu=not gpu, bf16=gpu, fp16=False,
        max_steps=a.warmup + a.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        beta=a.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", seed=a.seed,
        dataloader_num_workers=0, disable_dropout=True, log_completions=False,
        # TRL 1.16 turns activation checkpointing on by default; megatron-rl recomputes nothing
        gradient_checkpointing=False)
    trainer = Trainer(model=model, reward_funcs=[reward], args=cfg,
                      train_dataset=Dataset.from_list(rows), processing_class=tok,
                      callbacks=[StepTimer()])
    trainer.train()


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def _env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
                HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")


def _run(cmd: list[str], env: dict, log_path: str) -> float:
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode:
        tail = open(log_path).read()[-3000:]
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n--- {log_path} ---\n{tail}")
    return time.perf_counter() - t


def run_side(side: str, round_: int, a, inputs: dict) -> dict:
    work = os.path.join(a.out, f"{side}_r{round_}")
    if os.path.exists(work):
        import shutil

        shutil.rmtree(work)
    os.makedirs(work)
    env = _env(side_threads(side, a))
    if side in MEGATRON_SIDES:
        cmd = [sys.executable, __file__, "--worker", "megatron", "--",
               *megatron_flags(a, inputs, work, side)]
        if side in ("sync", "async"):  # the trainer on core 0 (its generator pins itself to core 1)
            cmd = ["taskset", "-c", "0", *cmd]
        wall = _run(cmd, env, os.path.join(work, "log.txt"))
        rows = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
        steps = [{"tokens_per_s": r["throughput/tokens_per_s"],
                  "time": r["time/step"],
                  **{k: v for k, v in r.items() if k.startswith(("phase/", "time/", "cpu/"))}}
                 for r in rows]
    else:
        with open(os.path.join(work, "inputs.json"), "w") as f:
            json.dump(inputs, f)
        cmd = [trl_python(a), __file__, "--worker", "trl", "--workdir", work,
               *_shared_argv(a, side_threads(side, a))]
        wall = _run(cmd, env, os.path.join(work, "log.txt"))
        steps = [json.loads(line) for line in open(os.path.join(work, "trl_steps.jsonl"))]
    if len(steps) != a.warmup + a.steps:
        raise SystemExit(f"{side}: {len(steps)} steps logged, expected {a.warmup + a.steps}")
    return {"side": side, "round": round_, "wall_s": wall, "cmd": cmd, "timed": steps[a.warmup:]}


def _shared_argv(a, threads: int | None = None) -> list[str]:
    return ["--prompts", str(a.prompts), "--group-size", str(a.group_size),
            "--max-new-tokens", str(a.max_new_tokens), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--threads", str(threads or a.threads), "--lr", str(a.lr),
            "--beta", str(a.beta), "--seed", str(a.seed), "--device", a.device]


def trl_python(a) -> str:
    """The interpreter of the TRL side: --trl-python, else the TRL venv's on CPU and the current
    one on GPU (the GPU kit installs TRL beside megatron-core)."""
    if a.trl_python:
        return a.trl_python
    return sys.executable if a.device == "cuda" else os.path.join(a.trl_venv, "bin", "python")


def _versions(trl_py: str | None) -> dict:
    code = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
            "['torch', 'transformers', 'trl', 'accelerate', 'datasets', 'megatron-core'] "
            "if __import__('importlib.util').util.find_spec(p.replace('-', '.').split('.')[0])}))")
    out = {}
    for name, py in (("megatron-rl env", sys.executable), ("TRL env", trl_py)):
        if py is None:
            continue
        res = subprocess.run([py, "-c", code], capture_output=True, text=True)
        out[name] = json.loads(res.stdout) if res.returncode == 0 else res.stderr[-300:]
    return out


def _cpu() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        keep = ("Model name", "CPU(s):", "Thread(s) per core", "L3 cache")
        return "; ".join(" ".join(l.split()) for l in lines if l.strip().startswith(keep))
    except OSError:
        return platform.processor()


def summarize(results: list[dict], a) -> dict:
    by_side = {}
    for side in [x for x in SIDES if any(r["side"] == x for r in results)]:
        steps = [s for r in results if r["side"] == side for s in r["timed"]]
        tps = [s["tokens_per_s"] for s in steps]
        phases = sorted({k for s in steps for k in s if k.startswith(("phase/", "cpu/"))})
        by_side[side] = {
            "threads": side_threads(side, a),
            "median_tokens_per_s": statistics.median(tps), "min": min(tps), "max": max(tps),
            "n_steps": len(tps), "median_step_s": statistics.median(s["time"] for s in steps),
            "phases_median_s": {p: statistics.median(s.get(p, 0.0) for s in steps) for p in phases
                                if p.startswith("phase/")},
            "cpu_util_mean": {p: statistics.mean(s.get(p, 0.0) for s in steps) for p in phases
                              if p.startswith("cpu/")},
            "per_round_median": [statistics.median(s["tokens_per_s"] for s in r["timed"])
                                 for r in results if r["side"] == side],
            "wall_s": [round(r["wall_s"], 1) for r in results if r["side"] == side]}
    out = {"config": {k: getattr(a, k) for k in ("prompts", "group_size", "max_new_tokens",
                                                 "steps", "warmup", "rounds", "threads",
                                                 "trl_threads", "lr", "beta", "seed",
                                                 "hidden_size", "num_layers", "engine", "device",
                                                 "model_shape", "sides", "long_tail")},
           "sides": by_side}
    trl = by_side.get("trl")
    for side in MEGATRON_SIDES:
        if side in by_side and trl:
            key = ("ratio_megatron_over_trl" if side == "megatron"
                   else f"ratio_{side}_over_trl")
            out[key] = by_side[side]["median_tokens_per_s"] / trl["median_tokens_per_s"]
    if "sync" in by_side and "async" in by_side:
        out["overlap"] = overlap_analysis(by_side["sync"], by_side["async"])
    return out


def overlap_analysis(sync: dict, asyn: dict) -> dict:
    """The issue's goal for --async-level 1: the async step <= 1.1 x max(generation, the rest)
    of the sync step's phases (the ideal overlap), from medians."""
    step = sync["median_step_s"]
    gen = sync["phases_median_s"].get("phase/generate", 0.0)
    rest = step - gen
    ideal = max(gen, rest)
    return {"sync_step_s": step, "sync_generate_s": gen, "sync_rest_s": rest,
            "generate_share_of_sync_step": gen / step if step else 0.0,
            "ideal_async_step_s": ideal, "async_step_s": asyn["median_step_s"],
            "async_over_ideal": asyn["median_step_s"] / ideal if ideal else float("nan"),
            "async_speedup_over_sync": step / asyn["median_step_s"],
            "goal_met": asyn["median_step_s"] <= 1.1 * ideal}


def markdown(summary: dict) -> str:
    """The result as a table (tokens/s per side, phases, core utilisation)."""
    sides = summary["sides"]
    cpus = sorted({c for d in sides.values() for c in d["cpu_util_mean"]},
                  key=lambda c: int(c.split("/")[1]))
    head = ("| side | threads | tokens/s median (min-max) | step s | generate s | "
            + " | ".join(f"core {c.split('/')[1]} busy" for c in cpus) + " |")
    lines = [head, "|" + "---|" * (5 + len(cpus))]
    for side, d in sides.items():
        util = " | ".join(f"{d['cpu_util_mean'].get(c, 0.0):.0%}" for c in cpus)
        gen = d["phases_median_s"].get("phase/generate", 0.0)
        lines.append(f"| {side} | {d['threads']} | {d['median_tokens_per_s']:.0f} "
                     f"({d['min']:.0f}-{d['max']:.0f}) | {d['median_step_s']:.3f} | {gen:.3f} | "
                     f"{util} |")
    for key, v in summary.items():
        if key.startswith("ratio_"):
            lines.append(f"\n{key}: {v:.2f}x")
    ov = summary.get("overlap")
    if ov:
        lines.append(f"\nsync step {ov['sync_step_s']:.3f} s = generate {ov['sync_generate_s']:.3f}"
                     f" ({ov['generate_share_of_sync_step']:.0%}) + rest {ov['sync_rest_s']:.3f}; "
                     f"ideal async {ov['ideal_async_step_s']:.3f} s, measured "
                     f"{ov['async_step_s']:.3f} s = {ov['async_over_ideal']:.2f}x ideal "
                     f"(goal <= 1.10x: {'met' if ov['goal_met'] else 'not met'}), "
                     f"{ov['async_speedup_over_sync']:.2f}x sync")
    return "\n".join(lines)


def dry_run(a) -> int:
    """Print what would run; parse megatron-rl's flags with its own parser (no model is built)."""
    from megatron_rl.config import parse_config

    inputs = {"model": os.path.join(a.out, "model"), "train": os.path.join(a.out, "train.jsonl")}
    flags = megatron_flags(a, inputs, os.path.join(a.out, "megatron_r0"))
    parse_config(flags)  # raises on a flag megatron-rl does not know
    print(f"model {a.model_shape}: {model_config(a)}")
    print(f"batch {a.prompts} prompts x {a.group_size} samples x {a.max_new_tokens} new tokens, "
          f"{a.rounds} round(s) of {a.warmup} + {a.steps} steps per side, device {a.device}")
    print(f"megatron-rl: python -m megatron_rl.train {' '.join(flags)}")
    print("  (these flags parse with megatron_rl.config.parse_config)")
    print(f"TRL: {trl_python(a)} {__file__} --worker trl {' '.join(_shared_argv(a))}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setup", action="store_true", help="create the TRL venv and exit")
    p.add_argument("--trl-venv", default=os.path.join(REPO, ".venv-trl"))
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "bench_vs_trl"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES),
                   help="default: tiny on CPU, qwen2.5-0.5b on CUDA")
    p.add_argument("--trl-python", help="interpreter of the TRL side (see trl_python)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and check megatron-rl's flags parse; run nothing")
    p.add_argument("--prompts", type=int, help="prompts per step (CPU 8, CUDA 16)")
    p.add_argument("--group-size", type=int, help="samples per prompt (CPU 5, CUDA 8)")
    p.add_argument("--max-new-tokens", type=int, help="CPU 32, CUDA 128")
    p.add_argument("--steps", type=int, help="timed steps per round (CPU 6, CUDA 3)")
    p.add_argument("--warmup", type=int, help="untimed steps at the start of each run (CPU 2, "
                   "CUDA 1)")
    p.add_argument("--rounds", type=int, help="alternating runs per side (CPU 2, CUDA 1)")
    p.add_argument("--threads", type=int, help="OMP / torch threads, both sides (CPU 1, CUDA 8)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (K3 in the loss)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--engine", choices=["local", "vllm", "sglang"], default="local",
                   help="the 'megatron' side's rollout engine (servers need their venv, "
                   "docs/rollout.md)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=["megatron", "trl"],
                   help="what runs, in this order each round: megatron (--engine, --threads), "
                   "sync / async (trainer on core 0, process engine on core 1, --async-level "
                   "0 / 1), trl (--trl-threads)")
    p.add_argument("--trl-threads", type=int, help="TRL's threads (default --threads)")
    p.add_argument("--long-tail", action="store_true",
                   help="tiny model whose EOS embedding is zero: geometric (long-tailed) "
                   "response lengths instead of always --max-new-tokens")
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--worker", choices=["megatron", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    names = ("prompts", "group_size", "max_new_tokens", "steps", "warmup", "rounds", "model_shape",
             "threads")
    for name, default in zip(names, DEVICE_DEFAULTS[a.device]):
        if getattr(a, name) is None:
            setattr(a, name, default)
    if a.dry_run:
        return dry_run(a)
    if a.worker == "megatron":
        run_megatron_worker([x for x in a.rest if x != "--"])
        return 0
    if a.worker == "trl":
        run_trl_worker(a.workdir, a)
        return 0
    if a.setup:
        setup_trl_venv(a.trl_venv)
        return 0
    if "trl" in a.sides and not os.path.exists(trl_python(a)):
        raise SystemExit(f"no TRL venv at {a.trl_venv}: run `python {__file__} --setup` first")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    inputs = make_inputs(a.out, a)
    results = []
    for r in range(a.rounds):
        for side in a.sides:
            res = run_side(side, r, a, inputs)
            med = statistics.median(s["tokens_per_s"] for s in res["timed"])
            print(f"round {r} {side:8s}: median {med:8.1f} tokens/s over {len(res['timed'])} "
                  f"steps (process wall {res['wall_s']:.0f} s)", flush=True)
            results.append(res)
    summary = summarize(results, a)
    summary["commands"] = {res["side"]: " ".join(res["cmd"]) for res in results[:len(a.sides)]}
    summary["versions"] = _versions(trl_python(a) if "trl" in a.sides else None)
    summary["cpu"] = _cpu()
    if a.device == "cuda":
        import torch

        summary["gpu"] = torch.cuda.get_device_name()
    summary["python"] = platform.python_version()
    text = json.dumps(summary, indent=2)
    print(text)
    with open(a.json or os.path.join(a.out, "summary.json"), "w") as f:
        f.write(text + "\n")
    print("\n" + markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
