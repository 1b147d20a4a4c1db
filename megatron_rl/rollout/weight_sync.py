"""Trainer -> rollout engine weights: every way the policy's weights reach an engine.

Every path goes through the one shared mapping (`megatron_rl.models.hf_mapping`): the policy's
full megatron state dict is gathered across TP/PP ranks (`Policy.full_state_dict`, collective),
mapped with `megatron_to_hf`, and handed over in one of four forms (`Payload.kind`):

    disk         an HF safetensors directory the target reloads (vLLM `reload_weights`, SGLang
                 `/update_weights_from_disk`, the process engine's child)
    shared       HF-named tensors in a shared-memory buffer on this host, named bucket by
                 bucket (shm_weights; vLLM's worker extension, the process engine's child)
    tensor       the tensors themselves, for a target that takes them over on this host
                 (SGLang `/update_weights_from_tensor`)
    distributed  the tensors, which the target receives by NCCL broadcast from trainer rank 0
                 (SGLang `/update_weights_from_distributed`, in buckets)

`WeightSync` prepares the payload once (collective over the training ranks; it lands on global
rank 0) and loads it into one target or several (a server pool), each through its
`WeightTarget` method for that form; `sync_engine` is what an engine's `update_weights` runs.

`WeightExporter` writes one directory per version, `<root>/v<version>`, each complete
(config.json + safetensors + `weight_version.json`), written atomically; older versions are
deleted once a newer one is in use. The newest directory is also what a crashed server restarts
from, so a restart serves the current weights. An export holds the lock file `<root>/.export.lock`
(writer_lock) while its temporaries exist; an exporter made when it is free (the next start)
removes what a killed export left: `.version-*`, `.tmp-vNNNNNN-*` and `vNNNNNN.old`, nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from typing import Protocol

import torch

from megatron_rl.models import hf_mapping
from megatron_rl.rollout.shm_weights import SharedBuckets
from megatron_rl.writer_lock import WriterLock, remove_stale

VERSION_FILE = "weight_version.json"
EXPORT_LOCK = ".export.lock"
# what an export creates in its root besides the versions: export_state_dict's directory for the
# version file, hf_mapping.save_hf_checkpoint's temporary (tempfile's 8 characters after the
# prefix) and the `.old` it renames a version being rewritten to
_EXPORT_TEMPS = re.compile(r"\.version-[a-z0-9_]{8}|\.tmp-v\d{6,}-[a-z0-9_]{8}|v\d{6,}\.old")

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
        self.remove_stale()

    def remove_stale(self) -> None:
        """Remove the temporaries of exports into `root` that were killed (_EXPORT_TEMPS), when no
        live export holds its lock; with a warning naming them."""
        if not os.path.isdir(self.root):
            return
        with WriterLock(os.path.join(self.root, EXPORT_LOCK)) as lock:
            if lock.take() == "taken":
                remove_stale([os.path.join(self.root, n) for n in os.listdir(self.root)
                              if _EXPORT_TEMPS.fullmatch(n)], "a weight export")

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
        with WriterLock(os.path.join(self.root, EXPORT_LOCK)) as lock:
            lock.take(wait=True)  # (not held where the file system refuses locks)
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


class WeightTarget(Protocol):
    """What receives weights: an engine's loaders, one per payload form it takes (called on
    global rank 0 with the version the weights are tagged with; each checks the version the
    target reports back)."""

    def load_weights_from_path(self, path: str, version: int) -> None: ...

    def load_weights_from_shared(self, path: str, metas: list[list[dict]],
                                 version: int) -> None: ...

    def load_weights_from_tensors(self, hf: dict[str, torch.Tensor], version: int) -> None: ...

    def load_weights_distributed(self, hf: dict[str, torch.Tensor], version: int) -> None: ...


@dataclasses.dataclass
class Payload:
    """One version of the weights in the form a target loads (see the module docstring):
    `path` for disk; `path` (the shared buffer) and `metas` (one list per bucket) for shared;
    `tensors` for tensor and distributed."""

    kind: str
    version: int
    path: str | None = None
    metas: list[list[dict]] | None = None
    tensors: dict[str, torch.Tensor] | None = None
    nbytes: int = 0


class WeightSync:
    """How the trainer's weights reach one engine or a pool of engines of one kind.

    mode: the --weight-sync mode: "disk", "tensor" or "distributed".
    work_dir: disk exports go to <work_dir>/weights (WeightExporter).
    dtype: the dtype the target computes in; tensors are cast to it.
    bucket_bytes: the most bytes one shared-memory or NCCL bucket names (--weight-sync-bucket-mb).
    shared_memory: under "tensor", the target reads a shared-memory buffer (kind "shared")
        rather than taking the tensors themselves (kind "tensor").
    """

    MODES = ("disk", "tensor", "distributed")

    def __init__(self, mode: str, work_dir: str, dtype: str | torch.dtype | None = None,
                 bucket_bytes: int = 512 << 20, shared_memory: bool = False):
        if mode not in self.MODES:
            raise ValueError(f"weight sync mode {mode!r}; valid: " + ", ".join(self.MODES))
        self.mode, self.dtype, self.bucket_bytes = mode, dtype, bucket_bytes
        self.shared_memory = shared_memory
        self.exporter = WeightExporter(os.path.join(work_dir, "weights"), dtype=dtype)
        self.last_seconds: dict[str, float] = {}
        self.last_bytes = 0
        self._buckets: SharedBuckets | None = None

    def prepare(self, policy, version: int) -> Payload | None:
        """Collective over the training ranks: the policy's weights as this sync's payload, on
        global rank 0 (None on the others)."""
        t0 = time.perf_counter()
        if self.mode == "disk":
            path = self.exporter.export(policy, version)
            self.last_seconds["export"] = time.perf_counter() - t0
            if path is None:
                return None
            nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                         if f.endswith(".safetensors"))
            return Payload("disk", version, path=path, nbytes=nbytes)
        hf = policy_hf_state_dict(policy, dst=0, dtype=self.dtype)
        self.last_seconds["gather"] = time.perf_counter() - t0
        if hf is None:
            return None
        nbytes = sum(t.numel() * t.element_size() for t in hf.values())
        if self.mode == "tensor" and self.shared_memory:
            if self._buckets is None:
                self._buckets = SharedBuckets()
            metas = list(self._buckets.fill(hf, self.bucket_bytes))  # (may move the buffer)
            return Payload("shared", version, path=self._buckets.path, metas=metas,
                           nbytes=nbytes)
        return Payload(self.mode, version, tensors=hf, nbytes=nbytes)

    def load(self, target: WeightTarget, payload: Payload) -> None:
        """Global rank 0: `payload` into `target` (load_payload), timed."""
        t0 = time.perf_counter()
        load_payload(target, payload)
        self.last_seconds["load"] = time.perf_counter() - t0
        self.last_bytes = payload.nbytes

    def prune(self, payload: Payload) -> None:
        """Delete disk exports older than `payload`'s (a restart serves the newest)."""
        if payload.kind == "disk" and payload.path is not None:
            self.exporter.prune(payload.path)

    def close(self) -> None:
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None


def load_payload(target: WeightTarget, payload: Payload) -> None:
    """`payload` into `target`, through the target's loader for the payload's form."""
    if payload.kind == "disk":
        assert payload.path is not None
        target.load_weights_from_path(payload.path, payload.version)
    elif payload.kind == "shared":
        assert payload.path is not None and payload.metas is not None
        target.load_weights_from_shared(payload.path, payload.metas, payload.version)
    elif payload.kind == "tensor":
        assert payload.tensors is not None
        target.load_weights_from_tensors(payload.tensors, payload.version)
    else:
        assert payload.tensors is not None
        target.load_weights_distributed(payload.tensors, payload.version)


def sync_engine(sync: WeightSync, policy, target: WeightTarget, version: int) -> None:
    """An engine's `update_weights`: collective over the training ranks. The weights are
    prepared once and loaded into `target` on global rank 0; every rank waits for the load
    (parallel.run_on_rank: outside the collectives, a failed load raised on every rank)."""
    from megatron_rl.parallel import run_on_rank

    if policy is None:
        raise ValueError(f"update_weights needs the policy: {type(target).__name__}(..., "
                         "policy=policy)")
    t0 = time.perf_counter()
    payload = sync.prepare(policy, version)

    def load() -> None:
        assert payload is not None
        sync.load(target, payload)
        sync.last_seconds["total"] = time.perf_counter() - t0

    run_on_rank(0, load, f"loading weights version {version} into {type(target).__name__}")
