"""Trainer -> rollout engine weights: the policy as an HF checkpoint (directory or tensors).

Every path goes through the one shared mapping (`megatron_rl.models.hf_mapping`): the policy's
full megatron state dict is gathered across TP/PP ranks (`Policy.full_state_dict`, collective),
mapped with `megatron_to_hf`, and either written as an HF safetensors directory that a server
reloads (vLLM `reload_weights`, SGLang `/update_weights_from_disk`) or handed over as tensors
(SGLang `/update_weights_from_tensor`, NCCL broadcast).

`WeightExporter` writes one directory per version, `<root>/v<version>`, each complete
(config.json + safetensors + `weight_version.json`), written atomically; older versions are
deleted once a newer one is in use. The newest directory is also what a crashed server restarts
from, so a restart serves the current weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

from megatron_rl.models import hf_mapping

VERSION_FILE = "weight_version.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {sorted(DTYPES)}")
    return DTYPES[dtype]


def policy_hf_state_dict(policy, dst: int | None = 0,
                         dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The policy's weights under HF names, full (unsharded) CPU tensors.

    Collective over all training ranks; returned on global rank `dst` (every rank if None).
    """
    full = policy.full_state_dict(dst=dst)
    if full is None:
        return None
    hf = hf_mapping.megatron_to_hf(full, policy.args, source="policy")
    dtype = to_torch_dtype(dtype)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    return hf


def read_version(path: str) -> int | None:
    """The version tag written into an exported directory, or None (e.g. the base model)."""
    fn = os.path.join(path, VERSION_FILE)
    if not os.path.exists(fn):
        return None
    with open(fn) as f:
        return int(json.load(f)["version"])


class WeightExporter:
    """Versioned HF exports of a policy under `root` (see module docstring).

    dtype: the dtype the rollout server computes in (the exported tensors are cast to it).
    keep: how many newest versions stay on disk (at least 1: the one a restart serves).
    """

    def __init__(self, root: str, dtype: str | torch.dtype | None = None, keep: int = 1):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = os.path.abspath(root)
        self.dtype = to_torch_dtype(dtype)
        self.keep = keep
        self.last_seconds = 0.0

    def path_for(self, version: int) -> str:
        return os.path.join(self.root, f"v{version:06d}")

    def export(self, policy, version: int) -> str | None:
        """Collective: write the policy as `<root>/v<version>` on global rank 0.

        Returns the directory on rank 0, None on the other ranks.
        """
        t0 = time.perf_counter()
        hf = policy_hf_state_dict(policy, dst=0)
        if hf is None:
            return None
        path = self.export_state_dict(hf, policy.args, version)
        self.last_seconds = time.perf_counter() - t0
        return path

    def export_state_dict(self, hf: dict[str, torch.Tensor], args, version: int) -> str:
        """Write an HF state dict (full tensors) as version `version`; returns its directory."""
        os.makedirs(self.root, exist_ok=True)
        path = self.path_for(version)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".version-") as tmp:
            version_file = os.path.join(tmp, VERSION_FILE)
            with open(version_file, "w") as f:
                json.dump({"version": int(version), "time": time.time()}, f)
            hf_mapping.save_hf_checkpoint(hf, args, path, extra_files=(version_file,),
                                          dtype=self.dtype)
        return path

    def prune(self, current: str) -> None:
        """Delete exported versions older than the newest `keep` (never `current`)."""
        if not os.path.isdir(self.root):
            return
        versions = sorted(d for d in os.listdir(self.root)
                          if d.startswith("v") and d[1:].isdigit())
        for d in versions[:-self.keep]:
            full = os.path.join(self.root, d)
            if os.path.abspath(full) != os.path.abspath(current):
                shutil.rmtree(full, ignore_errors=True)
