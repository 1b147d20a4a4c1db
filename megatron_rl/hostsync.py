"""Counting host synchronisations: the operations that make the host wait for the device.

A GPU runs kernels asynchronously: the host queues work and moves on, and waits only when it
needs something the device has not finished. Then the host stalls until the queue drains, and
the GPU idles until the host queues the next kernel. Inside a loop over layers, experts or
tokens, each such wait costs GPU time on every pass, and no timing on a CPU shows it.
`HostSyncCounter` counts these waits by operator name, and records where the first ones
happened:

    with HostSyncCounter() as syncs:
        model(tokens)
    assert syncs.total <= 1, syncs.report()

What counts (PyTorch's behaviour on CUDA):
- `_local_scalar_dense`: a scalar read (`.item()`, `bool(t)`, `int(t)`, `float(t)`, `if t:`,
  `f"{t}"`);
- ops whose output shape depends on the data: `nonzero` (`torch.where(mask)`, `argwhere`),
  indexing or index_put with a boolean mask (`x[mask]`, `x[mask] = y`; these call `nonzero`,
  except `x[mask] = scalar`, a `masked_fill`), `masked_select`, `unique` and
  `unique_consecutive`, `repeat_interleave` with tensor repeats and no `output_size`,
  `bincount` (reads its input's max), `isin` where it sorts (then it calls `unique`: a test
  tensor of at least 10 * elements.numel() ** 0.145 entries), `torch.equal`;
- device -> host copies (`.cpu()`, `.to("cpu")`, `.tolist()`, `.numpy()`) that are not
  non_blocking, and host -> device copies that are not non_blocking (PyTorch waits for the
  stream after the copy: `at::cuda::memcpy_and_sync`), including a tensor made on the device
  from host data: `torch.tensor(data, device=d)`, `torch.as_tensor` / `torch.asarray` of a list
  or array with a device (the copy runs below the dispatcher: it is counted where Python calls
  the factory).
Not counted: `torch.cuda.synchronize()` and event or stream waits (not tensor ops), and
collectives.

Two modes, by `device_type`:
- "cuda" (the default where CUDA is available): the ops above on CUDA tensors, and copies
  between CUDA and the host. What it counts is what synchronises.
- "cpu" (the default elsewhere, the CPU test tier): the CPU stands in for the device, so every
  tensor counts as a device tensor. Reads that never reach PyTorch's dispatcher on a CPU tensor
  (`.tolist()`, `.numpy()`, `.cpu()`) are counted where Python calls them (a
  TorchFunctionMode). Copies made with `.to(device)` cannot be told apart here (on a CPU
  machine the device is the host: `t.to(dev)` is a no-op whose direction the code does not
  say), so they are not counted, while a factory given an explicit device
  (`torch.tensor(data, device=dev)`) is: the code says where the data goes: a hot loop that keeps host data as Python values rather than
  CPU tensors is counted exactly; one that reads a host tensor is counted as if that tensor
  were on the device (an upper bound).
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch._library import custom_ops
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# overload packets that synchronise whenever their input is on the device (the composite ones,
# item to where, reach a dispatch mode undecomposed inside a custom op's implementation)
_ALWAYS = {
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten._unique,
    _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.unique_dim_consecutive,
    _aten.equal, _aten.bincount,
    _aten.item, _aten.is_nonzero, _aten.allclose, _aten.argwhere, _aten.nonzero_numpy,
}
_INDEX = {_aten.index, _aten._unsafe_index}
_INDEX_PUT = {_aten.index_put, _aten.index_put_, _aten._index_put_impl_, _aten._unsafe_index_put}
_COPIES = {_aten._to_copy, _aten.to, _aten.copy_, _aten.copy}

# Python-level reads of a tensor's data on the host (the "cpu" mode's view of D2H copies)
_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy",
               torch.Tensor.cpu: "cpu"}
# factories that copy host data (a list, a number, an array) onto the device they are given
_FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray}  # (data, *, device=...)

_SKIP_FRAMES = (os.path.dirname(torch.__file__), __file__)


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _python_impl(func, first: torch.Tensor | None):
    """The Python function behind a `torch.library.custom_op` (for `first`'s device), else None.

    While a dispatch mode handles an op, the mode is off: the ops that a custom op's Python
    implementation calls would go uncounted. Running that function under a fresh mode instead
    counts them. (torch._library.custom_ops.OPDEFS is private; without it custom ops stay
    opaque.)"""
    if func.namespace in ("aten", "prims"):
        return None
    opdef = getattr(custom_ops, "OPDEFS", {}).get(f"{func.namespace}::{func._opname}")
    if opdef is None:
        return None
    device = None if first is None else first.device.type
    return opdef._backend_fns.get(device) or opdef._init_fn


class HostSyncCounter:
    """Context manager counting host synchronisations by operator name (see the module
    docstring for what counts).

    counts: {name: occurrences}; total: their sum; stacks: {name: [the Python stacks (outside
    torch) of its first `keep_stacks` occurrences]}; report(): all of it as text, for an
    assertion message. Re-entering accumulates.
    """

    def __init__(self, device_type: str | None = None, keep_stacks: int = 2):
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_type = device_type
        self.keep_stacks = keep_stacks
        self.counts: collections.Counter[str] = collections.Counter()
        self.stacks: dict[str, list[str]] = {}
        self._modes: list = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.stacks.clear()

    def report(self) -> str:
        """The counts by name, then where the first occurrences of each came from."""
        lines = [f"{self.total} host synchronisations ({self.device_type} mode): "
                 + ", ".join(f"{name} x{n}" for name, n in self.counts.most_common())]
        for name, stacks in self.stacks.items():
            for i, stack in enumerate(stacks):
                lines.append(f"-- {name} #{i + 1}:\n{stack}")
        return "\n".join(lines)

    # -- recording --------------------------------------------------------------------------
    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device_type

    def _record(self, name: str) -> None:
        self.counts[name] += 1
        stacks = self.stacks.setdefault(name, [])
        if len(stacks) < self.keep_stacks:
            frames = [f for f in traceback.extract_stack()
                      if not f.filename.startswith(_SKIP_FRAMES)]
            stacks.append("".join(traceback.format_list(frames[-8:])).rstrip())

    def _dispatched(self, func, args, kwargs) -> str | None:
        """The name to count `func(*args, **kwargs)` under, None when it does not sync."""
        packet = func.overloadpacket
        name = packet.__name__
        first = _first_tensor(args)
        if packet in _COPIES:
            return self._copy(func, args, kwargs)
        if not self._on_device(first):
            return None
        if packet in _ALWAYS or (packet is _aten.where and len(args) == 1):
            return name
        if packet in _INDEX:
            return f"{name} (boolean mask)" if any(map(_is_mask, args[1])) else None
        if packet in _INDEX_PUT:
            masks = [i for i in args[1] if _is_mask(i)]
            if not masks:
                return None
            value = args[2]
            host_scalar = value.numel() == 1 and (value.device.type == "cpu")
            if (len(masks) == 1 and host_scalar and not kwargs.get("accumulate", False)
                    and not (len(args) > 3 and args[3])):
                return None  # x[mask] = scalar: masked_fill
            return f"{name} (boolean mask)"
        if packet is _aten.repeat_interleave and func.__name__.split(".")[-1] in (
                "Tensor", "self_Tensor"):
            return None if kwargs.get("output_size") is not None else f"{name} (no output_size)"
        if packet is _aten.isin and func.__name__.split(".")[-1] == "Tensor_Tensor":
            elements, test = args[0], args[1]
            assume_unique = kwargs.get("assume_unique", args[2] if len(args) > 2 else False)
            sorts = elements.numel() > 0 and test.numel() >= int(
                10.0 * elements.numel() ** 0.145)
            return f"{name} (sorting: unique)" if sorts and not assume_unique else None
        return None

    def _copy(self, func, args, kwargs) -> str | None:
        """Copies between the host and the device ("cuda" mode; none exist on a CPU)."""
        if self.device_type == "cpu":
            return None

        def arg(i, key):
            return kwargs.get(key, args[i] if len(args) > i else False)

        packet, overload = func.overloadpacket, func._overloadname
        src, dst = args[0], None
        if packet is _aten._to_copy or (packet is _aten.to and overload == "dtype_layout"):
            dst, non_blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
        elif packet is _aten.to and overload == "device":  # (self, device, dtype, non_blocking)
            dst, non_blocking = args[1], arg(3, "non_blocking")
        elif packet is _aten.to and overload == "other":  # (self, other, non_blocking)
            dst, non_blocking = args[1].device, arg(2, "non_blocking")
        elif packet in (_aten.copy_, _aten.copy):  # (self = destination, src, non_blocking)
            src, dst, non_blocking = args[1], args[0].device, arg(2, "non_blocking")
        else:
            return None
        if dst is None or not isinstance(src, torch.Tensor) or non_blocking:
            return None
        src_dev, dst_dev = src.device.type, torch.device(dst).type
        if src_dev == self.device_type and dst_dev == "cpu":
            return "copy device->host"
        if src_dev == "cpu" and dst_dev == self.device_type:
            return "copy host->device (blocking)"
        return None

    def _from_host(self, func, args, kwargs) -> bool:
        """Whether a factory call (`_FROM_HOST`) copies host data onto this counter's device."""
        device = kwargs.get("device")
        if device is None or (args and isinstance(args[0], torch.Tensor)):
            return False  # a tensor's own copy is dispatched (and counted) as one
        return torch.device(device).type == self.device_type

    # -- the modes --------------------------------------------------------------------------
    def __enter__(self) -> "HostSyncCounter":
        counter = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = counter._dispatched(func, args, kwargs)
                if name is not None:
                    counter._record(name)
                impl = _python_impl(func, _first_tensor(args))
                if impl is not None:  # a custom op written in Python: count inside it too
                    with _Dispatch():
                        return impl(*args, **kwargs)
                return func(*args, **kwargs)

        class _Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = _HOST_READS.get(func) if counter.device_type == "cpu" else None
                if name is not None and args and counter._on_device(args[0]):
                    counter._record(name)  # on a GPU these reach the dispatcher as copies
                elif func in _FROM_HOST and counter._from_host(func, args, kwargs):
                    counter._record("tensor from host data (blocking copy)")
                return func(*args, **kwargs)

        self._modes = [_Function(), _Dispatch()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
