"""The environment of an inference process the trainer starts: a vLLM or SGLang server
(managed_server.ManagedServer) or the process engine's child (process.ProcessEngine).

Such a process is not one of the trainer's ranks, though it inherits their environment. What
describes the trainer's own process is left out:
- torchrun's per-worker variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, ...,
  TORCHELASTIC_*): the child is a world of its own. With TORCHELASTIC_USE_AGENT_STORE=True
  torch's tcp:// rendezvous makes every rank of the child's own process groups (a server's
  tensor-parallel workers, the process engine's world of one) a client of a store that it
  expects torchrun's agent to host, and nobody hosts it; with TORCHELASTIC_ERROR_FILE the
  child's errors would overwrite the worker's report to torchrun.
- the PyTorch caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF and its aliases): they
  are the trainer's, tuned for training. An inference server manages its memory itself:
  expandable segments break the memory pools of vLLM's sleep mode and SGLang's memory saver.
Everything else passes unchanged, CUDA_VISIBLE_DEVICES included: a device index means the same
device in the child as in the trainer.

Standard library only.
"""

from __future__ import annotations

import os
from typing import Mapping

# set by torchrun in every worker (torch/distributed/elastic/agent/server/local_elastic_agent.py)
LAUNCHER_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
LAUNCHER_PREFIX = "TORCHELASTIC_"
ALLOCATOR_VARS = frozenset({"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                            "PYTORCH_HIP_ALLOC_CONF"})


def inference_env(extra: Mapping[str, str] | None = None,
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child inference process: `base` (default: os.environ) without
    the launcher's and the allocator's variables (see the module docstring), then `extra`, the
    child's own settings, on top (these are kept whatever their name)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in LAUNCHER_VARS and k not in ALLOCATOR_VARS
           and not k.startswith(LAUNCHER_PREFIX)}
    env.update(extra or {})
    return env
