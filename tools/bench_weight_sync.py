#!/usr/bin/env python
"""Seconds per GB of a trainer -> rollout engine weight sync, for each engine and mode.

A random Qwen2-shaped model of about --target-gb (fp32; hidden 1024, 16 heads / 4 KV heads,
FFN 2816, vocabulary 32000, layers to fit) is loaded into a TP1 Policy; each engine is started
from the same HF checkpoint, and `engine.update_weights(v)` (what the trainer calls after every
step: gather under HF names, hand over, load, version check) is timed --repeats times:

    process  tensor   shared-memory buckets -> the child's Policy
    process  disk     HF safetensors export -> the child reloads it
    vllm     tensor   shared-memory buckets -> the workers' layer-wise reload (worker extension)
    vllm     disk     HF safetensors export -> the workers' in-place reload
    sglang   tensor / disk   (only where .venv-sglang exists)

Prints a table (median seconds, GB moved, seconds per GB) and writes --json.

    python tools/bench_weight_sync.py --json benchmarks/weight_sync_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_model(path: str, target_gb: float) -> dict:
    from megatron_rl.experiments.tiny_model import make_char_model

    h, ffn, vocab = 1024, 2816, 32000
    per_layer = 2 * h * h + 2 * h * 256 + 3 * h * ffn + 2 * h
    layers = max(1, round((target_gb * 2 ** 30 / 4 - vocab * h) / per_layer))
    cfg = dict(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
               max_position_embeddings=512, eos_token_id=1, pad_token_id=0, seed=0)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_char_model(path, **cfg)
    return cfg


def make_engine(name: str, mode: str, hf: str, work: str, policy):
    if name == "process":
        from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

        return ProcessEngine(ProcessConfig(hf_checkpoint=hf, work_dir=work, sync=mode),
                             policy=policy)
    if name == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        return VLLMEngine(hf, VLLMConfig(work_dir=work, dtype="float32", sync=mode,
                                         kv_cache_memory_bytes=1 << 30, max_model_len=512),
                          policy=policy)
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

    return SGLangEngine(hf, SGLangConfig(work_dir=work, dtype="float32", sync=mode,
                                         context_length=512, mem_fraction_static=0.1),
                        policy=policy)


def available(name: str) -> str | None:
    """None when the engine can run here, else why not."""
    if name == "vllm":
        from megatron_rl.rollout.vllm_engine import vllm_python

        return None if vllm_python() else "no vLLM venv (scripts/install_vllm_cpu.sh)"
    if name == "sglang":
        from megatron_rl.rollout.sglang_engine import sglang_python

        return None if sglang_python() else "no SGLang venv (scripts/install_sglang_cpu.sh)"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-gb", type=float, default=0.5, help="model size in fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", nargs="+", default=["process", "vllm", "sglang"])
    p.add_argument("--modes", nargs="+", default=["tensor", "disk"])
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    import torch

    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    work = a.work or tempfile.mkdtemp(prefix="bench_weight_sync-")
    hf = os.path.join(work, "model")
    cfg = make_model(hf, a.target_gb)
    init_distributed(ParallelConfig())
    policy = Policy(ModelArgs.from_pretrained(hf), trainable=False)
    policy.load_hf(hf)
    gb = sum(t.numel() * t.element_size() for t in policy.module.state_dict().values()
             if t is not None and hasattr(t, "numel")) / 2 ** 30
    print(f"model: {cfg['num_hidden_layers']} layers, {gb:.3f} GB fp32 ({work})", flush=True)
    rows = []
    for name in a.engines:
        why = available(name)
        if why:
            print(f"{name}: skipped, {why}", flush=True)
            rows.append({"engine": name, "skipped": why})
            continue
        for mode in a.modes:
            t0 = time.perf_counter()
            engine = make_engine(name, mode, hf, os.path.join(work, f"{name}-{mode}"), policy)
            boot = time.perf_counter() - t0
            times = []
            try:
                for v in range(1, a.repeats + 1):
                    with torch.no_grad():  # a changed policy each time, as after a step
                        next(policy.module.parameters()).add_(1e-3)
                    t = time.perf_counter()
                    engine.update_weights(v)
                    times.append(time.perf_counter() - t)
            finally:
                engine.shutdown()
            sec = statistics.median(times)
            rows.append({"engine": name, "mode": mode, "seconds": times, "median_s": sec,
                         "gb": gb, "s_per_gb": sec / gb, "boot_s": boot})
            print(f"{name:8s} {mode:7s} median {sec:7.3f} s  ({sec / gb:6.2f} s/GB; runs "
                  f"{', '.join(f'{t:.3f}' for t in times)}; boot {boot:.0f} s)", flush=True)
    destroy_distributed()
    out = {"model_gb": gb, "model": cfg, "rows": rows, "cpu": platform.processor(),
           "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                       time.gmtime())}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    print("\n| engine | mode | median s | s/GB |\n|---|---|---|---|")
    for r in rows:
        if "skipped" not in r:
            print(f"| {r['engine']} | {r['mode']} | {r['median_s']:.3f} | {r['s_per_gb']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
