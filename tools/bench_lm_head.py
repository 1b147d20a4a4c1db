"""Benchmark: the fused LM-head op against the paths that build the [N, V] logits.

Every path starts from the final hidden states [N, H] and the output-layer weight [V, H] (the
LM-head matmul is counted in each), on the same inputs, by default Qwen2.5-0.5B's head
(H = 896, V = 151936, tied embedding) with random values scaled like the real model's (hidden
~ N(0, 1) as after RMSNorm, weight ~ N(0, 0.02)):
  mcore         logits = hidden @ weight.T, megatron-core `vocab_parallel_cross_entropy`
                (TP=1 over a 1-rank gloo/nccl group), log p = -CE, K3 in PyTorch; no entropy
                (megatron-core has none: its loss lacks the entropy term)
  logits        today's path: logits = hidden @ weight.T, then
                ops.token_logprobs_and_kl(return_entropy=True, ref_logprobs=...)
  fused         ops.lm_head_logprobs_and_kl(hidden, weight, ...): chunks of tokens, the logits
                recomputed in backward, never [N, V]
and with --exact the exact KL to a reference model (its hidden states and weight are inputs):
  logits+exact  as `logits`, with ref_logits = ref_hidden @ ref_weight.T computed in the
                measured region and passed as ref_logits
  fused+exact   as `fused`, with ref_hidden and ref_weight
Per case: forward time (under no_grad, as for old/ref scoring), forward+backward time (loss =
sum(logp) + 0.1 sum(K3) + 0.01 sum(entropy) [+ 0.1 sum(exact KL)], gradients to hidden and
weight), min and median of --reps interleaved runs after one warm-up (tools/bench_logprob_kl.py's
time_steps); "kept" and "peak extra" memory of forward+backward above the inputs (hidden,
weight, targets, reference tensors), measured as tools/bench_logprob_kl.py's peak_extra does
(CPU: the torch profiler's memory events; CUDA: max_memory_allocated): everything allocated in
the measured region, i.e. the logits and their gradient in the logits paths, the fp32 softmax in
mcore's, and hidden.grad and weight.grad in all. Ratios are method / baseline in the same run
(time: higher = slower; memory: peak extra).

A case runs only if inputs + its analytic peak (`analytic_extra_bytes`) fit in --max-gib
(default: 80% of the memory available at start), else it is reported "skipped (over
--max-gib)" with the analytic number: on Linux a CPU allocation over the free memory may
succeed and the process be killed later, so this guard is what keeps the run alive. A case
that still runs out of memory (RuntimeError / MemoryError naming memory) is reported "does not
fit". --out appends the goals, marked met / not met from the numbers:
  - peak extra memory of fused <= mcore / 10 at N = 16384,
  - fused forward+backward time <= 1.5x the logits path's.

Usage:
  OMP_NUM_THREADS=2 python tools/bench_lm_head.py --threads 2 --tokens 4096 16384 \\
      --dtypes bf16 fp32 [--exact] --out benchmarks/RESULTS.md --json lm_head.json
  OMP_NUM_THREADS=1 python tools/bench_lm_head.py --tokens 64 --hidden 32 --vocab 1000 \\
      --reps 1 --chunk-tokens 8                                                 # smoke test
  python tools/bench_lm_head.py --device cuda --tokens 4096 16384 32768 --exact
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_logprob_kl as blk  # noqa: E402  (also puts the repo on sys.path)
from megatron_rl.ops import lm_head_logprobs_and_kl, token_logprobs_and_kl  # noqa: E402
from megatron_rl.ops.lm_head import default_chunk_tokens, default_vocab_block  # noqa: E402

QWEN25_05B = {"hidden": 896, "vocab": 151936}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GOAL_MEMORY = 0.1  # fused peak extra / mcore's at N = 16384
GOAL_MEMORY_TOKENS = 16384
GOAL_TIME = 1.5  # fused forward+backward time / the logits path's


@dataclass
class Inputs:
    """One case's tensors; the ref_* ones are the reference model's (no gradient)."""
    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor  # [N] fp32
    ref_hidden: Optional[torch.Tensor] = None  # [N, H]
    ref_weight: Optional[torch.Tensor] = None  # [V, H]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)


def make_inputs(n: int, h: int, v: int, dtype, device, exact: bool, seed: int = 0) -> Inputs:
    """Hidden ~ N(0, 1), weight ~ N(0, 0.02); the reference is a nearby model (hidden + N(0,
    0.1^2), weight + N(0, 0.002^2)); reference log-probs near the uniform -log V."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    x = Inputs(hidden=randn(n, h).to(dtype), weight=(randn(v, h) * 0.02).to(dtype),
               targets=torch.randint(0, v, (n,), generator=gen, device=device),
               ref_logprobs=randn(n) * 0.1 - math.log(v))
    if exact:
        x.ref_hidden = (x.hidden.float() + 0.1 * randn(n, h)).to(dtype)
        x.ref_weight = (x.weight.float() + 0.002 * randn(v, h)).to(dtype)
    return x


# Each method: (inputs, hidden, weight) -> (logprobs, k3, entropy | None, exact_kl | None), with
# `hidden` and `weight` the leaves that get gradients.
def mcore_path(x: Inputs, hidden, weight):
    logp, k3 = blk.mcore(hidden @ weight.t(), x.targets, x.ref_logprobs)
    return logp, k3, None, None


def logits_path(x: Inputs, hidden, weight, exact=False):
    ref_logits = x.ref_hidden @ x.ref_weight.t() if exact else None
    out = token_logprobs_and_kl(hidden @ weight.t(), x.targets, ref_logprobs=x.ref_logprobs,
                                return_entropy=True, ref_logits=ref_logits)
    return out.logprobs, out.k3, out.entropy, out.exact_kl


def fused_path(x: Inputs, hidden, weight, chunk_tokens=None, exact=False):
    out = lm_head_logprobs_and_kl(hidden, weight, x.targets, ref_logprobs=x.ref_logprobs,
                                  return_entropy=True, chunk_tokens=chunk_tokens,
                                  ref_hidden=x.ref_hidden if exact else None,
                                  ref_weight=x.ref_weight if exact else None)
    return out.logprobs, out.k3, out.entropy, out.exact_kl


METHODS = {
    "mcore": mcore_path,
    "logits": logits_path,
    "fused": fused_path,
    "logits+exact": functools.partial(logits_path, exact=True),
    "fused+exact": functools.partial(fused_path, exact=True),
}


def analytic_extra_bytes(method: str, n: int, h: int, v: int, itemsize: int, chunk: int,
                         block: int) -> int:
    """Peak bytes allocated above the inputs by one forward+backward: the tensors each path holds
    at its peak, as the code stands.

    Logits paths: the larger of the [N, V] phase (mcore: the logits, megatron's fp32 copy of them
    (the same tensor in fp32), then its fp32 gradient and that cast to the logits dtype; logits:
    the logits and their gradient, + the reference's logits with the exact KL) and the output
    layer's backward (the logits' gradient, hidden.grad, weight.grad). fused: about a dozen [N]
    fp32 vectors, plus the larger of forward's few [chunk, V] tensors and backward's: a few
    [N, block] logits blocks (policy, reference, gradient), the fp32 hidden gradient and one
    block's [N, H] product, weight.grad and hidden.grad."""
    nv, grads = n * v, (n + v) * h * itemsize
    per_logit = {"mcore": 4 + (itemsize if itemsize != 4 else 0), "logits": 2 * itemsize,
                 "logits+exact": 3 * itemsize}
    if method in per_logit:
        return max(nv * per_logit[method], nv * itemsize + grads)
    blocks = 3 if method == "fused" else 5
    forward = min(n, chunk) * v * itemsize * blocks
    backward = n * block * itemsize * blocks + n * h * (4 + itemsize) + grads
    return n * 4 * 12 + max(forward, backward)


def loss_of(outs):
    logp, k3, entropy, kl = outs
    loss = logp.sum() + 0.1 * k3.sum()
    if entropy is not None:
        loss = loss + 0.01 * entropy.sum()
    if kl is not None:
        loss = loss + 0.1 * kl.sum()
    return loss


def _leaves(x: Inputs):
    return x.hidden.requires_grad_(True), x.weight.requires_grad_(True)


def _release(x: Inputs):
    for t in (x.hidden, x.weight):
        t.grad = None
        t.requires_grad_(False)


def forward_step(fn, x: Inputs):
    with torch.no_grad():
        fn(x, x.hidden, x.weight)


def train_step(fn, x: Inputs):
    try:
        loss_of(fn(x, *_leaves(x))).backward()
    finally:
        _release(x)


def memory_of(fn, x: Inputs, device):
    """(bytes kept from forward to backward, peak extra bytes of forward+backward)."""
    try:
        hidden, weight = _leaves(x)
        return blk.peak_extra(lambda: fn(x, hidden, weight), lambda outs: loss_of(outs).backward(),
                              device)
    finally:
        _release(x)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "memory" in str(exc).lower()


def _free_cache(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time(steps: dict, device, reps) -> dict[str, list[float]]:
    """time_steps over all steps interleaved; if one runs out of memory there, each alone."""
    try:
        return blk.time_steps(steps, device, reps)
    except (RuntimeError, MemoryError) as exc:
        if not _is_oom(exc):
            raise
    times = {}
    for name, step in steps.items():
        _free_cache(device)
        try:
            times.update(blk.time_steps({name: step}, device, reps))
        except (RuntimeError, MemoryError) as exc:
            if not _is_oom(exc):
                raise
    return times


def bench_case(methods: dict, n, h, v, dtype_name, device, reps, max_bytes, chunk,
               exact) -> list[dict]:
    """One row per method at (N, dtype): status, times, memory, analytic peak, ratios."""
    dtype = DTYPES[dtype_name]
    x = make_inputs(n, h, v, dtype, device, exact)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    chunk = chunk or default_chunk_tokens(v, itemsize, device)
    block = default_vocab_block(n, v, itemsize, device)
    rows = {}
    for name in methods:
        analytic = analytic_extra_bytes(name, n, h, v, itemsize, chunk, block)
        rows[name] = {"n": n, "dtype": dtype_name, "method": name,
                      "analytic_extra_mib": analytic / 2**20, "inputs_mib": x.nbytes() / 2**20,
                      "status": "ok"}
        if x.nbytes() + analytic > max_bytes:
            rows[name]["status"] = "skipped (over --max-gib)"
    mem = {}
    for name, fn in methods.items():  # memory first: it also finds the cases that do not fit
        if rows[name]["status"] != "ok":
            continue
        try:
            mem[name] = memory_of(fn, x, device)
        except (RuntimeError, MemoryError) as exc:
            if not _is_oom(exc):
                raise
            rows[name]["status"] = "does not fit"
            _free_cache(device)
    fits = {name: methods[name] for name in mem}
    fwd = _time({k: functools.partial(forward_step, fn, x) for k, fn in fits.items()}, device, reps)
    both = _time({k: functools.partial(train_step, fn, x) for k, fn in fits.items()}, device, reps)
    del x
    for name in fits:
        if name not in fwd or name not in both:
            rows[name]["status"] = "does not fit"
            continue
        kept, peak = mem[name]
        rows[name].update({
            "fwd_ms_min": min(fwd[name]) * 1e3, "fwd_ms_median": statistics.median(fwd[name]) * 1e3,
            "fwd_bwd_ms_min": min(both[name]) * 1e3,
            "fwd_bwd_ms_median": statistics.median(both[name]) * 1e3,
            "kept_mib": kept / 2**20, "peak_extra_mib": peak / 2**20})
    for base in ("mcore", "logits"):
        b = rows.get(base)
        for r in rows.values():
            ok = r["status"] == "ok" and b is not None and b["status"] == "ok"
            for key, col in (("fwd_ms_min", "fwd"), ("fwd_bwd_ms_min", "fwd_bwd"),
                             ("peak_extra_mib", "peak")):
                r[f"{col}_over_{base}"] = r[key] / b[key] if ok else None
    return list(rows.values())


HEADER = ("| N | dtype | method | status | fwd ms min / med | fwd+bwd ms min / med | "
          "kept fwd->bwd MiB | peak extra MiB | analytic peak MiB | fwd / mcore | "
          "fwd+bwd / mcore | peak / mcore | fwd / logits | fwd+bwd / logits | peak / logits |")


def markdown_row(r: dict) -> str:
    f = lambda x, spec=".2f": "-" if x is None else f"{x:{spec}}"  # noqa: E731
    head = f"| {r['n']} | {r['dtype']} | {r['method']} | {r['status']} |"
    if r["status"] != "ok":
        return head + f" | | | | {r['analytic_extra_mib']:.2f} |" + " |" * 6
    return head + (
        f" {r['fwd_ms_min']:.1f} / {r['fwd_ms_median']:.1f} | "
        f"{r['fwd_bwd_ms_min']:.1f} / {r['fwd_bwd_ms_median']:.1f} | {r['kept_mib']:.2f} | "
        f"{r['peak_extra_mib']:.2f} | {r['analytic_extra_mib']:.2f} | "
        f"{f(r['fwd_over_mcore'])} | {f(r['fwd_bwd_over_mcore'])} | "
        f"{f(r['peak_over_mcore'], '.3f')} | "
        f"{f(r['fwd_over_logits'])} | {f(r['fwd_bwd_over_logits'])} | "
        f"{f(r['peak_over_logits'], '.3f')} |")


def _goal(text: str, n: int, dt: str, limit: float, row, base, key: str, fallback=None) -> dict:
    """row[key] / base[key] against `limit`, both measured; where the baseline did not run,
    its `fallback` (analytic) column stands in when given."""
    g = {"goal": text, "n": n, "dtype": dt, "value": None, "met": None, "note": ""}
    if row is None or base is None:
        g["note"] = "not measured (a method was left out)"
    elif row["status"] != "ok" or (base["status"] != "ok" and not fallback):
        bad = row if row["status"] != "ok" else base
        g["note"] = f"not measured ({bad['method']} {bad['status']})"
    else:
        measured = base["status"] == "ok"
        g["value"] = row[key] / base[key if measured else fallback]
        g["met"] = g["value"] <= limit
        if not measured:
            g["note"] = f"against {base['method']}'s analytic peak: it {base['status']}"
    return g


def goals(rows: list[dict]) -> list[dict]:
    """The two goals per (N, dtype) of the run (the memory goal at N = 16384 only)."""
    by = {(r["n"], r["dtype"], r["method"]): r for r in rows}
    out = []
    for n, dt in dict.fromkeys((r["n"], r["dtype"]) for r in rows):
        fused, mcore, logits = (by.get((n, dt, m)) for m in ("fused", "mcore", "logits"))
        if n == GOAL_MEMORY_TOKENS:
            out.append(_goal(f"peak memory of fused <= mcore/{1 / GOAL_MEMORY:.0f} at N={n}", n,
                             dt, GOAL_MEMORY, fused, mcore, "peak_extra_mib", "analytic_extra_mib"))
        out.append(_goal(f"fused fwd+bwd time <= {GOAL_TIME}x logits path", n, dt, GOAL_TIME,
                         fused, logits, "fwd_bwd_ms_min"))
    return out


def goal_lines(gs: list[dict], tokens: list[int]) -> list[str]:
    lines = []
    for g in gs:
        result = g["note"]  # why it is not measured
        if g["value"] is not None:
            result = (f"{g['value']:.3f} -> {'met' if g['met'] else 'not met'}"
                      + (f" ({g['note']})" if g["note"] else ""))
        lines.append(f"- {g['goal']} ({g['dtype']}, N={g['n']}): {result}")
    if GOAL_MEMORY_TOKENS not in tokens:
        lines.append(f"- peak memory of fused <= mcore/{1 / GOAL_MEMORY:.0f} at "
                     f"N={GOAL_MEMORY_TOKENS}: not measured (not in --tokens)")
    return lines


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_max_bytes(device) -> int:
    """80% of the memory available now: MemAvailable on CPU, the free device memory on CUDA."""
    if device.type == "cuda":
        return int(0.8 * torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return int(0.8 * kib * 1024)


def _free_port() -> str:
    """A free TCP port for the 1-rank group, so that two benchmarks on one machine do not clash."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def write_markdown(path, args, device, rows, gs, max_bytes, methods):
    import megatron.core
    dev, cmd = blk._device_and_command(device.type == "cuda")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    chunk = args.chunk_tokens or "the op's default (128 MiB of logits per chunk on CPU)"
    with open(path, "a") as f:
        f.write(f"\n## LM head: fused op vs logits paths, {device.type.upper()}, "
                f"{time.strftime('%Y-%m-%d %H:%M')}\n\n"
                f"- device: {dev}; CPU {cpu_model()}; torch threads {torch.get_num_threads()}; "
                f"load average at the end {load} (shared machine)\n"
                f"- torch {torch.__version__}, megatron-core {megatron.core.__version__}, python "
                f"{platform.python_version()}\n- command: `{cmd}`\n"
                f"- H={args.hidden}, V={args.vocab}, fused op's forward token chunk: {chunk}, "
                "backward: vocabulary blocks of the same size over all tokens; min / median "
                f"of {args.reps} runs after one warm-up, methods interleaved; --max-gib "
                f"{max_bytes / 2**30:.2f}\n- time ratios: method / baseline (higher = slower); "
                f"memory: peak extra above the inputs, incl. hidden.grad and weight.grad\n")
        if "mcore" in methods:
            f.write("- mcore: no entropy (megatron-core's cross entropy has none), so its loss "
                    "lacks the entropy term the others pay for\n")
        f.write("\n" + "\n".join([HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
                                 + [markdown_row(r) for r in rows]) + "\n\nGoals:\n\n"
                + "\n".join(goal_lines(gs, args.tokens)) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="N values")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--hidden", type=int, default=QWEN25_05B["hidden"], help="H (tiny runs)")
    parser.add_argument("--vocab", type=int, default=QWEN25_05B["vocab"], help="V (tiny runs)")
    parser.add_argument("--exact", action="store_true",
                        help="also logits+exact and fused+exact (the exact KL to a reference)")
    parser.add_argument("--skip", nargs="*", default=[], help="methods to leave out, e.g. mcore")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="the fused op's tokens per chunk (default: the op's own)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--max-gib", type=float, default=None,
                        help="skip a case whose inputs + analytic peak exceed this (default: 80%% "
                             "of the memory available at start)")
    parser.add_argument("--out", default=None, help="append a markdown section to this file")
    parser.add_argument("--json", default=None, help="write the rows and goals as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    max_bytes = int(args.max_gib * 2**30) if args.max_gib else default_max_bytes(device)
    names = ["mcore", "logits", "fused"] + (["logits+exact", "fused+exact"] if args.exact else [])
    methods = {k: METHODS[k] for k in names if k not in args.skip}
    if "mcore" in methods:
        os.environ.setdefault("MASTER_PORT", _free_port())
        try:
            from megatron.core import parallel_state
            if not parallel_state.model_parallel_is_initialized():
                blk.init_megatron(device)
        except Exception as exc:  # noqa: BLE001 - report and go on without the baseline
            print(f"megatron-core baseline unavailable: {exc!r}", file=sys.stderr)
            del methods["mcore"]
    if args.chunk_tokens:
        methods = {k: (functools.partial(fn, chunk_tokens=args.chunk_tokens)
                       if k.startswith("fused") else fn) for k, fn in methods.items()}
    print(f"max {max_bytes / 2**30:.2f} GiB per case (inputs + analytic peak)", flush=True)
    print(HEADER, flush=True)
    rows = []
    for n in args.tokens:
        for dt in args.dtypes:
            for r in bench_case(methods, n, args.hidden, args.vocab, dt, device, args.reps,
                                max_bytes, args.chunk_tokens, args.exact):
                rows.append(r)
                print(markdown_row(r), flush=True)
    gs = goals(rows)
    print("\n".join(goal_lines(gs, args.tokens)), flush=True)
    if args.json:
        dev, cmd = blk._device_and_command(device.type == "cuda")
        with open(args.json, "w") as f:
            json.dump({"device": dev, "cpu_model": cpu_model(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "command": cmd,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "hidden": args.hidden,
                       "vocab": args.vocab, "reps": args.reps, "chunk_tokens": args.chunk_tokens,
                       "max_gib": max_bytes / 2**30, "methods": list(methods), "rows": rows,
                       "goals": gs}, f, indent=2)
    if args.out:
        write_markdown(args.out, args, device, rows, gs, max_bytes, methods)


if __name__ == "__main__":
    main()
