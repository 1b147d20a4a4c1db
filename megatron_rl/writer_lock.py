"""Which temporaries a killed writer left: a lock file its writer holds while they exist.

A conversion (`megatron-rl convert`) and a disk weight export (rollout/weight_sync.py) build
their output in temporaries beside it and rename them into place. A writer killed outright
(kill -9, the OOM killer) leaves them behind, and nothing in their names says whether their
writer is still alive. So each writer holds an exclusive `flock` on a lock file of its own name
beside them for as long as they exist; the kernel drops that lock when the process dies,
however it dies. The next writer into the same place takes the lock without waiting: taken, no
live process writes there and every temporary of the names that writer creates is stale and
removed; held, a live writer owns them and nothing is touched.

flock is kept by local file systems and by NFS (as a POSIX lock, through the lock manager);
where it is refused (some Lustre or FUSE mounts) liveness cannot be told, and nothing is
removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import warnings

# flock refused by the file system: no lock either way
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class WriterLock:
    """An exclusive flock on the file `path`, created when missing.

    `take(wait)` returns "taken", "held" (by another open file: a live writer, possibly in
    this process) or "unsupported". `release()` removes the file and drops the lock; a taker
    that opened the file just before its removal sees another inode at `path` and opens the
    new file, so two writers never both hold it."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    @property
    def taken(self) -> bool:
        return self._fd is not None

    def take(self, wait: bool = False) -> str:
        if self._fd is not None:
            return "taken"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return "held"
                if e.errno in _UNSUPPORTED:
                    return "unsupported"
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return "taken"
            os.close(fd)  # released and removed by its holder meanwhile: lock the new file

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def remove_stale(paths: list[str], what: str) -> None:
    """Remove `paths` (files or directories; the caller holds the lock that proves them stale),
    with one warning naming them and `what` left them."""
    if not paths:
        return
    warnings.warn(f"removing {', '.join(sorted(paths))}: left by {what} that did not finish "
                  "(its process is gone)", stacklevel=3)
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
