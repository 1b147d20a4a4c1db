"""Shared-memory weight buckets (rollout/shm_weights.py): what the reader gets back is exactly
what the writer put in, bucket by bucket, for every dtype, with tensors larger than a bucket;
the views of earlier buckets stay valid while later ones are written (a reader loads them all
at once), the buffer is reused by the next sync, and it is gone after close."""
import os

import pytest
import torch

from megatron_rl.rollout.shm_weights import SharedBuckets, bucket_names, read_bucket


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g),
            "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
            "big": torch.randn(64, 33, generator=g),            # 8448 bytes: above the bucket
            "c.half": torch.randn(2, 2, 3, generator=g).half(),
            "scalar": torch.tensor(2.5)}


def test_round_trip_in_buckets_bitwise():
    src = _tensors()
    writer = SharedBuckets()
    got, buckets = {}, 0
    for meta in writer.fill(src, bucket_bytes=1024):
        buckets += 1
        got.update(read_bucket(writer.path, meta))  # views, kept while later buckets arrive
    assert buckets == 3  # [a, b], [big], [c, scalar]: no tensor is split
    assert list(got) == list(src)
    for k, t in src.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    path = writer.path
    writer.close()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match="not found: the reader must run on"):
        read_bucket(path, [{"name": "x", "dtype": "float32", "shape": [1], "offset": 0}])


def test_buffer_is_reused_and_grows_for_a_larger_model():
    writer = SharedBuckets()
    try:
        meta = next(writer.fill({"x": torch.ones(10)}))
        first = writer.path
        view = read_bucket(first, meta)["x"]
        list(writer.fill({"x": torch.zeros(10)}))
        assert writer.path == first  # the same mapping for every sync...
        assert torch.equal(view, torch.zeros(10))  # ...which the reader sees
        meta = next(writer.fill({"y": torch.arange(1000, dtype=torch.float32)}))
        assert writer.capacity >= 4000 and writer.path != first
        assert torch.equal(read_bucket(writer.path, meta)["y"], torch.arange(1000.0))
    finally:
        writer.close()


def test_bucket_names_cut_at_the_size_and_keep_order():
    t = {f"w{i}": torch.zeros(16) for i in range(5)}  # 64 bytes each (aligned)
    assert bucket_names(t, 128) == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert bucket_names(t, 10) == [[k] for k in t]
