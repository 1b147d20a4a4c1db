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


@contextlib.contextmanager
def spawn_without_main():
    """Processes spawned inside this block do not import the parent's __main__ module.

    A spawned child first imports the parent's main module (multiprocessing's preparation
    data names it); for the trainer (`python -m megatron_rl.train`) that is torch and
    megatron-core, about 10 s of CPU and 270 MB, which a helper serving a queue does not need.
    The functions such a child runs must live in a light module (like this one). The child's
    preparation data is computed when it is started, so the block only needs to span the
    start."""
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def init_quiet_helper(parent: int) -> None:
    """First thing in a helper process started by `parent`: die with it (SIGKILL of the parent
    included), and leave Ctrl-C and SIGTERM to it (it stops the helper itself)."""
    import os

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
