"""Weights through shared memory: the trainer writes HF-named tensors into one memory-mapped
file, bucket by bucket, and a generator process on the same host reads them from there.

Used by `--weight-sync tensor` on CPU: the process engine (rollout/process.py) and the vLLM
worker extension (rollout/vllm_worker.py) read the buckets. No disk, no serialisation: one copy
into the shared buffer on the trainer's side, one copy out of it into the generator's
parameters.

    writer = SharedBuckets(capacity)           # trainer, global rank 0
    for meta in writer.fill(hf_tensors):       # a bucket at a time; the buffer is reused
        tell_reader(writer.path, meta)         # the reader copies out before the next bucket
    writer.close()                             # unlinks the file

    tensors = read_bucket(path, meta)          # reader: {name: view into the mapping}

The buffer lives in /dev/shm (RAM) when it has room, else in the temp directory (still page
cache, but it may reach disk). Its capacity is max(bucket size, largest tensor): a tensor is
never split. This module imports only torch and the standard library, so it loads inside a
vLLM server's venv.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Iterator

import torch

ALIGN = 64  # every tensor starts at a multiple of this many bytes (any dtype's view is aligned)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_names(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of `tensors` in insertion order, cut into groups of at most `bucket_bytes`
    (aligned sizes; a tensor larger than a bucket gets a group of its own)."""
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name, t in tensors.items():
        n = _aligned(_nbytes(t))
        if cur and size + n > bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        groups.append(cur)
    return groups


def _shm_dir(nbytes: int) -> str:
    """/dev/shm when it exists with `nbytes` free (Docker's default is only 64 MiB), else the
    temp directory."""
    d = "/dev/shm"
    if os.path.isdir(d) and os.access(d, os.W_OK):
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize >= nbytes + (16 << 20):
            return d
    return tempfile.gettempdir()


class SharedBuckets:
    """The writer: a shared, memory-mapped buffer of `capacity` bytes (grown on demand)."""

    def __init__(self, capacity: int, prefix: str = "megatron-rl-weights"):
        self.capacity = 0
        self.prefix = prefix
        self.path: str | None = None
        self._buf: torch.Tensor | None = None
        self._reserve(_aligned(max(capacity, ALIGN)))

    def _reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self.close()
        self.path = os.path.join(_shm_dir(capacity),
                                 f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(self.path, "wb") as f:
            f.truncate(capacity)
        self._buf = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
        self.capacity = capacity

    def fill(self, tensors: dict[str, torch.Tensor], bucket_bytes: int | None = None
             ) -> Iterator[list[dict]]:
        """Copy `tensors` into the buffer a bucket at a time; yields each bucket's metadata
        (name, dtype, shape, byte offset per tensor). The next bucket overwrites the buffer, so
        the reader must have copied the previous one out before the generator resumes."""
        bucket_bytes = bucket_bytes or self.capacity
        largest = max((_aligned(_nbytes(t)) for t in tensors.values()), default=0)
        self._reserve(max(largest, min(bucket_bytes, self.capacity)))
        for names in bucket_names(tensors, min(bucket_bytes, self.capacity)):
            meta, off = [], 0
            for name in names:
                t = tensors[name].detach()
                n = _nbytes(t)
                dst = self._buf[off:off + n].view(t.dtype).view(t.shape)
                dst.copy_(t)
                meta.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""),
                             "shape": list(t.shape), "offset": off})
                off += _aligned(n)
            yield meta

    def close(self) -> None:
        self._buf = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None
            self.capacity = 0

    def __del__(self):
        self.close()


def read_bucket(path: str, meta: list[dict]) -> dict[str, torch.Tensor]:
    """{name: tensor} of one bucket written by SharedBuckets.fill: views into the mapped file,
    valid until the writer fills the next bucket (copy them out)."""
    if not meta:
        return {}
    end = max(m["offset"] + _aligned(_numel(m["shape"]) * _DTYPES[m["dtype"]].itemsize)
              for m in meta)
    if not os.path.exists(path):
        raise FileNotFoundError(f"shared weight buffer {path} is gone (the trainer closed it)")
    size = os.path.getsize(path)
    if end > size:
        raise ValueError(f"shared weight buffer {path} has {size} bytes, the bucket needs {end}")
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    out = {}
    for m in meta:
        dtype = _DTYPES[m["dtype"]]
        n = _numel(m["shape"]) * dtype.itemsize
        out[m["name"]] = buf[m["offset"]:m["offset"] + n].view(dtype).view(m["shape"])
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
