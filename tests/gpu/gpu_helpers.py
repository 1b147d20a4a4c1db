"""Shared pieces of the gpu test tier (tests/gpu): tiny models and data, and the rule that on a
machine with CUDA the CUDA kernel must have been built (a silent skip would hide a failed build).
Imported as `gpu_helpers` (pytest puts this directory on sys.path; there is no conftest here so
that the `conftest` modules of other test directories keep their names)."""
from __future__ import annotations

import os

import pytest
import torch


def require_cuda_kernel() -> None:
    """Fail (not skip) when CUDA is present but megatron_rl._C has no CUDA kernel."""
    from megatron_rl.ops import extension_backends

    if "cuda" not in extension_backends():
        pytest.fail("megatron_rl._C has no CUDA kernel: build it on this machine first "
                    "(python setup.py build_ext --inplace, or pip install --no-build-isolation "
                    "-e .; scripts/gpu_check.sh does it)")


def single_gpu_rank() -> None:
    """torch.distributed and megatron's groups for one process at TP1 PP1 (NCCL on a GPU)."""
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(1, 1))


def char_model(path: str, seed: int, **overrides) -> str:
    """A random tiny Qwen2 with the character tokenizer, as tests/e2e and the CPU demo use
    (built once per path)."""
    from megatron_rl.experiments.tiny_model import make_char_model

    if not os.path.exists(os.path.join(path, "config.json")):
        make_char_model(path, seed, **overrides)
    return path


def arithmetic_jsonl(path: str) -> str:
    """64 two-term additions as prepared JSONL (task "arithmetic")."""
    from megatron_rl.data.records import TaskExample, write_jsonl

    rows = [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
            for a in range(8) for b in range(8)]
    write_jsonl(path, rows)
    return path


def train_args(model: str, data: str, save: str, iters: int, extra=(), ref: str | None = None):
    """Flags of a short RL run (as tests/e2e/conftest.py's train_args)."""
    return ["--hf-checkpoint", model, "--train-data", data, "--save", save,
            *(["--ref-checkpoint", ref] if ref else []),
            "--train-iters", str(iters), "--num-prompts-per-step", "4", "--group-size", "2",
            "--max-new-tokens", "6", "--lr", "1e-2", "--micro-batch-size", "8",
            "--prompt-template", "{prompt}=", "--no-task-instruction", "--seed", "3", *extra]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()
