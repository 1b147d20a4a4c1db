"""Benchmark: token log-probs + K3 against a reference, forward and forward+backward.

Side by side, on the same inputs, for each (N tokens, V vocab) in a grid:
  naive     PyTorch: fp32 log_softmax, gather, K3 (materializes [N, V] fp32 log-probs)
  mcore     megatron-core `vocab_parallel_cross_entropy` (TP=1 via parallel_state over a
            1-rank gloo/nccl group), log p = -CE, K3 in PyTorch
  ours-*    megatron_rl.ops.token_logprobs_and_kl with each available backend
Reported per case: forward time (scoring under torch.no_grad, as for old/ref log-probs),
forward+backward time (training; loss = sum(logp) + 0.1 * sum(k3), so both gradient paths
run), and peak extra memory of forward+backward, each with its ratio to mcore.

Memory, two columns: "kept fwd->bwd" = tensor bytes still allocated after forward (what is
saved for backward, plus the [N] outputs); "peak extra" = allocator-level peak of live tensor
bytes during forward+backward above what was allocated before the call (logits, targets): on CPU from the torch profiler's memory events (every
allocation and free through c10's CPU allocator, in time order, summed, max taken); on CUDA
from torch.cuda.max_memory_allocated. It includes the grad_logits output (N*V in the logits dtype,
required of every method); "peak excl. grad" subtracts it. The C++ kernels allocate
nothing outside torch tensors except an 8 KiB stack buffer per thread.

HBM floor (CUDA): the bytes that must move (forward: the logits read once; forward+backward:
read, read again, write grad_logits, i.e. 3 N V itemsize) divided by the device-to-device copy
bandwidth measured in the same run (a large torch copy, read + write bytes counted); "% floor"
= floor time / measured time (100% = as fast as a plain copy of those bytes).

--exact: instead of the grid above, the cost of `--kl-estimator exact` in the trainer's loss
function against the K1 path, per backend, on the same inputs (policy logits, reference logits,
targets, reference token log-probs):
  k1-path     token_logprobs_and_kl with entropy, loss sum(logp) + 0.1 sum(K1): what the loss
              function runs for any sampled-token estimator (K1/K2/K3, reward or loss)
  exact-path  the same op given ref_logits (it also returns the exact KL_t; its gradient is added
              into the log-prob gradient's buffer), loss sum(logp) + 0.1 sum(KL_t): the loss
              function with the exact KL in the loss (reward+loss)
  exact-separate  the log-prob op and ops.exact_kl as two autograd ops (same loss): two
              gradient buffers and autograd's sum of them
  exact-op    ops.exact_kl alone
with ratios to k1-path (time: method / k1-path, higher = slower; memory: peak extra / k1-path's).
The reference logits are an input there (not in "peak extra"); in the trainer they are the
reference forward's output, alive from the forward step to the microbatch's backward: one more
[N, V/TP] tensor in the logits dtype ("ref logits MiB").

Usage:
  OMP_NUM_THREADS=2 python tools/bench_logprob_kl.py --threads 2            # CPU grid
  OMP_NUM_THREADS=1 python tools/bench_logprob_kl.py --threads 1 --exact    # exact KL vs K1 path
  python tools/bench_logprob_kl.py --device cuda                             # GPU grid
  python tools/bench_logprob_kl.py --device cuda --shapes 32768x152064 4096x32000 --json r.json
  ... --out benchmarks/RESULTS.md    appends a markdown section with device, versions, command
  ... --json FILE                    writes the rows (and the copy bandwidth) as JSON
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rl.ops import exact_kl, extension_backends, token_logprobs_and_kl  # noqa: E402

# Bytes that must move, as multiples of the logits' size N*V*itemsize: forward reads the logits
# once; backward reads them again and writes grad_logits (one read + one write).
FLOOR_PASSES = {"fwd": 1, "fwd_bwd": 3}


def naive(logits, targets, ref):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_ratio = ref - logp
    return logp, torch.exp(log_ratio) - 1 - log_ratio


def mcore(logits, targets, ref):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    n, v = logits.shape
    logp = -vocab_parallel_cross_entropy(logits.view(n, 1, v), targets.view(n, 1)).view(n)
    log_ratio = ref - logp
    return logp, torch.exp(log_ratio) - 1 - log_ratio


def ours(backend):
    def fn(logits, targets, ref):
        out = token_logprobs_and_kl(logits, targets, ref_logprobs=ref, backend=backend)
        return out.logprobs, out.k3
    return fn


def k1_path(backend):
    """The trainer's loss-function op for sampled-token estimators; `ref` = (ref_lp, ref_logits)."""
    def fn(logits, targets, ref):
        out = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend)
        return out.logprobs, out.logprobs - ref[0]
    return fn


def exact_path(backend):
    """The same op with the reference's logits: also the exact per-position KL, its gradient
    added into the log-prob gradient's buffer (what the trainer's loss function runs)."""
    def fn(logits, targets, ref):
        out = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend,
                                    ref_logits=ref[1])
        return out.logprobs, out.exact_kl
    return fn


def exact_separate(backend):
    """The log-prob op and ops.exact_kl as two autograd ops (two gradient buffers + their sum)."""
    def fn(logits, targets, ref):
        out = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend)
        return out.logprobs, exact_kl(logits, ref[1], backend=backend)
    return fn


def exact_op(backend):
    def fn(logits, targets, ref):
        kl = exact_kl(logits, ref[1], backend=backend)
        return kl, torch.zeros_like(kl)
    return fn


def bench_exact(backends, n, v, dtype, device, reps) -> list[dict]:
    """Rows for k1-path / exact-path / exact-op per backend, ratios to that backend's k1-path."""
    logits, targets, ref_lp = make_inputs(n, v, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    ref_logits = torch.empty_like(logits)  # in row chunks: at 32768 x 152064 the whole-tensor
    step = max(1, (1 << 28) // v)          # fp32 temporaries alone would take ~60 GiB
    for i in range(0, n, step):
        rows = logits[i:i + step].float()
        ref_logits[i:i + step] = rows.add_(torch.randn(rows.shape, generator=gen,
                                                       device=device)).to(dtype)
    ref = (ref_lp, ref_logits)
    methods = {}
    for b in backends:
        methods.update({f"k1-path-{b}": k1_path(b), f"exact-path-{b}": exact_path(b),
                        f"exact-separate-{b}": exact_separate(b), f"exact-op-{b}": exact_op(b)})
    fwd = time_methods(methods, logits, targets, ref, False, device, reps)
    both = time_methods(methods, logits, targets, ref, True, device, reps)
    mem = {name: memory_of(fn, logits, targets, ref, device) for name, fn in methods.items()}
    ref_mib = ref_logits.numel() * ref_logits.element_size() / 2**20
    rows = []
    for name in methods:
        base = f"k1-path-{name.rsplit('-', 1)[1]}"
        kept, peak = mem[name]
        rows.append({"n": n, "v": v, "method": name, "fwd_ms": fwd[name] * 1e3,
                     "fwd_bwd_ms": both[name] * 1e3, "kept_mib": kept / 2**20,
                     "peak_extra_mib": peak / 2**20, "ref_logits_mib": ref_mib,
                     "fwd_x_k1": fwd[name] / fwd[base], "fwd_bwd_x_k1": both[name] / both[base],
                     "peak_x_k1": peak / mem[base][1]})
    return rows


def exact_markdown_row(r: dict) -> str:
    return (f"| {r['n']} | {r['v']} | {r['method']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
            f"{r['kept_mib']:.2f} | {r['peak_extra_mib']:.1f} | {r['ref_logits_mib']:.1f} | "
            f"{r['fwd_x_k1']:.2f}x | {r['fwd_bwd_x_k1']:.2f}x | {r['peak_x_k1']:.2f} |")


def init_megatron(device):
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_once(fn, logits, targets, ref, backward):
    if not backward:
        with torch.no_grad():
            fn(logits, targets, ref)
        return
    x = logits.requires_grad_(True)
    logp, k3 = fn(x, targets, ref)
    (logp.sum() + 0.1 * k3.sum()).backward()
    x.grad = None
    x.requires_grad_(False)


def time_steps(steps, device, reps) -> dict[str, list[float]]:
    """{name: [seconds of each rep]} of zero-argument `steps`: each run once to warm up, then
    `reps` rounds interleaved round-robin, so that on a shared machine each one sees the same
    background load."""
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(reps):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def time_methods(methods, logits, targets, ref, backward, device, reps):
    """{name: min seconds} of `run_once` per method, interleaved (see time_steps); the minimum
    estimates the uncontended time."""
    steps = {name: functools.partial(run_once, fn, logits, targets, ref, backward)
             for name, fn in methods.items()}
    return {name: min(ts) for name, ts in time_steps(steps, device, reps).items()}


class _quiet_stderr:
    """Silence the profiler's start/stop lines (written by kineto to fd 2)."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)


def _cpu_live_and_peak(step):
    """(bytes still live after step(), peak live bytes during it), both relative to its start."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # pyright: ignore[reportAttributeAccessIssue] (not in torch's stubs)
        peak = max(peak, live)
    return live, peak, result


def peak_extra(forward, backward, device):
    """(bytes still allocated after `forward()`: what it keeps for backward, plus its outputs;
    peak bytes allocated during `forward()` then `backward(its result)`), both relative to what
    was allocated before. CUDA: the caching allocator's counters; CPU: the profiler's memory
    events (see _cpu_live_and_peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = forward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        backward(out)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        kept, fwd_peak, out = _cpu_live_and_peak(forward)
        _, bwd_peak, _ = _cpu_live_and_peak(lambda: backward(out))
        peak = max(fwd_peak, kept + bwd_peak)
    return kept, peak


def memory_of(fn, logits, targets, ref, device):
    """(bytes kept from forward to backward, peak extra bytes of forward+backward)."""
    x = logits.requires_grad_(True)
    kept, peak = peak_extra(lambda: fn(x, targets, ref),
                            lambda out: (out[0].sum() + 0.1 * out[1].sum()).backward(), device)
    x.grad = None
    x.requires_grad_(False)
    return kept, peak


def copy_bandwidth_gbps(device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), the best of `reps`
    copies of an `nbytes` buffer, timed with CUDA events."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


def parse_shapes(args, gpu: bool) -> list[tuple[int, int]]:
    """(N, V) pairs: --shapes NxV ..., else the grid --tokens x --vocab (device defaults)."""
    if args.shapes:
        return [(int(n), int(v)) for n, v in (s.lower().split("x") for s in args.shapes)]
    tokens = args.tokens or ([4096, 8192, 16384, 32768] if gpu else [512, 2048])
    vocabs = args.vocab or ([32000, 152064] if gpu else [32000, 152064 // 4])
    return [(n, v) for n in tokens for v in vocabs]


def make_inputs(n: int, v: int, dtype, device, seed: int = 0):
    """logits ~ 2 N(0, 1) in `dtype`, targets, reference log-probs; generated on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, device=device) * 2).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    ref = -torch.rand(n, generator=gen, device=device) * 10
    return logits, targets, ref


def bench_shape(methods, n, v, dtype, device, reps, floor_gbps) -> list[dict]:
    """One row per method: times, memory, ratios to mcore and (with floor_gbps) % of the floor."""
    logits, targets, ref = make_inputs(n, v, dtype, device)
    try:
        fwd = time_methods(methods, logits, targets, ref, False, device, reps)
        both = time_methods(methods, logits, targets, ref, True, device, reps)
    except torch.OutOfMemoryError:
        fwd = both = None
        logits.requires_grad_(False)
        logits.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results = {}
    for name, fn in methods.items():
        try:
            if fwd is None:  # retry alone: some method ran out of memory
                one = {name: fn}
                fwd_t = time_methods(one, logits, targets, ref, False, device, reps)[name]
                both_t = time_methods(one, logits, targets, ref, True, device, reps)[name]
            else:
                fwd_t, both_t = fwd[name], both[name]
            kept, mem = memory_of(fn, logits, targets, ref, device)
            results[name] = (fwd_t, both_t, kept, mem)
        except torch.OutOfMemoryError:
            results[name] = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    grad_bytes = logits.numel() * logits.element_size()
    del logits, targets, ref
    base = results.get("mcore")
    rows = []
    for name, res in results.items():
        if res is None:
            rows.append({"n": n, "v": v, "method": name, "oom": True})
            continue
        fwd_t, both_t, kept, mem = res
        row = {"n": n, "v": v, "method": name, "fwd_ms": fwd_t * 1e3, "fwd_bwd_ms": both_t * 1e3,
               "kept_mib": kept / 2**20, "peak_extra_mib": mem / 2**20,
               "grad_mib": grad_bytes / 2**20, "peak_excl_grad_mib": (mem - grad_bytes) / 2**20,
               "fwd_x_mcore": base[0] / fwd_t if base else None,
               "fwd_bwd_x_mcore": base[1] / both_t if base else None,
               "peak_over_mcore": mem / base[3] if base else None}
        if floor_gbps:
            for key, t in (("fwd", fwd_t), ("fwd_bwd", both_t)):
                floor_s = FLOOR_PASSES[key] * grad_bytes / (floor_gbps * 1e9)
                row[f"{key}_floor_ms"] = floor_s * 1e3
                row[f"{key}_pct_floor"] = 100 * floor_s / t
        rows.append(row)
    return rows


def markdown_row(r: dict, gpu: bool) -> str:
    if r.get("oom"):
        return f"| {r['n']} | {r['v']} | {r['method']} | OOM |" + " |" * (8 + 2 * gpu)
    f = lambda x, spec=".2f", suffix="": "" if x is None else f"{x:{spec}}{suffix}"  # noqa: E731
    base_excl = (r["peak_excl_grad_mib"] / (r["peak_extra_mib"] / r["peak_over_mcore"]
                                            - r["grad_mib"])
                 if r["peak_over_mcore"] else None)
    line = (f"| {r['n']} | {r['v']} | {r['method']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
            f"{r['kept_mib']:.2f} | {r['peak_extra_mib']:.1f} | {r['peak_excl_grad_mib']:.2f} | "
            f"{f(r['fwd_x_mcore'], '.2f', 'x')} | {f(r['fwd_bwd_x_mcore'], '.2f', 'x')} | "
            f"{f(r['peak_over_mcore'], '.3f')} | {f(base_excl, '.4f')} |")
    if gpu:
        line += f" {f(r.get('fwd_pct_floor'), '.0f', '%')} | {f(r.get('fwd_bwd_pct_floor'), '.0f', '%')} |"
    return line


def _device_and_command(gpu: bool) -> tuple[str, str]:
    """The device a result was measured on, and the command line that measured it."""
    dev = (torch.cuda.get_device_name() if gpu else
           f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    cmd = " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "unset"),
                    "python"] + sys.argv)
    return dev, cmd


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", nargs="+", help="NxV cases, e.g. 32768x152064 4096x32000")
    parser.add_argument("--tokens", type=int, nargs="+", help="N grid (without --shapes)")
    parser.add_argument("--vocab", type=int, nargs="+", help="V grid (without --shapes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=[], help="methods to skip, e.g. naive")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="floor bandwidth in GB/s instead of the measured copy bandwidth")
    parser.add_argument("--out", default=None, help="append a markdown section to this file")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this file")
    parser.add_argument("--exact", action="store_true",
                        help="benchmark the exact KL (k1-path vs exact-path) instead of the grid")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device.type == "cuda"
    shapes = parse_shapes(args, gpu)
    reps = args.reps or (10 if gpu else 3)
    dtype = getattr(torch, args.dtype)
    if args.exact:
        return main_exact(args, device, shapes, reps, dtype)

    methods = {"naive": naive}
    try:
        init_megatron(device)
        methods["mcore"] = mcore
    except Exception as exc:  # noqa: BLE001 - report and go on without the baseline
        print(f"megatron-core baseline unavailable: {exc!r}", file=sys.stderr)
    methods["ours-torch"] = ours("torch")
    for b in extension_backends():
        if b == device.type:
            methods[f"ours-{b}"] = ours(b)
    methods = {k: v for k, v in methods.items() if k not in args.skip}

    copy_gbps = copy_bandwidth_gbps(device) if gpu else None
    floor_gbps = args.hbm_gbps or copy_gbps
    if gpu:
        print(f"device-to-device copy bandwidth (read + write): {copy_gbps:.0f} GB/s; floor uses "
              f"{floor_gbps:.0f} GB/s", flush=True)
    header = ("| N | V | method | fwd ms | fwd+bwd ms | kept fwd->bwd MiB | peak extra MiB | "
              "peak excl. grad MiB | fwd x mcore | fwd+bwd x mcore | peak / mcore | "
              "peak excl. grad / mcore |" + (" fwd % floor | fwd+bwd % floor |" if gpu else ""))
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    print(header, flush=True)
    rows = []
    for n, v in shapes:
        for r in bench_shape(methods, n, v, dtype, device, reps, floor_gbps if gpu else None):
            rows.append(r)
            lines.append(markdown_row(r, gpu))
            print(lines[-1], flush=True)

    dev, cmd = _device_and_command(gpu)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"device": dev, "dtype": args.dtype, "torch": torch.__version__,
                       "cuda": torch.version.cuda, "copy_gbps": copy_gbps,
                       "floor_gbps": floor_gbps if gpu else None, "reps": reps,
                       "floor_passes": FLOOR_PASSES, "extension_backends": list(extension_backends()),
                       "methods": list(methods), "command": cmd, "rows": rows}, f, indent=2)
    if args.out:
        ext = extension_backends()
        isa = ""
        if "cpu" in ext:
            from megatron_rl import _C
            isa = f", CPU kernel variant {_C.cpu_isa()}"
        import megatron.core
        with open(args.out, "a") as f:
            f.write(f"\n## {device.type.upper()} {args.dtype}, {time.strftime('%Y-%m-%d')}\n\n")
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            f.write(f"- device: {dev}; torch threads {torch.get_num_threads()}{isa}; "
                    f"load average at the end {load} (shared machine)\n")
            if gpu:
                f.write(f"- measured device-to-device copy bandwidth {copy_gbps:.0f} GB/s "
                        f"(read + write); % floor = (bytes that must move / {floor_gbps:.0f} "
                        f"GB/s) / time\n")
            thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
            if thp:
                f.write(f"- THP_MEM_ALLOC_ENABLE={thp} (c10 CPU allocator uses huge pages)\n")
            f.write(f"- torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
                    f"python {platform.python_version()}, extension backends {list(ext)}\n")
            f.write(f"- command: `{cmd}`\n- minimum of {reps} runs after one warm-up, methods "
                    f"interleaved round-robin; "
                    f"x mcore = mcore time / method time (higher is faster); "
                    f"mem / mcore = peak extra memory ratio (lower is better)\n\n")
            f.write("\n".join(lines) + "\n")


def main_exact(args, device: torch.device, shapes, reps: int, dtype: torch.dtype) -> None:
    """--exact: the exact-KL op against the K1 path (setup from main)."""
    gpu = device.type == "cuda"
    backends = [b for b in ("torch",) + extension_backends()
                if b == "torch" or b == device.type]
    backends = [b for b in backends if b not in args.skip]
    header = ("| N | V | method | fwd ms | fwd+bwd ms | kept fwd->bwd MiB | peak extra MiB | "
              "ref logits MiB | fwd / k1-path | fwd+bwd / k1-path | peak / k1-path |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    print(header, flush=True)
    rows = []
    for n, v in shapes:
        for r in bench_exact(backends, n, v, dtype, device, reps):
            rows.append(r)
            lines.append(exact_markdown_row(r))
            print(lines[-1], flush=True)
    dev, cmd = _device_and_command(gpu)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"device": dev, "dtype": args.dtype, "torch": torch.__version__,
                       "reps": reps, "backends": backends, "command": cmd, "rows": rows}, f,
                      indent=2)
    if args.out:
        isa = ""
        if "cpu" in extension_backends():
            from megatron_rl import _C
            isa = f", CPU kernel variant {_C.cpu_isa()}"
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        with open(args.out, "a") as f:
            f.write(f"\n### Exact KL vs the K1 path, {device.type.upper()} {args.dtype}, "
                    f"{time.strftime('%Y-%m-%d')}\n\n")
            f.write(f"- device: {dev}; torch threads {torch.get_num_threads()}{isa}; load average "
                    f"at the end {load} (shared machine); torch {torch.__version__}\n")
            f.write(f"- command: `{cmd}`\n- minimum of {reps} runs after one warm-up, methods "
                    f"interleaved round-robin; ratios to the same backend's k1-path (time: "
                    f"higher = slower; memory: peak extra)\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
