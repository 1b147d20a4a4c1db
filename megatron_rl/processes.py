"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """In a child (a `preexec_fn`, or first thing in a worker): receive `sig` when the thread
    that started it dies (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
