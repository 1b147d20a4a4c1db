"""Process groups for torchrun launches: tensor, pipeline and data parallelism.

NCCL on GPUs, gloo on CPU. The world is laid out by megatron-core's parallel_state
(TP innermost, then DP, then PP). On CPU the megatron-core compatibility shims are applied first.
"""

from __future__ import annotations

import dataclasses
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline parallel size "
                f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size}")
        return world_size // mp


def device() -> torch.device:
    """This rank's device: its local GPU under torchrun, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (and megatron's CUDA RNG tracker on GPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_distributed(cfg: ParallelConfig, seed: int = 1234, timeout_s: int = 600) -> int:
    """Initialise torch.distributed from torchrun's env vars and megatron's model-parallel groups.

    Works without torchrun too (a single process, world size 1). Returns the data-parallel size.
    """
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        from megatron_rl.compat import apply_cpu_compat

        apply_cpu_compat()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = cfg.data_parallel_size(world)
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "nccl"
        else:
            backend = "gloo"
        if "WORLD_SIZE" in os.environ:  # launched by torchrun: MASTER_ADDR/PORT from the env
            init_method = "env://"
        else:  # a plain single process: a private port, and the environment left untouched
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        )
    set_seed(seed)
    return dp


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
