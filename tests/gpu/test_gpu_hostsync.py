"""HostSyncCounter's CUDA mode (megatron_rl.hostsync) against PyTorch's own record of host
synchronisations: under torch.cuda.set_sync_debug_mode("warn") every synchronising CUDA call
warns. Each op the CPU tier counts as a synchronisation must warn on the GPU and be counted
there, and each op it treats as free must do neither."""
import warnings

import pytest
import torch

from megatron_rl.hostsync import HostSyncCounter

pytestmark = pytest.mark.gpu


def _cases() -> tuple[dict, dict]:
    d = torch.device("cuda")
    x = torch.arange(6.0, device=d)
    mask = x > 2
    ones = torch.ones(6, dtype=torch.long, device=d)
    pinned = torch.ones(6).pin_memory()
    # made here, not in a case: torch.tensor(list, device=d) is itself a blocking copy
    index, few = torch.tensor([0, 2], device=d), torch.tensor([3, 7], device=d)
    y = x.clone()  # torch.equal(x, x) answers from the alias alone, without reading the data
    syncing = {
        "item": lambda: x[0].item(),
        "bool": lambda: bool(x[0]),
        "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(),
        "host to device, blocking": lambda: torch.ones(6).to(d),
        "nonzero": lambda: x.nonzero(),
        "boolean mask index": lambda: x[mask],
        "masked_select": lambda: x.masked_select(mask),
        "unique": lambda: x.unique(),
        "repeat_interleave": lambda: x.repeat_interleave(ones),
        "equal": lambda: torch.equal(x, y),
        "tensor from a list, on the device": lambda: torch.tensor([0, 2], device=d),
        "bincount": lambda: torch.bincount(ones, minlength=4),
        "isin, sorting": lambda: torch.isin(torch.arange(64, device=d),
                                            torch.arange(20, device=d)),
    }
    free = {
        "arithmetic": lambda: (x * 2).sum().exp(),
        "masked_fill": lambda: x.masked_fill(mask, 0.0),
        "x[mask] = scalar": lambda: x.clone().__setitem__(mask, 0.0),
        "integer index": lambda: x[index],
        "repeat_interleave with output_size": lambda: x.repeat_interleave(ones, output_size=6),
        "isin, broadcast compare": lambda: torch.isin(torch.arange(64, device=d), few),
        "sort, topk, searchsorted": lambda: (x.sort(), x.topk(2), torch.searchsorted(x, x)),
        "sampling": lambda: torch.multinomial(x.softmax(-1)[None], 1),
        "pinned host to device, non_blocking": lambda: pinned.to(d, non_blocking=True),
        "device to host, non_blocking": lambda: x.to("cpu", non_blocking=True),
    }
    return syncing, free


def _warnings(fn) -> int:
    """Synchronisations PyTorch reports for fn()."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def test_counter_agrees_with_cuda_sync_debug_mode():
    syncing, free = _cases()
    disagree = {}
    for expect, cases in ((True, syncing), (False, free)):
        for name, fn in cases.items():
            with HostSyncCounter("cuda") as syncs:
                fn()
            warned = _warnings(fn)
            if (syncs.total > 0, warned > 0) != (expect, expect):
                disagree[name] = (dict(syncs.counts), warned)
    assert not disagree, f"(counter, torch warnings) where they disagree: {disagree}"
