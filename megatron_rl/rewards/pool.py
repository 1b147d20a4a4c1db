"""A small process pool for untrusted verification, with a hard per-job wall-clock limit.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one stuck job. math-verify's
own timeouts use ``signal.alarm`` (main thread only), and an alarm cannot interrupt a long
C-level computation such as a huge integer power: Python only runs signal handlers between
bytecodes. So each job runs in the *main thread* of a worker process under a soft
``setitimer`` alarm (cheap: the worker survives and reports a timeout), and the parent kills
and replaces any worker still busy at the hard deadline.

Workers are fresh interpreters (``python -m megatron_rl.rewards._worker``), not multiprocessing
``spawn`` children: spawn re-imports the trainer's main script in every worker (torch, Megatron:
seconds and GiBs each) and fails outright when the main module is stdin or a REPL. They share
nothing with the trainer's CUDA context or threads, die with the parent (``PR_SET_PDEATHSIG`` on Linux, and EOF on their pipe), and can get an
address-space cap so a hostile answer cannot take the machine's memory. ``close()`` (or the
context manager) stops them all; nothing is left behind.
"""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable

from megatron_rl.processes import set_parent_death_signal
from megatron_rl.rewards.types import ERROR, TIMEOUT, Scored

_READY = "__ready__"


class _SoftTimeout(BaseException):
    """Raised in a worker by its own alarm; BaseException so verifier code cannot swallow it."""


def _worker_main(conn: Connection, soft_timeout_s: float, memory_limit_mb: int | None,
                 warmup: tuple[str, str] | None) -> None:
    set_parent_death_signal(signal.SIGKILL)
    # Ctrl-C, and the SIGTERM a scheduler sends every process of a job, are the parent's to
    # handle: it finishes the step in flight (scored here) before it stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if memory_limit_mb:
        try:
            import resource

            limit = memory_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass
    armed = [False]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _SoftTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    if warmup is not None:  # import heavy verifier modules (sympy) before reporting ready
        try:
            module, name = warmup
            getattr(importlib.import_module(module), name)()
        except Exception:
            pass
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if msg is None:
            return
        job_id, fn, args = msg
        reward, reason = 0.0, ERROR
        try:
            armed[0] = True
            signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
            try:
                result = fn(*args)
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            reward, reason = float(result.reward), result.reason
        except _SoftTimeout:
            reward, reason = 0.0, TIMEOUT
        except BaseException:  # RecursionError, MemoryError, anything the verifier raises
            reward, reason = 0.0, ERROR
        try:
            conn.send((job_id, reward, reason))
        except (OSError, BrokenPipeError):
            return


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    ready: bool = False
    job_id: int | None = None
    deadline: float = 0.0


class VerifierPool:
    """``num_workers`` processes running ``fn(*args) -> Scored`` jobs with a hard time limit each.

    ``run`` never raises for a job's sake: a job past ``timeout_s`` scores ``Scored(0, "timeout")``
    (its worker is killed and replaced), a job that raises or kills its worker scores
    ``Scored(0, "error")``. ``fn`` must be picklable (a module-level function).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
        warmup: tuple[str, str] | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        # The soft alarm fires first so most timeouts cost no respawn; the kill is the backstop.
        self.soft_timeout_s = max(0.05, 0.8 * self.timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self.warmup = warmup
        self._workers: list[_Worker] = []
        self._closed = False
        self.num_restarts = 0
        self._startup_failures = 0  # workers that died or hung before reporting ready, in a row

    # -- worker lifecycle -------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        cmd = [sys.executable, "-m", "megatron_rl.rewards._worker", "--fd", str(child_fd),
               "--soft-timeout", repr(self.soft_timeout_s), "--memory-limit-mb", str(self.memory_limit_mb or 0)]
        if self.warmup:
            cmd += ["--warmup", ":".join(self.warmup)]
        env = dict(os.environ)
        # Make this checkout importable in the worker whatever its working directory.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(cmd, pass_fds=(child_fd,), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        child_sock.close()
        conn = Connection(parent_sock.detach())
        return _Worker(proc, conn, deadline=time.monotonic() + self.startup_timeout_s)

    @staticmethod
    def _kill(worker: _Worker) -> None:
        try:
            worker.conn.close()
        except OSError:
            pass
        if worker.process.poll() is None:
            worker.process.kill()
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _replace(self, worker: _Worker) -> _Worker:
        self._kill(worker)
        self.num_restarts += 1
        new = self._spawn()
        self._workers[self._workers.index(worker)] = new
        return new

    def start(self) -> None:
        """Start the workers now (otherwise the first ``run`` does)."""
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def close(self) -> None:
        """Stop all workers and wait for them; idempotent."""
        if self._closed:
            return
        self._closed = True
        stopping = []
        for w in self._workers:
            try:
                if w.ready and w.job_id is None:  # idle: ask it to exit
                    w.conn.send(None)
                    stopping.append(w)
                    continue
            except OSError:
                pass
            self._kill(w)  # busy or still starting: nothing to wait for
        deadline = time.monotonic() + 2.0
        for w in stopping:
            try:
                w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._kill(w)
        self._workers.clear()

    def __enter__(self) -> "VerifierPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def alive_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.poll() is None]

    # -- running jobs -----------------------------------------------------------------------
    def run(self, fn: Callable[..., Scored], jobs: list[tuple]) -> list[Scored]:
        """Run ``fn(*args)`` for each args tuple in ``jobs``; results in the same order."""
        if not jobs:
            return []
        self.start()
        results: list[Scored | None] = [None] * len(jobs)
        next_job = 0
        num_done = 0
        while num_done < len(jobs):
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.job_id is None and next_job < len(jobs):
                    try:
                        w.conn.send((next_job, fn, jobs[next_job]))
                        w.job_id, w.deadline = next_job, now + self.timeout_s
                    except (OSError, ValueError):
                        results[next_job] = Scored(0.0, ERROR)
                        num_done += 1
                        self._replace(w)
                    next_job += 1
            waiting = [w for w in self._workers if not w.ready or w.job_id is not None]
            if not waiting:
                continue
            timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            ready_conns = wait([w.conn for w in waiting], timeout=timeout)
            for w in waiting:
                if w.conn not in ready_conns:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, OOM kill)
                    if not w.ready:
                        self._startup_failures += 1
                    if w.job_id is not None:
                        results[w.job_id] = Scored(0.0, ERROR)
                        num_done += 1
                    self._replace(w)
                    continue
                if msg == _READY:
                    w.ready = True
                    self._startup_failures = 0
                    continue
                job_id, reward, reason = msg
                if job_id == w.job_id and results[job_id] is None:
                    results[job_id] = Scored(reward, reason)
                    num_done += 1
                w.job_id = None
            now = time.monotonic()
            for w in list(self._workers):
                if now < w.deadline:
                    continue
                if w.job_id is not None:  # stuck past the hard limit: kill it
                    results[w.job_id] = Scored(0.0, TIMEOUT)
                    num_done += 1
                    self._replace(w)
                elif not w.ready:  # never came up
                    self._startup_failures += 1
                    self._replace(w)
            if self._startup_failures > 3 * self.num_workers:
                # Workers cannot start (broken environment): score the rest as errors, don't spin.
                break
        return [r if r is not None else Scored(0.0, ERROR) for r in results]


def default_num_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 2)))
