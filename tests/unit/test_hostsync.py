"""HostSyncCounter (megatron_rl.hostsync): which operations it counts as host synchronisations.

In the CPU mode every tensor stands for a device tensor (the CPU test tier); in the CUDA mode,
checked here on fake CUDA tensors (FakeTensorMode with allow_non_fake_inputs makes them on a
CPU-only build), only ops on the device and copies between the device and the host count.
The budgets of the hot loops that use it: tests/unit/test_hostsync_budgets.py.
"""

import pytest
import torch

from megatron_rl.hostsync import HostSyncCounter

pytestmark = pytest.mark.hostsync


def _counts(fn, device_type="cpu") -> dict:
    with HostSyncCounter(device_type) as syncs:
        fn()
    return dict(syncs.counts)


X = torch.arange(6.0)
MASK = X > 2

SYNCS = {
    "item": (lambda: X[0].item(), "_local_scalar_dense"),
    "bool": (lambda: bool(X[0]), "_local_scalar_dense"),
    "int": (lambda: int(X[1]), "_local_scalar_dense"),
    "float": (lambda: float(X[1]), "_local_scalar_dense"),
    "if on a comparison": (lambda: 1 if X.size(0) == X[-1] else 0, "_local_scalar_dense"),
    "format": (lambda: f"{X[0]}", "_local_scalar_dense"),
    "tolist": (lambda: X.tolist(), "tolist"),
    "numpy": (lambda: X.numpy(), "numpy"),
    "cpu": (lambda: X.cpu(), "cpu"),
    "nonzero": (lambda: X.nonzero(), "nonzero"),
    "where with one argument": (lambda: torch.where(MASK), "nonzero"),
    "boolean mask index": (lambda: X[MASK], "index (boolean mask)"),
    "masked_select": (lambda: X.masked_select(MASK), "masked_select"),
    "unique": (lambda: X.unique(), "_unique2"),
    "unique_consecutive": (lambda: X.unique_consecutive(), "unique_consecutive"),
    "repeat_interleave": (lambda: X.repeat_interleave(torch.ones(6, dtype=torch.long)),
                          "repeat_interleave (no output_size)"),
    "equal": (lambda: torch.equal(X, X), "equal"),
    "bincount": (lambda: torch.bincount(torch.tensor([1, 2]), minlength=4), "bincount"),
    "isin, sorting": (lambda: torch.isin(torch.arange(64), torch.arange(20)),
                      "isin (sorting: unique)"),
    "tensor from a list, on the device": (lambda: torch.tensor([0, 2], device=X.device),
                                          "tensor from host data (blocking copy)"),
    "as_tensor of a list, on the device": (
        lambda: torch.as_tensor([0, 2], dtype=torch.long, device=X.device),
        "tensor from host data (blocking copy)"),
}

NO_SYNCS = {
    "arithmetic and reductions": lambda: (X * 2).sum().exp(),
    "comparison kept on the device": lambda: X.size(0) == X[-1],
    "masked_fill": lambda: X.masked_fill(MASK, 0.0),
    "x[mask] = scalar (masked_fill)": lambda: X.clone().__setitem__(MASK, 0.0),
    "integer index": lambda: X[torch.tensor([0, 2])],
    "torch.where with three arguments": lambda: torch.where(MASK, X, 0.0),
    "repeat_interleave with output_size": lambda: X.repeat_interleave(
        torch.ones(6, dtype=torch.long), output_size=6),
    "repeat_interleave by an int": lambda: X.repeat_interleave(3),
    "isin, broadcast compare": lambda: torch.isin(torch.arange(64), torch.tensor([3, 7])),
    "sort, topk, searchsorted, split by ints": lambda: (
        X.sort(), X.topk(2), torch.searchsorted(X, X), X.split([2, 4])),
    "sampling": lambda: torch.multinomial(X.softmax(-1)[None], 1),
    "tensor from a list on the host (no device given)": lambda: torch.tensor([0, 2]),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_counts_each_synchronising_op_once(name):
    fn, op = SYNCS[name]
    assert _counts(fn) == {op: 1}


@pytest.mark.parametrize("name", list(NO_SYNCS))
def test_does_not_count_device_side_work(name):
    assert _counts(NO_SYNCS[name]) == {}


def test_counts_inside_a_custom_op_written_in_python():
    """A torch.library.custom_op runs below the dispatch mode; its ops are counted anyway."""
    @torch.library.custom_op("megatron_rl_test::syncing", mutates_args=())
    def syncing(x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            return x[x > 0]
        return x.clone()

    assert _counts(lambda: syncing(torch.ones(3))) == {"is_nonzero": 1,
                                                       "index (boolean mask)": 1}


def test_report_names_the_ops_and_where_they_ran():
    def read_twice():
        return bool(X[0]), X.tolist()

    with HostSyncCounter("cpu", keep_stacks=1) as syncs:
        read_twice()
        read_twice()
    assert syncs.total == 4 and syncs.counts == {"_local_scalar_dense": 2, "tolist": 2}
    report = syncs.report()
    assert report.startswith("4 host synchronisations (cpu mode)")
    assert report.count("in read_twice") == 2  # one stack kept per op name
    assert "test_hostsync.py" in report and "torch/" not in report
    with syncs:  # re-entering accumulates
        read_twice()
    assert syncs.total == 6
    syncs.reset()
    assert syncs.total == 0 and not syncs.stacks


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def test_cuda_mode_counts_copies_between_device_and_host(fake_cuda):
    """Tensor methods that move data onto "cuda" check for a CUDA build before dispatching;
    the aten ops they dispatch to are called directly instead."""
    aten, cuda = torch.ops.aten, torch.device("cuda")
    dev = torch.empty(4, device="cuda")
    host = torch.ones(4)
    assert dev.device.type == "cuda"
    assert _counts(lambda: dev.cpu(), "cuda") == {"copy device->host": 1}
    assert _counts(lambda: dev.to("cpu"), "cuda") == {"copy device->host": 1}
    assert _counts(lambda: host.copy_(dev), "cuda") == {"copy device->host": 1}
    assert _counts(lambda: aten._to_copy(host, device=cuda), "cuda") == {
        "copy host->device (blocking)": 1}
    assert _counts(lambda: aten.copy_(dev, host), "cuda") == {"copy host->device (blocking)": 1}
    assert _counts(lambda: aten._to_copy(host, device=cuda, non_blocking=True), "cuda") == {}
    assert _counts(lambda: aten.copy_(dev, host, True), "cuda") == {}
    assert _counts(lambda: dev.to("cpu", non_blocking=True), "cuda") == {}
    assert _counts(lambda: dev.to(torch.float16), "cuda") == {}
    assert _counts(lambda: dev * 2 + 1, "cuda") == {}


def test_cuda_mode_counts_ops_on_the_device_only(fake_cuda):
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)

    dev = torch.empty(4, device="cuda")
    with HostSyncCounter("cuda") as syncs:
        with pytest.raises(DynamicOutputShapeException):  # fake tensors have no values
            torch.ops.aten.nonzero(dev)
        with pytest.raises(DataDependentOutputException):
            dev.sum().item()
    assert syncs.counts == {"nonzero": 1, "_local_scalar_dense": 1}


def test_cuda_mode_does_not_count_host_tensors():
    host = torch.arange(4.0)
    assert _counts(lambda: (host.nonzero(), host.tolist(), bool(host[1]), host.cpu()),
                   "cuda") == {}
