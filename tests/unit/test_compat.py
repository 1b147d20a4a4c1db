"""megatron_rl.compat: the unfused RoPE of packed (THD) rows without host synchronisations
gives megatron-core's own results bit for bit, and reads nothing back to the host (megatron's
reads cu_seqlens twice per call)."""

import inspect
import os

import pytest
import torch

from megatron_rl.hostsync import HostSyncCounter

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def cp_group():
    from megatron.core import parallel_state

    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(ParallelConfig())
    yield parallel_state.get_context_parallel_group()
    destroy_distributed()


def _thd_rope():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.compat import apply_rope_thd_compat

    apply_rope_thd_compat()
    assert not apply_rope_thd_compat()  # idempotent
    patched = rope_utils._apply_rotary_pos_emb_thd
    return patched, inspect.unwrap(patched)  # megatron-core's own (functools.wraps)


CASES = {
    # cu_seqlens, rows of the frequency table, rotary dims of the 16 head dims
    "segments and padding": ([0, 5, 16, 19, 27, 32], 11, 16),
    "an empty segment": ([0, 3, 3, 10], 7, 16),
    "a table longer than any segment": ([0, 4, 9, 12], 20, 16),
    "a table as long as the row": ([0, 6, 12], 12, 16),
    "one segment": ([0, 9], 9, 16),
    "partial rotary dims": ([0, 5, 16, 19, 27, 32], 11, 8),
}


@pytest.mark.hostsync
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["plain", "interleaved", "mscale", "mla", "bf16"])
def test_thd_rope_equals_megatron_core_without_host_syncs(cp_group, case, variant):
    from megatron_rl.parallel import device

    patched, upstream = _thd_rope()
    bounds, rows, rot_dim = CASES[case]
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    t = torch.randn(bounds[-1], 3, 16, generator=g).to(device(), dtype)
    freqs = torch.randn(rows, 1, 1, rot_dim, generator=g).to(device())
    cu = torch.tensor(bounds, dtype=torch.int32, device=device())
    kw = dict(rotary_interleaved=variant == "interleaved", multi_latent_attention=variant == "mla",
              mscale=0.7 if variant == "mscale" else 1.0, cp_group=cp_group)
    with HostSyncCounter() as upstream_syncs:
        want = upstream(t, cu, freqs, **kw)
    assert upstream_syncs.total >= 2  # the segment lengths and the table-length test
    with HostSyncCounter() as syncs:
        got = patched(t, cu, freqs, **kw)
    assert syncs.total == 0, syncs.report()
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert not torch.equal(got, t)
