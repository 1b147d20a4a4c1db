"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import signal
import sys


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """In a child (a `preexec_fn`, or first thing in a worker): receive `sig` when the thread
    that started it dies (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def skip_exit_collection() -> None:
    """For an entry point whose work is done and whose files are closed, just before it returns:
    keep the interpreter's shutdown from walking the whole heap.

    At exit CPython runs full garbage collections over every object still alive, and the
    imports alone (torch, megatron-core, transformers) made millions: ~1.2 s per process on a
    2-core machine (tools/bench_exit.py), paid again by every rank of every launch. gc.freeze() moves them out of
    those collections. Nothing else changes: atexit handlers run, reachable objects are released
    as usual; only unreachable reference cycles are left to the OS with the rest of the memory."""
    gc.freeze()
