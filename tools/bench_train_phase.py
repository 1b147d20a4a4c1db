#!/usr/bin/env python
"""Benchmark: the training phase of one RL step, packed rows + fused LM head against padded rows
+ logits.

The trainer has two layouts (megatron_rl/update.py):
  packed+fused   --sequence-packing --fused-lm-head (the defaults): packing.Layout packs a
                 microbatch's sequences into one row of <= --max-tokens-per-microbatch tokens
                 (THD attention), log-probs / entropy / KL come from the final hidden states
                 (ops.lm_head), no [N, V] logits
  padded+logits  --no-sequence-packing --no-fused-lm-head: microbatches of --micro-batch-size
                 sequences right-padded to the batch's longest, scored from the logits
and with --all-combos also packed+logits and padded+fused.

Models (--model, SHAPES): Qwen2.5-0.5B's shape (hidden 896, 14 heads / 2 KV heads, head dim
64, FFN 4864, 24 layers) and Qwen2.5-1.5B's (hidden 1536, 12 heads / 2 KV heads, head dim 128,
FFN 8960, 28 layers), both with a tied 151936-token vocabulary, random weights (megatron-core's
initialisation, std 0.02); --num-layers overrides the layer count (fewer keep a 2-core CPU run
short: the layer count is printed and written with the results). The reference model is a copy
of the policy's initial weights, as the trainer makes it. No tokenizer: the prompts and
responses are token ids drawn here.

Rollouts (synthesised, not generated): --num-sequences sequences in groups of --group-size (one
prompt per group); prompts of --prompt-len +- 25% uniformly random tokens; response lengths from
a log-normal with median --max-response / 4 and sigma --length-sigma, clipped to [8,
--max-response], random tokens; rewards 0/1 at random; rollout log-probs are 0 placeholders
(never used: the behaviour policy's log-probs are recomputed, --old-logprobs recompute). Step k
of a configuration trains on the batch drawn from seed + k, so every configuration sees the
same batches.

What runs is the trainer's own code: the policy, the reference and a TrainConfig (no engine,
data, tokenizer or scorer: train_on_batch takes none of them), the old log-probs as update.behaviour_logprobs computes them
(`policy.token_logprobs(batch.tokens, update.layout(cfg), seq_lengths=...)`, reproduced: that
one line, without the mismatch metrics), then `update.train_on_batch` itself: reference
log-probs (update.score_reference_exact for the exact estimator), advantages, forward+backward
through Policy.forward_backward with update.make_rl_loss_fn, the optimizer step (Adam's state is
allocated before timing by one step on zero gradients, which changes no weight, so the timed
step is a steady-state one, not the first of a run). Phases are timed
by wrapping the Policy objects' methods (outermost call only: token_logprobs runs
forward_backward inside):
  old_lp     policy.token_logprobs (the behaviour policy's recompute)
  ref_lp     reference.token_logprobs; with the exact estimator score_reference_exact's one pass
             of the policy and the reference together (policy.collect_per_token)
  fwd_bwd    policy.forward_backward of the PPO update (with the exact KL in the loss the
             reference's forward runs inside it)
  optim      policy.step (megatron's Adam, gradient clipping)
  other      the rest of train_on_batch: advantages, microbatch assembly, metrics
Tokens/s: response tokens (and all tokens, prompt + response, no padding) of the timed steps /
their phase time. Each configuration runs in a subprocess of its own (peak RSS =
getrusage's ru_maxrss, monotone per process: the whole process, model and optimizer state
included), one thread count for all.

The project's two goals for the training phase (on one H200, long-tailed response lengths up
to 4096), each reported per --max-response and KL family as met or missed and by how much:
  ratio  packed+fused / padded+logits tokens/s >= GOAL_RATIO (1.5x) (the same batches, so the
         response and all-token ratios are equal);
  MFU    the packed+fused path's MFU >= MFU_GOAL (35%) at the Qwen2.5-1.5B shape (--model
         qwen2.5-1.5b with no shape overrides: a run with fewer layers or another width says
         so instead; the MFU is against the peak named beside it, a measured matmul rate on a
         CPU).

--find-max-tokens: per path, the largest microbatch one forward+backward fits in
--mem-limit-gib (default: the GPU's memory where one is used, else 24), the whole process counted (policy + main grads + Adam state,
materialised by one optimizer step on zero gradients first, + reference + the microbatch's
activations): microbatches of L x 2^k tokens (L: prompt + --max-response, the padded width;
padded: 2^k sequences of that length; packed: synthesised sequences first-fit into one row of at
most that many tokens), each in its own subprocess, doubling until one fails. The limit is
capped at this machine's available memory - 1 GiB (so a run cannot take the machine down) and
enforced twice: RLIMIT_AS (the limit + the process's non-resident address space + 2 GiB) turns
a huge allocation into a clean error, and a watchdog thread ends the process (exit 75) when its
RSS passes the limit. "fits" means it finished with peak RSS <= the limit. The same guard
protects the main benchmark's subprocesses.

Model FLOPs and MFU (per configuration: model FLOPs per step, tokens/s, model TFLOP/s and MFU,
after --warmup untimed steps, 1 by default on a GPU). The model's work, counted over the real
tokens only (padding and recomputation are the run's cost, not the model's):
  N = layers x (h (q + 2 kv) + q h + 3 h f) + h V     matmul weights a token meets (q/k/v, o,
      SwiGLU MLP; the LM head once: the tied embedding's lookup is no matmul; biases and norms
      left out), h hidden, q = heads x head dim, kv = KV heads x head dim, f FFN, V vocabulary
  forward, per sequence of n tokens:  F(n) = 2 N n + layers x 2 q n (n + 1)
      a multiply-add is 2 FLOPs: 2 N per token; causal attention, per layer: query i (1..n)
      scores i keys (QK^T: 2 q i over all heads) and sums i values (PV: 2 q i), and
      sum_i 4 q i = 2 q n (n + 1) ~ 2 q n^2 = 2 x 2 x q x n^2 / 2 (half the full n x n square)
  backward = 2 x forward: every matmul has an input gradient and a weight gradient (attention:
      dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q against the forward's QK^T and PV), so
      forward + backward = 3F = 6 N D + 6 q layers sum_i n_i (n_i + 1) over D = sum_i n_i tokens
  one step (model_flops): old log-probs F + reference log-probs F (the exact estimator: the
      policy's and the reference's forward together, 2F) + per PPO epoch the update's 3F
      (+ F: the reference's forward inside it, with the exact KL in the loss); K1 / K3: 5F per
      step, F summed over the batch's sequences
  MFU = model FLOPs per step / step seconds / peak. The peak (peak_tflops): --peak-tflops, else
      a GPU's dense bf16 tensor-core peak from NVIDIA's data sheets (DENSE_BF16_TFLOPS: H100 /
      H200 SXM 989, H100 / H200 NVL 835, H100 PCIe 756, A100 312; the sheets' larger figures are
      "with sparsity"), else the best rate of a 1024^3 (CPU) or 8192^3 (GPU not in the table)
      matmul measured in the worker itself, in the model's dtype and thread count, so that on a
      CPU MFU is the same ratio: the share of the process's own matmul rate the step gets.
The run's FLOPs (step_flops, an estimate: --dry-run's minutes and the "run GFLOP/s" column)
count what is executed instead: padded rows of L and packed rows with their padding, the fused
head's logits recomputed in backward (+1 head matmul, +1 for the reference's under the exact KL
in the loss).

Usage:
  python tools/bench_train_phase.py --bf16 --model qwen2.5-0.5b qwen2.5-1.5b \\
      --max-response 4096 --num-sequences 64 --micro-batch-size 2 --kl k3:loss   # a GPU
  OMP_NUM_THREADS=2 python tools/bench_train_phase.py --threads 2 --num-layers 4 \\
      --max-response 1024 --num-sequences 32 --group-size 8 --micro-batch-size 4 \\
      --kl k1:reward k3:loss exact:reward+loss --out benchmarks/RESULTS.md --json tp1024.json
  OMP_NUM_THREADS=2 python tools/bench_train_phase.py --threads 2 --num-layers 4 \\
      --find-max-tokens --max-response 1024 --mem-limit-gib 24 --out benchmarks/RESULTS.md
  OMP_NUM_THREADS=1 python tools/bench_train_phase.py --num-layers 1 --hidden-size 64 \\
      --vocab 1000 --max-response 32 --num-sequences 4 --group-size 2      # smoke test
  python tools/bench_train_phase.py --dry-run --gflops 80 ...   # layouts, FLOPs, minutes
A worker's result and log stay in --workdir (<tag>.json / <tag>.log) as soon as it ends; a
worker that fails is recorded ("failed", "oom", "over_limit", "killed") and the others run.

Worker modes (used by the driver): --worker train|fit --result-file FILE.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import random
import resource
import shlex
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, REPO)

import bench_vs_trl as bvt  # noqa: E402  (standard library only at import)

# path name -> (sequence packing, fused LM head)
COMBOS = {"packed+fused": (True, True), "padded+logits": (False, False),
          "packed+logits": (True, False), "padded+fused": (False, True)}
MAIN_COMBOS = ("packed+fused", "padded+logits")
PHASES = ("old_lp", "ref_lp", "fwd_bwd", "optim", "other")
GOAL_RATIO = 1.5  # goal: packed+fused / padded+logits training tokens/s at least this
MFU_GOAL = 0.35  # goal: the packed+fused training phase's MFU at least this ...
MFU_GOAL_MODEL, MFU_GOAL_COMBO = "qwen2.5-1.5b", "packed+fused"  # ... at this shape, this path
EXIT_OVER_LIMIT = 75  # the watchdog's exit status
GIB = 1 << 30
CPU_DEFAULT_LIMIT_GIB = 24.0  # --mem-limit-gib on a CPU (on a GPU: all of its memory)
PAD_ID = 0
FIRST_TOKEN = 3  # token ids drawn from [3, vocab): 0-2 are the character tokenizer's specials
# the benchmarked shapes (HF config fields; random weights): Qwen2.5's, tied embeddings
SHAPES = {
    "qwen2.5-0.5b": bvt.MODEL_SHAPES["qwen2.5-0.5b"],
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, initializer_range=0.02),
}
# dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's data sheets (which
# quote twice these "with sparsity"); the first name contained in torch's device name applies
DENSE_BF16_TFLOPS = (("H200 NVL", 835.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
                     ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


# ------------------------------------------------------------------------------------------------
# the model and the synthesised rollouts
# ------------------------------------------------------------------------------------------------
def model_config(a, model: str | None = None) -> dict:
    """HF config dict of a benchmarked model (`model`, default the first --model): its shape
    with the overrides. A smaller --hidden-size keeps the shape's head dim (64 for 0.5B, 128
    for 1.5B) and FFN ratio unless heads / FFN are given; --num-layers replaces the shape's."""
    shape = dict(SHAPES[model or a.model[0]])
    hidden = a.hidden_size or shape["hidden_size"]
    if a.hidden_size:
        head_dim = shape["hidden_size"] // shape["num_attention_heads"]
        ratio = shape["intermediate_size"] / shape["hidden_size"]
        shape["num_attention_heads"] = max(1, hidden // head_dim)
        shape["num_key_value_heads"] = 1 if shape["num_attention_heads"] < 2 else 2
        shape["intermediate_size"] = round(hidden * ratio)
    shape.update(hidden_size=hidden,
                 num_hidden_layers=a.num_layers or shape["num_hidden_layers"])
    for key, flag in (("vocab_size", a.vocab), ("intermediate_size", a.ffn_hidden_size),
                      ("num_attention_heads", a.num_heads),
                      ("num_key_value_heads", a.num_kv_heads)):
        if flag:
            shape[key] = flag
    if hidden % shape["num_attention_heads"] or (
            shape["num_attention_heads"] % shape["num_key_value_heads"]):
        raise ValueError(f"--hidden-size {hidden}, --num-heads {shape['num_attention_heads']}, "
                         f"--num-kv-heads {shape['num_key_value_heads']}: heads must divide the "
                         "hidden size and KV heads the heads")
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
            "eos_token_id": 1, "pad_token_id": PAD_ID, **shape}


def model_args(a, model: str | None = None):
    from megatron_rl.models import ModelArgs

    return ModelArgs.from_hf_config(model_config(a, model),
                                    source="bench_train_phase model_config")


def synth_rollouts(num_sequences: int, group_size: int, max_response: int, prompt_len: int,
                   vocab: int, sigma: float, seed: int, force_max: bool = False):
    """(prompt ids per group, Completion lists per group, flat rewards [num_sequences]).
    force_max: the first sequence is the longest possible (prompt_len + 25%, max_response
    tokens): the batch's padded width L is then that of the worst case."""
    from megatron_rl.rollout.base import Completion

    if num_sequences % group_size:
        raise ValueError(f"--num-sequences {num_sequences} must be a multiple of --group-size "
                         f"{group_size}")
    rng = random.Random(seed)
    lo, hi = max(1, round(0.75 * prompt_len)), max(1, round(1.25 * prompt_len))
    mu = math.log(max_response / 4)
    prompts, groups, rewards = [], [], []
    for _ in range(num_sequences // group_size):
        n = hi if force_max and not groups else rng.randint(lo, hi)
        prompts.append([rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)])
        group = []
        for _ in range(group_size):
            n = min(max_response, max(min(8, max_response),
                                       round(rng.lognormvariate(mu, sigma))))
            if force_max and not groups and not group:
                n = max_response
            group.append(Completion([rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)],
                                    [0.0] * n, "length" if n == max_response else "stop"))
            rewards.append(float(rng.random() < 0.5))
        groups.append(group)
    return prompts, groups, rewards


def make_batch(a, max_response: int, seed: int, num_sequences: int | None = None,
               group_size: int | None = None, force_max: bool = False):
    """The RolloutBatch of step seed (on the host), as the rollout layer packs it."""
    from megatron_rl.batch import pack_rollouts
    from megatron_rl.rollout.single_turn import single_turn_groups

    vocab = model_config(a)["vocab_size"]
    prompts, groups, rewards = synth_rollouts(num_sequences or a.num_sequences,
                                              group_size or a.group_size, max_response,
                                              a.prompt_len, vocab, a.length_sigma, seed, force_max)
    return pack_rollouts(single_turn_groups(prompts, groups, rewards), PAD_ID)


def parse_kl(spec: str):
    """KLConfig from "estimator:placement" (e.g. k3:loss, exact:reward+loss)."""
    from megatron_rl.kl import ESTIMATOR_NAMES, PLACEMENTS, KLConfig

    est, sep, placement = spec.partition(":")
    if not sep or est not in ESTIMATOR_NAMES or placement not in PLACEMENTS:
        raise ValueError(f"--kl {spec!r}: want estimator:placement with estimator in "
                         f"{list(ESTIMATOR_NAMES)} and placement in {list(PLACEMENTS)}")
    return KLConfig(estimator=est, placement=placement, coef=0.05)


def train_config(a, combo: str, kl_spec: str):
    """The trainer's TrainConfig for one configuration (what the flags would build)."""
    from megatron_rl.config import AlgorithmConfig, ModelConfig, TrainConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import ModelOptions
    from megatron_rl.models.optim import OptimConfig

    packed, fused = COMBOS[combo]
    loss = LossConfig(kl=parse_kl(kl_spec), advantage_estimator=a.advantage_estimator)
    algo = AlgorithmConfig(num_prompts_per_step=a.num_sequences // a.group_size,
                           group_size=a.group_size, micro_batch_size=a.micro_batch_size,
                           sequence_packing=packed,
                           max_tokens_per_microbatch=a.max_tokens_per_microbatch, loss=loss,
                           old_logprobs="recompute")
    return TrainConfig(model=ModelConfig(bf16=a.bf16, options=ModelOptions(fused_lm_head=fused)),
                       algorithm=algo, optimizer=OptimConfig(lr=a.lr), seed=a.seed)


def build_models(a, cfg):
    """(policy, reference), the reference a copy of the policy's initial weights: all that
    train_on_batch trains with."""
    import torch

    from megatron_rl.checkpoint import copy_weights
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=a.seed)
    args = model_args(a)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    policy = Policy(args, trainable=True, params_dtype=dtype, optim=cfg.optimizer,
                    options=cfg.model.options)
    reference = Policy(args, trainable=False, params_dtype=dtype, options=cfg.model.options)
    copy_weights(policy, reference)
    return policy, reference


# ------------------------------------------------------------------------------------------------
# FLOPs: the model's (MFU) and the run's estimate (see the module docstring)
# ------------------------------------------------------------------------------------------------
def matmul_params(args) -> int:
    """N: the weights a token meets in matmuls: per layer the q/k/v projections h (q + 2 kv),
    the output projection q h and the SwiGLU MLP 3 h f, and the LM head h V once (the tied
    embedding's lookup is no matmul; biases and norms are left out). q = heads x head dim,
    kv = KV heads x head dim, f = the FFN width."""
    h, q = args.hidden_size, args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size
    return args.num_hidden_layers * layer + h * args.vocab_size


def forward_flops(args, seq_lengths) -> float:
    """F: model FLOPs of one forward over sequences of `seq_lengths` tokens (real tokens only):
    2 N per token (a multiply-add is 2 FLOPs) + causal attention, per layer and sequence of n
    tokens 2 q n (n + 1): query i scores i keys (QK^T, 2 q i over all heads) and sums i values
    (PV, 2 q i), and sum_i 4 q i = 2 q n (n + 1) ~ 2 q n^2, half of the full n x n."""
    q = args.num_attention_heads * args.head_dim
    dense = 2 * matmul_params(args) * sum(seq_lengths)
    attn = 2 * q * args.num_hidden_layers * sum(n * (n + 1) for n in seq_lengths)
    return float(dense + attn)


def model_flops(args, seq_lengths, kl, ppo_epochs: int = 1) -> float:
    """Model FLOPs of one training phase over a batch of `seq_lengths`: the forward passes
    and backward passes it needs, each F = forward_flops, a backward 2F (every matmul's input
    gradient and weight gradient; attention's dP, dS -> dQ, dK and dV are 4 matmuls against the
    forward's 2), so forward + backward = 3F, i.e. 6 N D + 6 q layers sum n (n + 1) for D
    tokens. The step: the old log-probs F, the reference's log-probs F (with the exact
    estimator, update.score_reference_exact: the policy's and the reference's forward
    together, 2F), then per PPO epoch the update's 3F (+ F, the reference's forward, with the exact KL in the
    loss): 5F with K1 / K3. What the run does beyond this (padding, the fused LM head's
    recomputed logits) is not model work and lowers MFU."""
    f = forward_flops(args, seq_lengths)
    scoring = (3 if kl.exact else 2) * f
    update = ppo_epochs * (3 + (1 if kl.exact_kl_in_loss else 0)) * f
    return scoring + update


def spec_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name` (DENSE_BF16_TFLOPS), None if unknown."""
    name = device_name.lower()
    for key, tflops in DENSE_BF16_TFLOPS:
        if key.lower() in name:
            return tflops
    return None


def measured_matmul_tflops(dtype, device, n: int, seconds: float = 0.5) -> float:
    """The best rate of n x n x n matmuls (2 n^3 FLOPs each) in `dtype` on `device`, repeated
    for about `seconds` after one untimed: the process's own attainable peak."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    bvt._sync()
    best, start = float("inf"), time.perf_counter()
    reps = 0
    while reps < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b)
        bvt._sync()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return 2 * n ** 3 / best / 1e12


def peak_tflops(a) -> tuple[float, str]:
    """(TFLOP/s, where it comes from) that MFU divides by: --peak-tflops; else on a GPU its
    dense bf16 peak from the data sheet (DENSE_BF16_TFLOPS); else (a CPU, or a GPU not in the
    table) the best rate of this process's own matmuls in the model's dtype and thread count,
    so that the ratio means on a CPU what it means on a GPU: the share of the hardware's matmul
    rate the training phase gets."""
    import torch

    if a.peak_tflops:
        return a.peak_tflops, "--peak-tflops"
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        spec = spec_peak_tflops(name)
        measured = measured_matmul_tflops(dtype, "cuda", 8192)
        if spec:
            return spec, (f"{name} dense bf16 data sheet; a {str(dtype)[6:]} 8192^3 matmul "
                          f"measured {measured:.0f} here")
        return measured, (f"{name}: measured {str(dtype)[6:]} 8192^3 matmul (not in the "
                          "data-sheet table)")
    return (measured_matmul_tflops(dtype, "cpu", 1024),
            f"measured {str(dtype)[6:]} 1024^3 matmul, {torch.get_num_threads()} thread(s)")


def microbatch_shapes(batch, lay, pad_multiple: int = 8) -> list[list[int]]:
    """Per microbatch of `lay`, the lengths attention runs over: a padded microbatch's rows of L,
    a packed row's segments (its sequences and the padding segment)."""
    out = []
    for mb in lay.microbatches(batch.tokens, batch.seq_lengths, None, pad_multiple):
        if "cu_seqlens" in mb.inputs:
            out.append(mb.inputs["cu_seqlens"].diff().tolist())
        else:
            out.append([batch.tokens.shape[1]] * len(mb.rows))
    return out


def step_flops(args, shapes: list[list[int]], fused: bool, kl) -> float:
    """Estimated FLOPs the run executes in one training phase over microbatches of `shapes`
    (padding and the fused head's recomputation included; for --dry-run's minutes and the
    achieved GFLOP/s, not for MFU)."""
    h, q = args.hidden_size, args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    dense = 2 * args.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size)
    head = 2 * h * args.vocab_size
    tokens = sum(sum(s) for s in shapes)
    attn = args.num_hidden_layers * sum(2 * q * n * n for s in shapes for n in s)
    fwd = tokens * (dense + head) + attn
    ref = 2 * fwd if kl.exact else fwd  # exact: policy and reference in one scoring pass
    train = 3 * fwd + (tokens * head if fused else 0)
    if kl.exact_kl_in_loss:
        train += fwd + (tokens * head if fused else 0)
    return fwd + ref + train


# ------------------------------------------------------------------------------------------------
# memory: reading it and guarding it
# ------------------------------------------------------------------------------------------------
def _statm() -> tuple[int, int]:
    """(virtual size, resident size) of this process in bytes."""
    with open("/proc/self/statm") as f:
        vsz, rss = f.read().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(vsz) * page, int(rss) * page


def rss_bytes() -> int:
    return _statm()[1]


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_gib(res: dict) -> float:
    """A worker's peak memory: CUDA's max allocated where it ran on a GPU, else peak RSS."""
    return res.get("cuda_peak_gib", res.get("peak_rss_gib", float("nan")))


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_limit(gib: float | None, gpu_total: int | None,
                 available: int | None) -> tuple[int, str]:
    """(bytes, note) of every worker's memory limit. On a GPU (`gpu_total` bytes):
    --mem-limit-gib capped at the GPU's memory, by default all of it (an H100's 80 GB or an
    H200's 141 GB: the sizes the kit runs need more than a fixed share). On the CPU:
    --mem-limit-gib, by default CPU_DEFAULT_LIMIT_GIB, capped at the `available` memory - 1 GiB
    (so a run cannot take the machine down)."""
    if gpu_total is not None:
        if gib is None:
            return gpu_total, f"{gpu_total / GIB:.1f} GiB, all of the GPU's memory"
        want = min(int(gib * GIB), gpu_total)
        return want, f"{want / GIB:.1f} GiB of GPU memory"
    gib = CPU_DEFAULT_LIMIT_GIB if gib is None else gib
    want = int(gib * GIB)
    if available is not None and available - GIB < want:
        return available - GIB, (f"--mem-limit-gib {gib:g} capped at {(available - GIB) / GIB:.1f}"
                                 f" GiB (this machine: {available / GIB:.1f} GiB available at "
                                 "start, - 1 GiB)")
    return want, f"{gib:g} GiB"


def effective_limit(gib: float | None) -> tuple[int, str]:
    """memory_limit for this machine: its GPU's total memory where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return memory_limit(gib, torch.cuda.get_device_properties(0).total_memory, None)
    return memory_limit(gib, None, mem_available_bytes())


def start_memory_guard(limit: int, result_file: str, context: dict) -> None:
    """RLIMIT_AS at limit + the process's non-resident address space + 2 GiB (a huge
    allocation fails cleanly), and a watchdog thread that writes an "over_limit" result and
    exits with EXIT_OVER_LIMIT when the RSS passes `limit`. CPU only (a CUDA process maps far
    more address space than it uses; there torch's per-process memory fraction is set)."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        return
    vsz, rss = _statm()
    cap = limit + (vsz - rss) + 2 * GIB
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def watch():
        while True:
            now = rss_bytes()
            if now > limit:
                _write_result(result_file, {**context, "status": "over_limit",
                                            "rss_gib": now / GIB, "limit_gib": limit / GIB})
                sys.stderr.write(f"RSS {now / GIB:.2f} GiB over the limit {limit / GIB:.2f} GiB: "
                                 "stopping\n")
                sys.stderr.flush()
                os._exit(EXIT_OVER_LIMIT)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True, name="memory-guard").start()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(
        s in str(e).lower() for s in ("out of memory", "can't allocate", "cannot allocate")))


def _write_result(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# worker: the training phase of one configuration
# ------------------------------------------------------------------------------------------------
class PhaseTimer:
    """Seconds per phase of the wrapped methods; only the outermost timed call counts (a phase's
    own calls into other wrapped methods belong to it)."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._depth = 0

    def wrap(self, obj, method: str, phase: str) -> None:
        fn = getattr(obj, method)

        @functools.wraps(fn)
        def timed(*args, **kw):
            if self._depth:
                return fn(*args, **kw)
            self._depth += 1
            bvt._sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                bvt._sync()
                self._depth -= 1
                self.seconds[phase] += time.perf_counter() - t

        setattr(obj, method, timed)  # an instance attribute: self.<method> calls find it too


def run_train_worker(a) -> dict:
    import torch

    from megatron_rl import update
    from megatron_rl.parallel import device

    ctx = {"model": a.model[0], "combo": a.combo, "kl": a.kl[0],
           "max_response": a.max_response[0]}
    start_memory_guard(a.limit_bytes, a.result_file, ctx)
    torch.set_num_threads(a.threads)
    cfg = train_config(a, a.combo, a.kl[0])
    policy, reference = build_models(a, cfg)
    # Adam's state exists from a run's first step on: allocate it now (a step on zero gradients
    # changes no weight), so that the timed optimizer steps are steady-state ones
    policy.step()
    rss_built = rss_bytes()
    peak, peak_source = peak_tflops(a)  # before the steps: the matmuls' memory is freed
    timer = PhaseTimer()
    timer.wrap(policy, "token_logprobs", "old_lp")
    timer.wrap(reference, "token_logprobs", "ref_lp")
    timer.wrap(policy, "collect_per_token", "ref_lp")  # score_reference_exact's pass
    timer.wrap(policy, "forward_backward", "fwd_bwd")
    timer.wrap(policy, "step", "optim")
    lay = update.layout(cfg)
    steps = []
    for k in range(a.warmup + a.steps):
        batch = make_batch(a, ctx["max_response"], a.seed + k).to(device())
        shapes = microbatch_shapes(batch, lay, policy.pad_multiple)
        timer.seconds = dict.fromkeys(PHASES, 0.0)
        bvt._sync()
        t0 = time.perf_counter()
        # update.behaviour_logprobs's recompute of the behaviour policy's log-probs
        batch.old_logprobs = policy.token_logprobs(batch.tokens, lay,
                                                      seq_lengths=batch.seq_lengths)
        metrics: dict = {}
        ok = update.train_on_batch(policy, reference, cfg, batch, metrics)
        bvt._sync()
        total = time.perf_counter() - t0
        timer.seconds["other"] = total - sum(v for p, v in timer.seconds.items() if p != "other")
        steps.append({
            "warmup": k < a.warmup, "seconds": total, "phases": dict(timer.seconds),
            "updated": ok, "response_tokens": sum(batch.response_lengths),
            "all_tokens": sum(batch.seq_lengths), "padded_length": batch.tokens.shape[1],
            "microbatches": len(shapes), "model_tokens": sum(sum(s) for s in shapes),
            "flops": step_flops(policy.args, shapes, COMBOS[a.combo][1], cfg.loss.kl),
            "model_flops": model_flops(policy.args, batch.seq_lengths, cfg.loss.kl,
                                       cfg.algorithm.ppo_epochs),
            "metrics": {m: float(metrics[m]) for m in ("pg_loss", "kl_k3", "entropy",
                                                       "grad_norm", "kl_exact") if m in metrics}})
        print(f"{a.combo} {a.kl[0]} step {k}{' (warm-up)' if k < a.warmup else ''}: "
              f"{total:.2f} s {json.dumps({p: round(v, 3) for p, v in timer.seconds.items()})}",
              flush=True)
    return {**ctx, "status": "ok", "steps": steps, "num_layers": policy.args.num_hidden_layers,
            "peak_tflops": peak, "peak_source": peak_source, "rss_built_gib": rss_built / GIB,
            "peak_rss_gib": peak_rss_bytes() / GIB,
            **({"cuda_peak_gib": torch.cuda.max_memory_allocated() / GIB}
               if torch.cuda.is_available() else {})}


# ------------------------------------------------------------------------------------------------
# worker: does one microbatch of `tokens` fit? (--find-max-tokens)
# ------------------------------------------------------------------------------------------------
def fit_microbatch(a, tokens: int, packed: bool):
    """(RolloutBatch, its one Microbatch) of about `tokens` tokens: padded, tokens / L sequences
    of width L (the first at full length); packed, the first (fullest) row of synthesised
    sequences first-fit into rows of at most `tokens`."""
    from megatron_rl.packing import Layout

    max_resp = a.max_response[0]
    probe = make_batch(a, max_resp, a.seed, 1, 1, force_max=True)
    width = probe.tokens.shape[1]
    if packed:
        n = max(2, 2 * tokens // max(1, a.prompt_len + max_resp // 3))
        batch = make_batch(a, max_resp, a.seed, n, 1, force_max=True)
        lay = Layout(packed=True, max_tokens=max(tokens, width))
    else:
        batch = make_batch(a, max_resp, a.seed, max(1, tokens // width), 1, force_max=True)
        lay = Layout(packed=False, micro_batch_size=batch.num_sequences)
    return batch, lay.microbatches(batch.tokens, batch.seq_lengths)[0]


def run_fit_worker(a) -> dict:
    import torch

    from megatron_rl import update
    from megatron_rl.parallel import device

    ctx = {"combo": a.combo, "kl": a.kl[0], "target_tokens": a.fit_tokens}
    start_memory_guard(a.limit_bytes, a.result_file, ctx)
    torch.set_num_threads(a.threads)
    cfg = train_config(a, a.combo, a.kl[0])
    policy, reference = build_models(a, cfg)
    policy.step()  # Adam's state, as in run_train_worker
    batch, m = fit_microbatch(a, a.fit_tokens, COMBOS[a.combo][0])
    batch = batch.to(device())
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    advantages = torch.randn(batch.num_sequences, device=batch.device)
    ref_lp = torch.zeros_like(batch.loss_mask)
    loss_cfg = cfg.loss
    reference = reference if loss_cfg.kl.exact_kl_in_loss else None
    loss_fn = update.make_rl_loss_fn(policy, loss_cfg, float(batch.loss_mask.sum()),
                                    float(batch.num_sequences), reference)
    bvt._sync()
    t0 = time.perf_counter()
    policy.forward_backward([update.loss_microbatch(batch, advantages, ref_lp, m)], loss_fn,
                               reference=reference, for_scoring=True)
    bvt._sync()
    return {**ctx, "status": "ok", "tokens": m.num_tokens, "sequences": len(m.rows),
            "seconds": time.perf_counter() - t0, "peak_rss_gib": peak_rss_bytes() / GIB,
            **({"cuda_peak_gib": torch.cuda.max_memory_allocated() / GIB}
               if torch.cuda.is_available() else {})}


def run_worker(a) -> int:
    fn = run_train_worker if a.worker == "train" else run_fit_worker
    try:
        res = fn(a)
    except Exception as e:  # noqa: BLE001  (reported to the driver, which goes on)
        if not _is_oom(e):
            raise
        res = {"combo": a.combo, "kl": a.kl[0], "status": "oom", "error": str(e)[:300],
               "peak_rss_gib": peak_rss_bytes() / GIB}
    _write_result(a.result_file, res)
    from megatron_rl.parallel import destroy_distributed

    destroy_distributed()
    return 0


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def _shared_argv(a) -> list[str]:
    """The worker's flags: everything that shapes the model and the batches."""
    out = ["--num-sequences", str(a.num_sequences),
           "--group-size", str(a.group_size), "--prompt-len", str(a.prompt_len),
           "--length-sigma", str(a.length_sigma), "--micro-batch-size", str(a.micro_batch_size),
           "--max-tokens-per-microbatch", str(a.max_tokens_per_microbatch),
           "--advantage-estimator", a.advantage_estimator, "--lr", str(a.lr),
           "--seed", str(a.seed), "--threads", str(a.threads), "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--limit-bytes", str(a.limit_bytes)]
    if a.peak_tflops:
        out += ["--peak-tflops", str(a.peak_tflops)]
    for flag, v in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                    ("--vocab", a.vocab),
                    ("--ffn-hidden-size", a.ffn_hidden_size), ("--num-heads", a.num_heads),
                    ("--num-kv-heads", a.num_kv_heads)):
        if v:
            out += [flag, str(v)]
    return out + (["--bf16"] if a.bf16 else [])


def run_child(a, worker: str, combo: str, kl: str, max_response: int, tag: str,
              extra: tuple = (), model: str | None = None) -> dict:
    """One worker subprocess; its result dict (status "killed" / "failed" when it left none)."""
    model = model or a.model[0]
    path = os.path.join(a.workdir, f"{tag}.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--result-file", path,
           "--model", model, "--combo", combo, "--kl", kl, "--max-response", str(max_response),
           *_shared_argv(a), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    log = os.path.join(a.workdir, f"{tag}.log")
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    elif proc.returncode < 0:
        res = {"status": "killed", "error": f"signal {-proc.returncode} (9: the kernel's OOM "
                                            "killer?)"}
    else:  # a bug, not memory: recorded (the other configurations still run), log kept
        with open(log) as f:
            tail = [line for line in f.read().splitlines() if line.strip()][-1:]
        res = {"status": "failed", "error": f"exit {proc.returncode}: {' '.join(tail)} "
                                            f"(see {log})"}
        print(f"worker failed: {shlex.join(cmd)}\n  {res['error']}", flush=True)
    return {"model": model, "combo": combo, "kl": kl, "max_response": max_response, **res,
            "wall_s": wall, "log": log}


def _failure(res: dict) -> str:
    """Why a worker did not finish, in a few words."""
    if res.get("status") == "over_limit":
        return f"RSS {res['rss_gib']:.2f} GiB > limit {res['limit_gib']:.2f} GiB"
    return res.get("error", "")[:160]


def summarize_train(res: dict) -> dict:
    """Sums over the timed steps: seconds per phase, tokens, tokens/s, achieved GFLOP/s."""
    if res.get("status") != "ok":
        return res
    timed = [s for s in res["steps"] if not s["warmup"]]
    secs = sum(s["seconds"] for s in timed)
    out = {k: res[k] for k in ("model", "combo", "kl", "max_response", "status", "num_layers",
                               "peak_tflops", "peak_source", "rss_built_gib", "peak_rss_gib",
                               "cuda_peak_gib", "wall_s") if k in res}
    out.update(
        steps=len(timed), seconds=secs,
        phases_s={p: sum(s["phases"][p] for s in timed) / len(timed) for p in PHASES},
        step_s=secs / len(timed),
        **{k: sum(s[k] for s in timed) for k in ("response_tokens", "all_tokens",
                                                  "model_tokens", "microbatches", "flops",
                                                  "model_flops")},
        first_step_metrics=res["steps"][0]["metrics"], updated=all(s["updated"] for s in timed))
    out["response_tokens_per_s"] = out["response_tokens"] / secs
    out["all_tokens_per_s"] = out["all_tokens"] / secs
    out["achieved_gflops"] = out["flops"] / secs / 1e9
    out["model_flops_per_step"] = out["model_flops"] / len(timed)
    out["model_tflops_per_s"] = out["model_flops"] / secs / 1e12
    out["mfu"] = out["model_tflops_per_s"] / out["peak_tflops"]
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """packed+fused / padded+logits tokens/s per (model, max response, KL family)."""
    def key_of(r):
        return r.get("model"), r["max_response"], r["kl"]

    out = []
    for r in rows:
        if r["combo"] != "packed+fused" or r.get("status") != "ok":
            continue
        base = [b for b in rows if b["combo"] == "padded+logits" and key_of(b) == key_of(r)]
        if not base:
            continue
        key = {"model": r.get("model"), "max_response": r["max_response"], "kl": r["kl"],
               "goal": GOAL_RATIO}
        if base[0].get("status") == "ok":
            x = r["response_tokens_per_s"] / base[0]["response_tokens_per_s"]
            out.append({**key, "ratio": x, "met": x >= GOAL_RATIO})
        else:  # the baseline did not run through: no ratio, and why
            out.append({**key, "ratio": None, "met": None,
                        "why": f"padded+logits {base[0].get('status')}: {_failure(base[0])}"})
    return out


def full_shape(a, model: str) -> bool:
    """Whether `model`'s configuration here is its real shape (no --num-layers, --hidden-size,
    --vocab, ... override changes it)."""
    cfg = model_config(a, model)
    return all(cfg[k] == v for k, v in SHAPES[model].items())


def mfu_goals(rows: list[dict], a) -> list[dict]:
    """The MFU goal per (max response, KL family) of the packed+fused rows at the goal's shape
    (MFU_GOAL_MODEL, MFU_GOAL_COMBO): {"model", "combo", "max_response", "kl", "goal": MFU_GOAL,
    "mfu": the row's (None when not measured), "met": mfu >= goal (None when not measured or
    not at the real shape), "by": mfu - goal, "peak_source"; "why" when "met" is None}. One
    entry without a row, saying so, where no such configuration ran."""
    base = {"model": MFU_GOAL_MODEL, "combo": MFU_GOAL_COMBO, "goal": MFU_GOAL}
    mine = [r for r in rows if r.get("model") == MFU_GOAL_MODEL
            and r["combo"] == MFU_GOAL_COMBO]
    if not mine:
        return [{**base, "max_response": None, "kl": None, "mfu": None, "met": None, "by": None,
                 "why": f"no {MFU_GOAL_MODEL} {MFU_GOAL_COMBO} configuration ran"}]
    shaped = MFU_GOAL_MODEL in SHAPES and full_shape(a, MFU_GOAL_MODEL)
    out = []
    for r in mine:
        key = {**base, "max_response": r["max_response"], "kl": r["kl"]}
        if r.get("status") != "ok":
            out.append({**key, "mfu": None, "met": None, "by": None,
                        "why": f"{r.get('status')}: {_failure(r)}"})
            continue
        x = r["mfu"]
        got = {**key, "mfu": x, "by": x - MFU_GOAL, "peak_source": r.get("peak_source")}
        if shaped:
            out.append({**got, "met": x >= MFU_GOAL})
        else:
            cfg = model_config(a, MFU_GOAL_MODEL)
            out.append({**got, "met": None,
                        "why": f"not the {MFU_GOAL_MODEL} shape ({cfg['num_hidden_layers']} "
                               f"layers, hidden {cfg['hidden_size']}, vocab "
                               f"{cfg['vocab_size']})"})
    return out


def goals(rows: list[dict], a) -> dict:
    """The summary's goal entries: "ratios" (tokens/s) and "mfu_goals"."""
    return {"ratios": ratios(rows), "mfu_goals": mfu_goals(rows, a)}


def mfu_goal_line(x: dict) -> str:
    """A summary line for one mfu_goals entry: met, or missed by how many points."""
    where = (f"{x['model']}, max response {x['max_response']}, {x['kl']}"
             if x["max_response"] is not None else x["model"])
    what = f"{x['combo']} training-phase MFU"
    if x["mfu"] is None:
        return f"- {where}: {what} not measured ({x['why']}; goal >= {100 * x['goal']:.0f}%)"
    pts = 100 * abs(x["by"])
    verdict = ("not judged: " + x["why"] if x["met"] is None
               else f"met, {pts:.1f} points over" if x["met"]
               else f"missed by {pts:.1f} points")
    return (f"- {where}: {what} = **{100 * x['mfu']:.1f}%** of {x.get('peak_source')} "
            f"(goal >= {100 * x['goal']:.0f}%: {verdict})")


def run_benchmark(a, save=None) -> dict:
    """Every configuration in turn (models outermost); save(part), when given, gets the
    results so far after each one."""
    combos = list(COMBOS) if a.all_combos else list(MAIN_COMBOS)
    rows = []
    for model in a.model:
        for max_resp in a.max_response:
            for kl in a.kl:
                for combo in combos:
                    tag = "_".join(("train", model, str(max_resp),
                                    kl.replace(":", "-").replace("+", "p"),
                                    combo.replace("+", "_")))
                    res = summarize_train(run_child(a, "train", combo, kl, max_resp, tag,
                                                    model=model))
                    rows.append(res)
                    what = f"{model} {max_resp:5d} {kl:14s} {combo:14s}"
                    if res.get("status") == "ok":
                        print(f"{what}: {res['step_s']:8.2f} s/step, "
                              f"{res['all_tokens_per_s']:8.1f} tok/s "
                              f"({res['response_tokens_per_s']:.1f} response), "
                              f"{res['model_flops_per_step'] / 1e12:.3g} model TFLOP/step, "
                              f"{res['model_tflops_per_s']:.3g} TFLOP/s, MFU "
                              f"{100 * res['mfu']:.1f}% of {res['peak_tflops']:.4g} TFLOP/s "
                              f"({res['peak_source']}), peak {peak_gib(res):.2f} GiB",
                              flush=True)
                    else:
                        print(f"{what}: {res['status']} {_failure(res)}", flush=True)
                    if save:
                        save({"train_phase": rows, **goals(rows, a)})
    return {"train_phase": rows, **goals(rows, a)}


def run_find_max(a) -> dict:
    """Per path: doubling microbatches until one does not fit."""
    combos = list(COMBOS) if a.all_combos else list(MAIN_COMBOS)
    max_resp, kl = a.max_response[0], a.kl[0]
    width = make_batch(a, max_resp, a.seed, 1, 1, force_max=True).tokens.shape[1]
    out = {}
    for combo in combos:
        tries, best = [], None
        tokens = width
        while tokens <= a.find_cap_tokens:
            tag = f"fit_{max_resp}_{combo.replace('+', '_')}_{tokens}"
            res = run_child(a, "fit", combo, kl, max_resp, tag, ("--fit-tokens", str(tokens)))
            res.setdefault("target_tokens", tokens)
            fits = res.get("status") == "ok" and peak_gib(res) * GIB <= a.limit_bytes
            res["fits"] = fits
            tries.append(res)
            print(f"{combo:14s} {tokens:7d} tokens: {res.get('status')}"
                  + (f", peak {peak_gib(res):.2f} GiB, {res['seconds']:.1f} s"
                     if res.get("status") == "ok" else f" {_failure(res)}"), flush=True)
            if not fits:
                break
            best = res
            tokens *= 2
        out[combo] = {"largest_fitting_tokens": best["tokens"] if best else None,
                      "largest_fitting_sequences": best["sequences"] if best else None,
                      "capped": bool(best) and tokens > a.find_cap_tokens, "tries": tries}
    return {"find_max_tokens": {"max_response": max_resp, "kl": kl, "padded_width": width,
                                "limit_gib": a.limit_bytes / GIB, "paths": out}}


def dry_run(a) -> dict:
    """The batches' layouts, estimated and model FLOPs, without building a model."""
    from megatron_rl import update

    combos = list(COMBOS) if a.all_combos else list(MAIN_COMBOS)
    rows = []
    for model in a.model:
        args = model_args(a, model)
        for max_resp in a.max_response:
            for kl in a.kl:
                for combo in combos:
                    cfg = train_config(a, combo, kl)
                    tot = {"microbatches": 0, "model_tokens": 0, "flops": 0.0,
                           "model_flops": 0.0, "response_tokens": 0, "all_tokens": 0}
                    for k in range(a.warmup, a.warmup + a.steps):
                        batch = make_batch(a, max_resp, a.seed + k)
                        shapes = microbatch_shapes(batch, update.layout(cfg))
                        tot["microbatches"] += len(shapes)
                        tot["model_tokens"] += sum(sum(s) for s in shapes)
                        tot["flops"] += step_flops(args, shapes, COMBOS[combo][1], cfg.loss.kl)
                        tot["model_flops"] += model_flops(args, batch.seq_lengths, cfg.loss.kl,
                                                          cfg.algorithm.ppo_epochs)
                        tot["response_tokens"] += sum(batch.response_lengths)
                        tot["all_tokens"] += sum(batch.seq_lengths)
                    rows.append({"model": model, "max_response": max_resp, "kl": kl,
                                 "combo": combo, **tot})
                    est = (f", ~{tot['flops'] / (a.gflops * 1e9) / 60:.1f} min at "
                           f"{a.gflops:g} GFLOP/s" if a.gflops else "")
                    print(f"{model} {max_resp:5d} {kl:14s} {combo:14s}: "
                          f"{tot['microbatches']:4d} microbatches, {tot['model_tokens']:7d} "
                          f"model tokens ({tot['all_tokens']} real, {tot['response_tokens']} "
                          f"response), {tot['flops'] / 1e12:.3g} TFLOP run, "
                          f"{tot['model_flops'] / 1e12:.3g} TFLOP model{est}")
    return {"plan": rows}


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def machine() -> dict:
    import torch

    out = {"cpu": bvt._cpu(), "cores": os.cpu_count(), "torch": torch.__version__,
           "python": platform.python_version(), "host": platform.node(),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def model_note(a, model: str) -> str:
    cfg = model_config(a, model)
    return (f"model: {model}-shaped, {cfg['num_hidden_layers']} layer(s) (the real model has "
            f"{SHAPES[model]['num_hidden_layers']}), hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, FFN "
            f"{cfg['intermediate_size']}, tied vocab {cfg['vocab_size']}, "
            f"{'bf16' if a.bf16 else 'fp32'}; random weights; {a.threads} thread(s)")


def notes(a) -> list[str]:
    models = [model_note(a, m) for m in (a.model[:1] if a.find_max_tokens else a.model)]
    if a.find_max_tokens:
        return [*models, "sequences synthesised (random tokens, log-normal response lengths); "
                "old / reference log-probs and advantages are placeholders (zeros, random): "
                "only the memory of one forward+backward of the PPO loss is measured, after one "
                "optimizer step on zero gradients has allocated Adam's state"]
    return [
        *models,
        f"rollouts synthesised, not generated: {a.num_sequences} sequences in groups of "
        f"{a.group_size}, prompts of {a.prompt_len} +- 25% random tokens, response lengths "
        f"log-normal (median max/4, sigma {a.length_sigma}) clipped to [8, max], random tokens, "
        "random 0/1 rewards; rollout log-probs are 0 placeholders (the old log-probs are "
        "recomputed, as --old-logprobs recompute does)",
        f"padded: --micro-batch-size {a.micro_batch_size}; packed: --max-tokens-per-microbatch "
        + (str(a.max_tokens_per_microbatch) if a.max_tokens_per_microbatch
           else "micro-batch-size x the batch's padded length (the same token budget)")
        + " (on a GPU the trainer's rows are shape-bucketed: packing.bucketed_length)",
        "MFU: model FLOPs per step (forward_flops / model_flops: 2N per token per forward + "
        "causal attention over the real sequence lengths, forward+backward 3x forward; the "
        "old and reference log-prob forwards counted; no padding, no recomputation) / step "
        "seconds / the peak: a GPU's dense bf16 data-sheet peak, else (CPU) the process's own "
        "measured matmul rate",
        f"{a.warmup} warm-up + {a.steps} timed step(s) per configuration, "
        "each configuration in its own process (peak RSS: the whole process)",
        "phases via the trainer's own update.train_on_batch with the policy, "
        "reference and TrainConfig; old log-probs as update.behaviour_logprobs recomputes them; "
        "Adam's state allocated before timing (one step on zero gradients)",
    ]


def markdown(summary: dict, a) -> str:
    m = summary["machine"]
    lines = [f"### Training phase: packed + fused LM head vs padded + logits "
             f"(tools/bench_train_phase.py, {m['date'][:10]})", "",
             f"Machine: {m['cpu']}; {m['cores']} cores" + (f"; {m['gpu']}" if "gpu" in m else "")
             + f"; torch {m['torch']}, Python {m['python']}.",
             f"Command: `{summary['command']}`", ""]
    lines += [f"- {n}" for n in notes(a)] + [f"- memory limit: {summary['limit_note']}", ""]
    rows = summary.get("train_phase")
    if rows:
        lines += ["| model | max resp | KL | path | layers | microbatches | model tokens "
                  "(padding incl.) | response / all tokens | old lp s | ref lp s | fwd+bwd s "
                  "| optim s | other s | phase s | response tok/s | all tok/s "
                  "| model TFLOP/step | model TFLOP/s | MFU | run GFLOP/s (est.) "
                  "| RSS built / peak GiB | grad norm step 0 |", "|" + "---|" * 22]
        for r in rows:
            model = r.get("model", a.model[0])
            layers = r.get("num_layers", model_config(a, model)["num_hidden_layers"])
            head = f"| {model} | {r['max_response']} | {r['kl']} | {r['combo']} | {layers} |"
            if r.get("status") != "ok":
                lines.append(head + f" {r.get('status')}: {_failure(r)} |" + " |" * 16)
                continue
            ph = r["phases_s"]
            lines.append(
                head + f" {r['microbatches']} | {r['model_tokens']} | {r['response_tokens']} / "
                f"{r['all_tokens']} | " + " | ".join(f"{ph[p]:.2f}" for p in PHASES)
                + f" | {r['step_s']:.2f} | {r['response_tokens_per_s']:.1f} | "
                f"{r['all_tokens_per_s']:.1f} | {r['model_flops_per_step'] / 1e12:.4g} | "
                f"{r['model_tflops_per_s']:.4g} | {100 * r['mfu']:.1f}% | "
                f"{r['achieved_gflops']:.1f} | "
                f"{r['rss_built_gib']:.2f} / {peak_gib(r):.2f} | "
                f"{r['first_step_metrics'].get('grad_norm', float('nan')):.6g} |")
        lines.append("")
        lines.append("Phase seconds are per step (mean over the timed steps); tokens and "
                     "microbatches are summed over them.")
        peaks: dict[str, list[float]] = {}  # per source (a measured one: one per worker)
        for r in rows:
            if r.get("status") == "ok":
                peaks.setdefault(r["peak_source"], []).append(r["peak_tflops"])
        for source, values in peaks.items():
            lo, hi = min(values), max(values)
            lines.append(f"- MFU's peak: {lo:.4g}" + (f"-{hi:.4g}" if hi > lo else "")
                         + f" TFLOP/s ({source})")
        for x in summary["ratios"]:
            what = (f"**{x['ratio']:.2f}x** (goal >= {x['goal']}x: "
                    f"{'met' if x['met'] else 'not met'})" if x["ratio"] is not None
                    else f"not measured ({x['why']})")
            lines.append(f"- {x.get('model') or a.model[0]}, max response {x['max_response']}, "
                         f"{x['kl']}: packed+fused / padded+logits training tokens/s = {what}")
        lines += [mfu_goal_line(x) for x in summary.get("mfu_goals", [])]
        lines.append("")
    fm = summary.get("find_max_tokens")
    if fm:
        lines += [f"Largest microbatch one forward+backward fits in {fm['limit_gib']:.2f} GiB "
                  f"(whole process: model, main grads, Adam state, reference, activations; "
                  f"max response {fm['max_response']}, padded width {fm['padded_width']}, KL "
                  f"{fm['kl']}, {model_config(a)['num_hidden_layers']} layer(s)):", "",
                  "| path | largest fitting tokens (sequences) | tried: tokens -> peak GiB "
                  "(RSS; on a GPU max allocated) / status |", "|---|---|---|"]
        for combo, d in fm["paths"].items():
            tried = "; ".join(f"{t.get('tokens', t.get('target_tokens'))} -> "
                              + (f"{peak_gib(t):.2f}" if "peak_rss_gib" in t else "-")
                              + ("" if t.get("fits") else f" ({t.get('status')}: {_failure(t)})")
                              for t in d["tries"])
            best = (f"{d['largest_fitting_tokens']} ({d['largest_fitting_sequences']})"
                    + (" (the cap)" if d["capped"] else "")
                    if d["largest_fitting_tokens"] else "none")
            lines.append(f"| {combo} | {best} | {tried} |")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-response", type=int, nargs="+", default=[1024],
                   help="max response tokens; several: one benchmark each (e.g. 1024 4096)")
    p.add_argument("--num-sequences", type=int, default=32, help="sequences per RL step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (+- 25%%)")
    p.add_argument("--length-sigma", type=float, default=1.0,
                   help="sigma of the log-normal response lengths")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="sequences per padded microbatch")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=0,
                   help="tokens per packed microbatch; 0: micro-batch-size x the batch's padded "
                   "length (the same token budget)")
    p.add_argument("--kl", nargs="+", default=["k3:loss"],
                   help="KL families, estimator:placement (k1:reward k3:loss exact:reward+loss)")
    p.add_argument("--advantage-estimator", default="rloo")
    p.add_argument("--all-combos", action="store_true",
                   help="also packed+logits and padded+fused")
    p.add_argument("--model", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(SHAPES),
                   help="model shapes; several: one benchmark each (qwen2.5-0.5b "
                   "qwen2.5-1.5b)")
    p.add_argument("--num-layers", type=int,
                   help="override every model's layer count (default: its own, 24 for "
                   "Qwen2.5-0.5B, 28 for 1.5B)")
    p.add_argument("--hidden-size", type=int, help="override (default 896; head dim 64 kept)")
    p.add_argument("--vocab", type=int, help="override the vocabulary (default 151936)")
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--bf16", action="store_true", help="bf16 weights (fp32 main params)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int,
                   default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per configuration (default: 1 on a GPU, whose first "
                   "step pays one-time costs such as torch.compile; 0 on the CPU)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per configuration")
    p.add_argument("--find-max-tokens", action="store_true",
                   help="per path, the largest microbatch that fits in --mem-limit-gib (uses the "
                   "first --max-response and --kl)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="memory limit of every worker; default: all of the GPU's memory where "
                   f"one is used, else {CPU_DEFAULT_LIMIT_GIB:g} (on a CPU capped at the "
                   "available memory - 1 GiB)")
    p.add_argument("--find-cap-tokens", type=int, default=1 << 17,
                   help="--find-max-tokens stops doubling here")
    p.add_argument("--dry-run", action="store_true",
                   help="print the batches' layouts and FLOPs; build no model")
    p.add_argument("--gflops", type=float, help="--dry-run: estimate minutes at this rate")
    p.add_argument("--peak-tflops", type=float,
                   help="the peak MFU divides by (default: a GPU's dense bf16 data-sheet peak "
                   "where the device is in DENSE_BF16_TFLOPS, else a matmul rate measured in "
                   "the worker)")
    p.add_argument("--workdir", default=os.path.join(REPO, "outputs", "bench_train_phase"),
                   help="worker results and logs")
    p.add_argument("--out", help="append the markdown section to this file")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--worker", choices=["train", "fit"], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--combo", choices=sorted(COMBOS), help=argparse.SUPPRESS)
    p.add_argument("--fit-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--limit-bytes", type=int, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.warmup is None:
        import torch

        a.warmup = 1 if torch.cuda.is_available() else 0
    # user errors raise ValueError here, before any worker starts
    model_config(a)
    for spec in a.kl:
        train_config(a, "packed+fused", spec)
    if a.num_sequences % a.group_size:
        raise ValueError(f"--num-sequences {a.num_sequences} must be a multiple of --group-size "
                         f"{a.group_size}")
    if a.worker:
        return run_worker(a)
    if a.dry_run:
        summary = dry_run(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=2)
        return 0
    a.limit_bytes, limit_note = effective_limit(a.mem_limit_gib)
    a.workdir = os.path.abspath(a.workdir)
    os.makedirs(a.workdir, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    summary = {"machine": machine(),
               "command": shlex.join(["python", os.path.relpath(__file__, REPO), *given]),
               "num_layers": a.num_layers or model_config(a)["num_hidden_layers"],
               "models": {m: model_config(a, m) for m in a.model},
               "model": model_config(a), "notes": notes(a),
               "limit_note": limit_note,
               "config": {k: v for k, v in vars(a).items() if k not in ("worker", "result_file",
                                                                        "combo", "fit_tokens")}}
    print(f"{', '.join(a.model)}: {a.num_layers or 'their own'} layer(s), {a.threads} "
          f"thread(s), {a.warmup} warm-up step(s), memory limit {limit_note}",
          flush=True)
    def save(part: dict) -> None:  # a run stopped early (a time limit) keeps what it measured
        if a.json:
            _write_result(a.json, {**summary, **part, "partial": True})

    summary.update(run_find_max(a) if a.find_max_tokens else run_benchmark(a, save))
    text = markdown(summary, a)
    print("\n" + text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
