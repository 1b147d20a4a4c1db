"""Rollout server processes (vLLM, SGLang): launch, health wait, restart, shutdown.

A `ManagedServer` owns one inference server process, started from an argv that depends on the
model directory it should serve (so a restart can serve the *current* weights, the last export,
not the initial checkpoint). It
- binds `host` (127.0.0.1 unless told otherwise; 0.0.0.0 for other nodes to reach it, then
  announced under this machine's name) on a free port and waits for the health endpoint, with
  a timeout; if the
  process exits during startup the error carries the tail of its log;
- keeps the server's stdout/stderr in a log file (restarts append to it);
- restarts the process when it died or stopped answering, detected by a failed request or
  health check (`call` retries the request once on the new process);
- starts the server in its own session and kills the whole process group on `stop`, at
  interpreter exit (atexit), and (Linux) when the launching process dies (PR_SET_PDEATHSIG),
  so no vLLM EngineCore / SGLang scheduler child outlives the trainer.
Or it attaches to a server someone else runs (`ManagedServer.attach(url)`): no restarts then.

The server runs in child_env.inference_env(): the trainer's environment without what belongs
to the trainer's own process (torchrun's variables, the allocator's settings).

Only the standard library (and rollout/base.py, child_env.py and net.py, which use only it) is
used.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import weakref
from typing import Any, Callable, Sequence

from megatron_rl.processes import set_parent_death_signal
from megatron_rl.rollout.base import ServerError
from megatron_rl.rollout.child_env import inference_env
from megatron_rl.rollout.net import (HOST, TRANSPORT_ERRORS, ServerRequestError, advertised_host,
                                     free_port, http_json)
from megatron_rl.rollout.threads import BackgroundThreads

log = logging.getLogger(__name__)


_LIVE: "weakref.WeakSet[ManagedServer]" = weakref.WeakSet()
_LAUNCHER: list = []  # the one thread that starts server processes (started at first use)
_LAUNCHER_LOCK = threading.Lock()


def _launch(*args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(*args, **kwargs) on a daemon thread that lives as long as this process:
    a server's parent-death signal (set_parent_death_signal) fires when the thread that started
    it ends, and a server (re)started by a short-lived thread (an agent episode's request that
    found it dead) would die with that thread."""
    with _LAUNCHER_LOCK:
        if not _LAUNCHER:
            _LAUNCHER.append(BackgroundThreads(1, name="server-launcher"))
    return _LAUNCHER[0].submit(lambda: subprocess.Popen(*args, **kwargs)).result()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class ManagedServer:
    """One inference server process (see module docstring).

    build_argv(model_path, host, port) -> argv of the server command.
    env: extra environment variables for the server, on top of child_env.inference_env()
        (the trainer's environment without torchrun's and the allocator's variables).
    health_path: GET endpoint that answers 200 once the server serves requests.
    on_start(server): called after every (re)start once healthy, e.g. to restore state.
    """

    def __init__(self, name: str, build_argv: Callable[[str, str, int], Sequence[str]],
                 model_path: str, *, log_dir: str, env: dict[str, str] | None = None,
                 health_path: str = "/health", startup_timeout: float = 600.0,
                 max_restarts: int = 3, on_start: Callable[["ManagedServer"], None] | None = None,
                 stop_timeout: float = 20.0, host: str = HOST):
        self.name = name
        self._build_argv = build_argv
        self.model_path = model_path
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.max_restarts = max_restarts
        self.on_start = on_start
        self.stop_timeout = stop_timeout
        self.host = host
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self.num_restarts = 0
        self.closed = False  # shut down for good: a request failing after that does not restart it
        self.startup_seconds: list[float] = []
        self._attached_url: str | None = None
        self._ready = False
        self._launched_at = 0.0
        self._lock = threading.RLock()

    @classmethod
    def attach(cls, url: str, name: str = "server", health_path: str = "/health",
               on_start: Callable[["ManagedServer"], None] | None = None) -> "ManagedServer":
        """A server run by someone else: requests only, never started, restarted or stopped."""
        server = cls(name, lambda *a: [], model_path="", log_dir="", health_path=health_path,
                     max_restarts=0, on_start=on_start)
        server._attached_url = url.rstrip("/")
        return server

    @property
    def managed(self) -> bool:
        return self._attached_url is None

    @property
    def url(self) -> str:
        if self._attached_url is not None:
            return self._attached_url
        if self.port is None:
            raise ServerError(f"{self.name}: not started")
        return f"http://{advertised_host(self.host)}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, wait: bool = True) -> "ManagedServer":
        """Start the process (managed) or check the attached server, and wait until healthy.

        wait=False returns right after launching; a later start() waits for that process.
        A closed server (`close`) is not started again until `reopen`.
        """
        with self._lock:
            if self.closed:
                raise ServerError(f"{self.name} was shut down: not starting it (reopen first)")
            if not self.managed:
                self.wait_healthy(self.startup_timeout)
                if self.on_start is not None:
                    self.on_start(self)
                return self
            if self.proc is not None and self.proc.poll() is None:
                if wait and not self._ready:
                    self._wait_ready()
                return self
            os.makedirs(self.log_dir, exist_ok=True)
            self.port = free_port(self.host)
            argv = [str(a) for a in self._build_argv(self.model_path, self.host, self.port)]
            self.log_path = os.path.join(self.log_dir, f"{self.name}.log")
            t0 = time.monotonic()
            with open(self.log_path, "a") as log:
                log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start "
                          f"(restart {self.num_restarts}): {' '.join(argv)}\n")
                log.flush()
                self.proc = _launch(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=inference_env(self.env), start_new_session=True,
                    preexec_fn=set_parent_death_signal)
            _LIVE.add(self)
            self._ready, self._launched_at = False, t0
            if wait:
                self._wait_ready()
            return self

    def _wait_ready(self) -> None:
        try:
            self.wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds.append(time.monotonic() - self._launched_at)
        self._ready = True
        if self.on_start is not None:
            self.on_start(self)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with code {self.proc.returncode} during "
                                  f"startup; log {self.log_path}:\n{self.log_tail()}")
            if self.healthy(timeout=5.0):
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not healthy after {timeout:.0f} s at {self.url}; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        """The process runs (managed) — says nothing about whether it answers."""
        return not self.managed or (self.proc is not None and self.proc.poll() is None)

    def healthy(self, timeout: float = 10.0) -> bool:
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.HTTPError, *TRANSPORT_ERRORS):
            return False

    def restart(self, reason: str = "") -> None:
        """Stop (if needed) and start again, serving `self.model_path`."""
        with self._lock:
            if self.closed:
                raise ServerError(f"{self.name} at {self.url} was shut down ({reason}): not "
                                  "restarting it")
            if not self.managed:
                raise ServerError(f"{self.name} at {self.url} failed ({reason}) and is attached, "
                                  "not managed: cannot restart it")
            if self.num_restarts >= self.max_restarts:
                raise ServerError(f"{self.name}: {reason}; gave up after {self.num_restarts} "
                                  f"restarts; log {self.log_path}:\n{self.log_tail()}")
            self.num_restarts += 1
            if self.log_path is not None:  # none yet when it never started
                with open(self.log_path, "a") as log:
                    log.write(f"\n===== restarting {self.name}: {reason}\n")
            self.stop()
            self.start()

    def ensure_healthy(self) -> None:
        """Health check; restart when the process is dead or does not answer."""
        if not self.healthy():
            exit_code = None if self.proc is None else self.proc.poll()
            self.restart(f"health check failed (exit code {exit_code})")

    def stop(self, timeout: float | None = None) -> None:
        """Kill the server's whole process group: SIGTERM, then SIGKILL after `timeout`
        (default: stop_timeout)."""
        timeout = self.stop_timeout if timeout is None else timeout
        with self._lock:
            proc, self.proc = self.proc, None
            self._ready = False
            _LIVE.discard(self)
            if proc is None:
                return
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    # The leader is gone; children may still be exiting in its group.
                    if not _group_alive(proc.pid):
                        break
                    time.sleep(0.5)
                    if not _group_alive(proc.pid):
                        break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    # -- requests --------------------------------------------------------------------------------
    def call(self, fn: Callable[[str], Any]) -> Any:
        """fn(base_url) with one retry on a restarted server if the server went away.

        A transport error, or an HTTP 5xx while the process is dead or unhealthy, counts as the
        server gone; an HTTP error from a healthy server is the caller's (re-raised). Requests
        from several threads that fail on the same dead process restart it once: a request
        restarts the server only if no other has since it was sent.
        """
        with self._lock:  # waits for a restart in progress
            seen = self.num_restarts
        try:
            return fn(self.url)
        except TRANSPORT_ERRORS as e:
            if self.healthy():
                raise
            self._restart_since(seen, f"request failed: {type(e).__name__}: {e}")
        except ServerRequestError as e:
            if e.status < 500 or self.healthy():
                raise
            self._restart_since(seen, f"request failed with HTTP {e.status}, server unhealthy")
        return fn(self.url)

    def _restart_since(self, seen: int, reason: str) -> None:
        """Restart, unless another request did after the restart count was `seen`."""
        with self._lock:
            if self.num_restarts == seen:
                self.restart(reason)

    def post(self, path: str, payload: Any = None, timeout: float = 600.0,
             retry: bool = True) -> Any:
        if not retry:
            return http_json("POST", self.url + path, payload, timeout)
        return self.call(lambda url: http_json("POST", url + path, payload, timeout))

    def get(self, path: str, timeout: float = 60.0) -> Any:
        return self.call(lambda url: http_json("GET", url + path, None, timeout))

    def log_tail(self, num_lines: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def close(self) -> None:
        """Stop for good: a request still in flight fails instead of restarting the server, and
        `start` refuses (until `reopen`)."""
        self.closed = True
        self.stop()

    def reopen(self) -> None:
        """Undo `close`: the server may be started and restarted again (a pool's rejoin)."""
        self.closed = False

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; count only processes that are not defunct.
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
