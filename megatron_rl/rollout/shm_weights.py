"""Weights through shared memory: the trainer writes HF-named tensors into one memory-mapped
file and hands them over bucket by bucket; a generator process on the same host reads them
from there.

Used by `--weight-sync tensor` on CPU (and for same-host servers on GPUs): the process engine
(rollout/process.py) and the vLLM worker extension (rollout/vllm_worker.py) read the buckets.
No disk, no serialisation: one copy into the shared buffer on the trainer's side, one copy out
of it into the generator's parameters.

    writer = SharedBuckets()                   # trainer, global rank 0; reused every sync
    for meta in writer.fill(hf_tensors, bucket_bytes):
        tell_reader(writer.path, meta)         # one request per bucket
    load_in_reader()                           # the reader loads the views it was given
    writer.close()                             # unlinks the file

    tensors = read_bucket(path, meta)          # reader: {name: view into the mapping}

Every tensor of a sync has a region of its own (the buffer grows to the model's size once and is
reused by the next sync), so the reader can stage views of all buckets and load them together
without copying them first: a reload that must see all of a layer's weights at once (vLLM's
layer-wise reload, the fused QKV of megatron) gets them. The bucket size only sets how many
tensors each request names. The views stay valid until the writer's next fill.

The buffer lives in /dev/shm (RAM) when it has room, else in the temp directory (still page
cache, but it may reach disk). This module imports only torch and the standard library, so it
loads inside a vLLM server's venv.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import weakref
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
    """The writer: a shared, memory-mapped buffer (grown to the size of what it is given)."""

    def __init__(self, capacity: int = ALIGN, prefix: str = "megatron-rl-weights"):
        self.capacity = 0
        self.prefix = prefix
        self.path: str | None = None
        self._buf: torch.Tensor | None = None
        self._reserve(_aligned(max(capacity, ALIGN)))

    def _reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self.close()
        name = f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for d in dict.fromkeys((_shm_dir(capacity), tempfile.gettempdir())):
            path = os.path.join(d, name)
            try:
                with open(path, "wb") as f:  # the pages now: a full tmpfs is an error here, not
                    os.posix_fallocate(f.fileno(), 0, capacity)  # a SIGBUS while filling
                break
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        else:
            raise OSError(f"no room for a {capacity / 2 ** 20:.0f} MiB shared weight buffer in "
                          f"/dev/shm or {tempfile.gettempdir()}")
        self.path = path
        self._unlink_at_exit = weakref.finalize(self, _unlink, path)  # also after a crash
        self._buf = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
        self.capacity = capacity

    def fill(self, tensors: dict[str, torch.Tensor], bucket_bytes: int = 512 << 20
             ) -> Iterator[list[dict]]:
        """Copy `tensors` into the buffer, each at an offset of its own; yields the metadata
        (name, dtype, shape, byte offset per tensor) of one bucket of at most `bucket_bytes`
        (a larger tensor: a bucket of its own) as soon as it is written."""
        self._reserve(sum(_aligned(_nbytes(t)) for t in tensors.values()))
        off = 0
        for names in bucket_names(tensors, bucket_bytes):
            meta = []
            for name in names:
                t = tensors[name].detach()
                n = _nbytes(t)
                self._buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
                meta.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""),
                             "shape": list(t.shape), "offset": off})
                off += _aligned(n)
            yield meta

    def close(self) -> None:
        self._buf = None
        if self.path is not None:
            self._unlink_at_exit()
            self.path = None
            self.capacity = 0


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_bucket(path: str, meta: list[dict]) -> dict[str, torch.Tensor]:
    """{name: tensor} of one bucket written by SharedBuckets.fill: views into the mapped file,
    valid until the writer's next fill."""
    if not meta:
        return {}
    end = max(m["offset"] + _aligned(_numel(m["shape"]) * _DTYPES[m["dtype"]].itemsize)
              for m in meta)
    if not os.path.exists(path):
        raise FileNotFoundError(f"shared weight buffer {path} not found: the reader must run on "
                                "the trainer's host and see its /dev/shm (--weight-sync tensor "
                                "is for servers on the same host), or the trainer closed it")
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


def meta_nbytes(meta: list[dict]) -> int:
    """The bytes of the tensors one bucket's metadata describes."""
    return sum(_numel(m["shape"]) * _DTYPES[m["dtype"]].itemsize for m in meta)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
