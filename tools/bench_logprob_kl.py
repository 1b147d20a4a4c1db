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

Usage:
  OMP_NUM_THREADS=2 python tools/bench_logprob_kl.py --threads 2            # CPU grid
  python tools/bench_logprob_kl.py --device cuda                             # GPU grid
  ... --out benchmarks/RESULTS.md    appends a markdown section with device, versions, command
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rl.ops import extension_backends, token_logprobs_and_kl  # noqa: E402

# Nominal HBM bandwidth (GB/s) by device-name substring, for the "fraction of bound" column.
HBM_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0,
            "H100": 3350.0, "A100": 2039.0}


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


def time_methods(methods, logits, targets, ref, backward, device, reps):
    """{name: min seconds}. Methods are interleaved round-robin, so that on a shared machine
    each one sees the same background load; the minimum estimates the uncontended time."""
    times = {name: [] for name in methods}
    for fn in methods.values():
        run_once(fn, logits, targets, ref, backward)  # warm-up
    for _ in range(reps):
        for name, fn in methods.items():
            sync(device)
            t0 = time.perf_counter()
            run_once(fn, logits, targets, ref, backward)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


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
        live += e.nbytes()
        peak = max(peak, live)
    return live, peak, result


def memory_of(fn, logits, targets, ref, device):
    """(bytes kept from forward to backward, peak extra bytes of forward+backward)."""
    x = logits.requires_grad_(True)
    forward = lambda: fn(x, targets, ref)  # noqa: E731
    backward = lambda logp, k3: (logp.sum() + 0.1 * k3.sum()).backward()  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, k3 = forward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        backward(logp, k3)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        kept, fwd_peak, (logp, k3) = _cpu_live_and_peak(forward)
        _, bwd_peak, _ = _cpu_live_and_peak(lambda: backward(logp, k3))
        peak = max(fwd_peak, kept + bwd_peak)
    del logp, k3
    x.grad = None
    x.requires_grad_(False)
    return kept, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, nargs="+", help="N grid")
    parser.add_argument("--vocab", type=int, nargs="+", help="V grid")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=[], help="methods to skip, e.g. naive")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="override HBM bound")
    parser.add_argument("--out", default=None, help="append a markdown section to this file")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = device.type == "cuda"
    tokens = args.tokens or ([4096, 8192, 16384, 32768] if gpu else [512, 2048])
    vocabs = args.vocab or ([32000, 152064] if gpu else [32000, 152064 // 4])
    reps = args.reps or (10 if gpu else 3)
    dtype = getattr(torch, args.dtype)

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

    hbm = args.hbm_gbps
    if gpu and hbm is None:
        name = torch.cuda.get_device_name()
        hbm = next((bw for key, bw in HBM_GBPS.items() if key in name), None)

    header = ("| N | V | method | fwd ms | fwd+bwd ms | kept fwd->bwd MiB | peak extra MiB | "
              "peak excl. grad MiB | fwd x mcore | fwd+bwd x mcore | peak / mcore | "
              "peak excl. grad / mcore |"
              + (" fwd+bwd GB/s | % HBM |" if gpu else ""))
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    print(header, flush=True)
    gen = torch.Generator().manual_seed(0)
    for n in tokens:
        for v in vocabs:
            logits = (torch.randn(n, v, generator=gen) * 2).to(dtype).to(device)
            targets = torch.randint(0, v, (n,), generator=gen).to(device)
            ref = (-torch.rand(n, generator=gen) * 10).to(device)
            results = {}
            try:
                fwd = time_methods(methods, logits, targets, ref, False, device, reps)
                both = time_methods(methods, logits, targets, ref, True, device, reps)
            except torch.OutOfMemoryError:
                fwd = both = None
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
                    if gpu:
                        torch.cuda.empty_cache()
            base = results.get("mcore")
            grad_bytes = logits.numel() * logits.element_size()
            for name, res in results.items():
                if res is None:
                    line = (f"| {n} | {v} | {name} | OOM | OOM | OOM | OOM | OOM | | | | |"
                            + (" | |" if gpu else ""))
                else:
                    fwd, both, kept, mem = res
                    speedup = lambda t, t_base: f"{t_base / t:.2f}x"  # noqa: E731
                    # grad_logits in the logits dtype is an output every method must produce.
                    beyond = mem - grad_bytes
                    line = (f"| {n} | {v} | {name} | {fwd * 1e3:.2f} | {both * 1e3:.2f} | "
                            f"{kept / 2**20:.2f} | {mem / 2**20:.1f} | {beyond / 2**20:.2f} | "
                            f"{speedup(fwd, base[0]) if base else ''} | "
                            f"{speedup(both, base[1]) if base else ''} | "
                            f"{f'{mem / base[3]:.3f}' if base else ''} | "
                            f"{f'{beyond / (base[3] - grad_bytes):.4f}' if base else ''} |")
                    if gpu:
                        # One read in forward, one read + one write in backward.
                        gbps = 3 * n * v * logits.element_size() / both / 1e9
                        line += f" {gbps:.0f} | {100 * gbps / hbm:.0f}% |" if hbm else f" {gbps:.0f} | |"
                print(line, flush=True)
                rows.append(line)
            del logits

    if args.out:
        ext = extension_backends()
        isa = ""
        if "cpu" in ext:
            from megatron_rl import _C
            isa = f", CPU kernel variant {_C.cpu_isa()}"
        import megatron.core
        dev = (torch.cuda.get_device_name() if gpu else
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
        cmd = " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "unset"),
                        "python"] + sys.argv)
        with open(args.out, "a") as f:
            f.write(f"\n## {device.type.upper()} {args.dtype}, {time.strftime('%Y-%m-%d')}\n\n")
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            f.write(f"- device: {dev}; torch threads {torch.get_num_threads()}{isa}; "
                    f"load average at the end {load} (shared machine)\n")
            thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
            if thp:
                f.write(f"- THP_MEM_ALLOC_ENABLE={thp} (c10 CPU allocator uses huge pages)\n")
            f.write(f"- torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
                    f"python {platform.python_version()}, extension backends {list(ext)}\n")
            f.write(f"- command: `{cmd}`\n- minimum of {reps} runs after one warm-up, methods "
                    f"interleaved round-robin; "
                    f"x mcore = mcore time / method time (higher is faster); "
                    f"mem / mcore = peak extra memory ratio (lower is better)\n\n")
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
