"""One run at a time per --save: the lock file `<save>/run.lock`, taken by the trainer's global
rank 0 before the run reads or writes anything under --save, and removed when it ends.

Two starts into one directory would both resume the same checkpoint and then overwrite each
other's checkpoints, metrics.jsonl and TensorBoard logs; the second start is refused instead,
naming the host and pid of the first. Only global rank 0 takes the lock (torchrun's RANK: it is
taken before torch.distributed is initialised), since --save is one shared directory for every
node (docs/launch.md). The other ranks write nothing under --save before rank 0 has decided what
the run resumes (checkpoint.checkpoints_to_load, through run_on_rank), which it does after taking
the lock; a refused rank 0 exits, and torchrun stops the job's other workers with it.

The file holds the owner's identity as JSON: host, pid, the start time of that process (so a pid
reused by another process is not taken for the owner), the kernel's boot id and the pid
namespace (so a reboot or another container is not taken for the same machine), and a random
token that tells the owner its own lock. It is released on every exit of the trainer that runs
Python's `finally` (the end of the run, a stop with status 75, an exception, a second Ctrl-C).
A process killed outright (SIGKILL, the OOM killer, a lost node) leaves it behind, stale:

- on the same machine (same host name, boot id and pid namespace) the next start sees that the
  process is gone, takes the lock over and says so;
- held from another machine (or container), the pid cannot be checked there. The owner touches
  the file every HEARTBEAT_S seconds (a thread); a lock whose heartbeat is older than
  STALE_AFTER_S is taken over with a warning, a fresher one refused naming the host. The age is
  measured against a file this start has just written beside it, so both times come from the
  file system's clock and the hosts' clocks need not agree. A lost node's run can therefore be
  restarted elsewhere STALE_AFTER_S after it died (SLURM itself takes longer to declare a node
  down), or at once by removing the file. A live owner stopped for longer than that (SIGSTOP, a
  suspended job) loses the lock: its heartbeat then warns that it was taken.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import warnings

from megatron_rl.errors import UserError

LOCK = "run.lock"
HEARTBEAT_S = 15.0
"""How often the owner touches the lock file (its mtime is the heartbeat)."""
STALE_AFTER_S = 120.0
"""A lock held from another machine whose heartbeat is older than this is stale: eight
heartbeats missed."""


class RunDirectoryInUse(UserError):
    """--save holds the lock of a run that is alive (or cannot be shown dead): the command
    prints the message naming the holder and exits with status 2 (errors.run_command)."""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22), or None
    when there is no such process."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    return int(text.rsplit(")", 1)[1].split()[19])


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _identity() -> dict:
    """This process as a lock owner."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "start_ticks": _start_ticks(os.getpid()),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id") or "",
            "pid_namespace": _pid_namespace(), "token": secrets.token_hex(8),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _same_machine(owner: dict, me: dict) -> bool:
    """Whether `owner`'s pid can be looked up here: the same host, boot and pid namespace."""
    return all(owner.get(k) == me[k] and me[k] for k in ("host", "boot_id", "pid_namespace"))


def _owner_alive(owner: dict, me: dict, heartbeat_age: float) -> tuple[bool, str]:
    """(whether the lock's `owner` holds it, why it is judged so)."""
    if _same_machine(owner, me):
        pid = owner.get("pid")
        ticks = _start_ticks(pid) if isinstance(pid, int) and pid != me["pid"] else None
        if ticks is not None and owner.get("start_ticks") in (None, ticks):
            return True, "its process is running on this machine"
        return False, f"its process {pid} is no longer running on this machine"
    if heartbeat_age < STALE_AFTER_S:
        return True, (f"its heartbeat is {heartbeat_age:.0f} s old; a lock held from another "
                      f"machine is stale after {STALE_AFTER_S:.0f} s without one")
    return False, f"its last heartbeat is {heartbeat_age:.0f} s old (stale after " \
                  f"{STALE_AFTER_S:.0f} s)"


def _describe(owner: dict) -> str:
    if not owner:
        return "an unreadable lock"
    return (f"the run of host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started "
            f"{owner.get('started', '?')}")


def _global_rank() -> int:
    """This process's global rank: torchrun's RANK where set (the lock is taken before
    torch.distributed is initialised), else torch.distributed's rank, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class RunLock:
    """The lock of the run directory `save`, held between __enter__ and __exit__ by global
    rank 0 (`take`: whether this process takes it; default: global rank 0 does). Entering
    raises RunDirectoryInUse naming the owner when another run holds it."""

    def __init__(self, save: str, take: bool | None = None):
        self.save, self.path = save, os.path.join(save, LOCK)
        self.take = _global_rank() == 0 if take is None else take
        self.owner: dict | None = None  # this process's identity while it holds the lock
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> "RunLock":
        if self.take:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, taking over a stale one with a warning; RunDirectoryInUse naming the
        owner and the file when a live run holds it."""
        os.makedirs(self.save, exist_ok=True)
        me = _identity()
        # the record is written whole beside the lock and linked into place: the lock file
        # appears with its content, and this file's mtime is the file system's "now"
        tmp = os.path.join(self.save, f".{LOCK}.{me['host']}.{me['pid']}.{me['token']}")
        with open(tmp, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            for _ in range(5):
                if self._create(tmp):
                    self.owner = me
                    self._heartbeat = threading.Thread(target=self._beat, daemon=True,
                                                       name="run-lock-heartbeat")
                    self._heartbeat.start()
                    return
                try:
                    age = os.stat(tmp).st_mtime - os.stat(self.path).st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                owner = self._read()
                alive, why = _owner_alive(owner, me, age)
                if alive:
                    raise RunDirectoryInUse(
                        f"--save {self.save} is in use by {_describe(owner)} (lock file "
                        f"{self.path}; {why}). Two runs in one directory overwrite each "
                        f"other's checkpoints and logs: wait for that run to end, or give this "
                        f"one another --save. If that run is dead, remove {self.path}")
                if self._take_over(owner, me):
                    warnings.warn(f"{self.path}: taking over the lock of {_describe(owner)}: "
                                  f"{why} (a run killed without releasing it)", stacklevel=2)
            raise RunDirectoryInUse(f"--save {self.save}: another start is taking the lock "
                                    f"{self.path} at the same time; start one run at a time")
        finally:
            os.remove(tmp)

    def _create(self, tmp: str) -> bool:
        """Link the record `tmp` as the lock file: False when one exists already. Where the file
        system has no hard links, the lock is created exclusively and the record copied in."""
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f, open(tmp) as src:
            f.write(src.read())
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read(self) -> dict:
        """The lock file's record ({} when it cannot be read as one)."""
        try:
            record = json.loads(_read_text(self.path) or "")
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def _take_over(self, stale: dict, me: dict) -> bool:
        """Remove the stale lock of `stale`. The file is renamed aside and checked to be the one
        judged stale: another start may have taken it over since, and then gets it back."""
        aside = f"{self.path}.stale-{me['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            with open(aside) as f:
                taken = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            taken = {}
        if stale and taken != stale:  # a live start's fresh lock: put it back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            os.remove(aside)
            return False
        os.remove(aside)
        return True

    def _beat(self) -> None:
        """Touch the lock every HEARTBEAT_S seconds while it is this process's."""
        while not self._stop.wait(HEARTBEAT_S):
            owner = self._read()
            if self.owner is None or owner.get("token") != self.owner["token"]:
                warnings.warn(f"{self.path} is no longer this run's (now {_describe(owner)}): "
                              "another start took it over, and the two runs write into one "
                              "directory", stacklevel=1)
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # a file system that fails for a moment: the next beat tries again

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this process's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if self.owner is not None and self._read().get("token") == self.owner["token"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.owner = None
