"""A Python interpreter tool: each call runs the policy's program in a fresh bubblewrap sandbox.

One call is one process tree, started as::

    choom -n 1000 -- setpriv --reuid=65534 --regid=65534 --clear-groups -- \\   (only as root)
      bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session \\
            --ro-bind /usr /usr  (+ the /bin, /lib... links)  --proc /proc --dev /dev \\
            --tmpfs /tmp (sized)  --tmpfs /dev/shm (sized)  --remount-ro / ... -- \\
      prlimit --as --cpu --nproc --nofile --fsize --core=0 -- python3 -I /tmp/main.py

What the program can and cannot do:

- **Files**: it sees ``/usr`` (and the ``/bin``, ``/lib*`` links) read-only, a fresh ``/proc`` of
  its own pid namespace and a minimal ``/dev``; nothing else of the host (no ``/home``, ``/root``,
  ``/work``, ``/etc``, ``/tmp``). The only writable places are two fresh tmpfs, ``/tmp`` (its
  working directory, holding the program as ``main.py``) and ``/dev/shm``, each at most
  ``scratch_mb``; both vanish when the call ends, so nothing persists between calls.
- **Identity**: as root, the sandbox runs as the unprivileged user ``nobody`` (65534) on the host,
  in its own user namespace with no capabilities, where it cannot create further user
  namespaces. As another user it runs as that user, in its own user namespace.
- **Environment**: bwrap is started with an empty environment (not just ``--clearenv``: the
  sandbox's pid 1 is a fork of bwrap, whose ``/proc/1/environ`` would otherwise show the
  trainer's variables); the program gets ``PATH``, ``HOME=/tmp`` and ``LANG`` only, and no file
  descriptors but its standard streams.
- **Network**: its own network namespace with only a loopback; no route out, and the host's
  loopback services are not reachable.
- **Processes**: its own pid namespace: it sees and can signal only its own processes. All of
  them die when the call ends: when the program exits, at the wall-clock limit, or when the
  process that started bwrap dies (``--die-with-parent``; a killed trainer leaves no sandbox).
- **Limits**: wall clock ``wall_time_s`` (the whole tree is killed); per process: CPU time
  ``cpu_time_s`` (SIGXCPU), address space ``memory_mb`` (a large allocation fails with
  ``MemoryError``), open files; ``max_processes`` processes and threads in the sandbox
  (``RLIMIT_NPROC`` counted in its own user namespace, so sandboxes do not share the count and a
  fork bomb stalls at the limit until the wall clock ends it); output: the call stops the program
  once it has written more than ``max_output_bytes`` to stdout and stderr together. Its
  ``oom_score_adj`` is 1000, so under memory pressure the kernel kills sandboxed programs first.

Not covered: there is no seccomp filter (the kernel's system calls are reachable, as for any
unprivileged user) and no cgroup, so memory is bounded per process (``memory_mb`` times
``max_processes``, plus the two tmpfs), not per sandbox, and CPU is shared with the host.

Per-call overhead and measured limits are in docs/agent.md. Calls run concurrently on
``ToolExecutor``'s threads: each call is its own process tree, so a pool of Python worker
processes between them would add a hop and no isolation. bwrap is started without a
``preexec_fn`` (which would make Python ``fork()`` the whole trainer, unsafe with threads):
``--die-with-parent`` is bwrap's own ``PR_SET_PDEATHSIG`` (the ``set_parent_death_signal`` of
``megatron_rl.processes``, done in the child). It fires when the *thread* that started bwrap ends;
each call's thread waits for it, so no call outlives its thread. ``start_new_session`` keeps the
terminal's Ctrl-C for the trainer to handle.
"""
from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from megatron_rl.agent.tools import OK, OUTPUT_TRUNCATED, TIMEOUT, TOOL_ERROR, Tool, ToolResult

SANDBOX_UID = 65534  # "nobody": the host user a sandbox runs as when the trainer is root
_READ_CHUNK = 65536
_SIGNAL_EXIT_BASE = 128  # bwrap exits with 128 + N when its command dies of signal N
_EXIT_GRACE_S = 2.0  # for a killed sandbox's processes to exit and close their pipes


class _Run:
    """The parent's side of one sandboxed call: its pipes, the output kept, how it ended."""

    def __init__(self, proc: subprocess.Popen, info_fd: int, max_output_bytes: int):
        self.proc = proc
        self.cap = max_output_bytes
        self.out, self.err, self.info = bytearray(), bytearray(), bytearray()
        self.timed_out = self.truncated = False
        self.selector = selectors.DefaultSelector()
        self.selector.register(proc.stdout, selectors.EVENT_READ, self.out)  # type: ignore[arg-type]
        self.selector.register(proc.stderr, selectors.EVENT_READ, self.err)  # type: ignore[arg-type]
        self.info_file = os.fdopen(info_fd, "rb", buffering=0)
        self.selector.register(self.info_file, selectors.EVENT_READ, self.info)

    def _read(self, timeout: float, keep: bool) -> None:
        for key, _ in self.selector.select(timeout):
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                self.selector.unregister(key.fileobj)
            elif keep or key.data is self.info:
                key.data.extend(chunk)

    def collect(self, deadline: float) -> None:
        """Keep stdout and stderr until both close and bwrap exits, the deadline passes
        (``timed_out``), or they hold more than the cap together (``truncated``, cut to it)."""
        while self.selector.get_map() or self.proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return
            if not self.selector.get_map():  # pipes closed: only bwrap's exit is left
                try:
                    self.proc.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    pass
                continue
            self._read(remaining, keep=True)
            if len(self.out) + len(self.err) > self.cap:
                del self.err[max(0, self.cap - len(self.out)):]
                del self.out[self.cap:]
                self.truncated = True
                return

    def _child_pid(self) -> int | None:
        try:
            return int(json.loads(bytes(self.info))["child-pid"])
        except (ValueError, KeyError, TypeError):
            return None

    def stop(self) -> None:
        """Kill what is still running and wait until the whole tree is gone. The sandbox's pid 1
        is killed first, so that bwrap reaps it and the kernel the rest of its pid namespace;
        killing only bwrap would leave that pid 1 to the host's init (a zombie until reaped,
        forever under an init that does not reap). Then the pipes are drained to EOF: every
        sandboxed process holds them, so EOF means none is left."""
        try:
            if self.proc.poll() is None:
                if self.info_file.fileno() in [k.fd for k in self.selector.get_map().values()]:
                    self._read(0.0, keep=False)  # the info may not be read yet
                pid = self._child_pid()
                try:
                    if pid is None:  # bwrap has not started the sandbox yet
                        raise ProcessLookupError
                    os.kill(pid, signal.SIGKILL)
                    self.proc.wait(timeout=_EXIT_GRACE_S)
                except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                    self.proc.kill()  # --die-with-parent then kills the sandbox's pid 1
                    self.proc.wait()
            deadline = time.monotonic() + _EXIT_GRACE_S
            while self.selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
                self._read(remaining, keep=False)
        finally:
            self.selector.close()
            for f in (self.proc.stdout, self.proc.stderr, self.info_file):
                if f is not None:
                    f.close()


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or util-linux) is missing, or a sandbox cannot start on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed call."""

    wall_time_s: float = field(default=10.0, metadata={"help": (
        "wall-clock limit of one call in seconds; the whole sandbox is killed past it")})
    cpu_time_s: int | None = field(default=None, metadata={"help": (
        "CPU seconds per process (RLIMIT_CPU; SIGXCPU past it); None: the wall limit rounded up")})
    memory_mb: int = field(default=1024, metadata={"help": (
        "address space per process in MiB (RLIMIT_AS); a larger allocation raises MemoryError")})
    max_processes: int = field(default=16, metadata={"help": (
        "processes and threads in the sandbox (RLIMIT_NPROC in its own user namespace)")})
    scratch_mb: int = field(default=64, metadata={"help": (
        "size in MiB of each writable tmpfs (/tmp and /dev/shm); also the largest file")})
    max_output_bytes: int = field(default=64 * 1024, metadata={"help": (
        "stdout plus stderr kept from one call; the program is stopped once it writes more")})
    max_open_files: int = field(default=256, metadata={"help": "open file descriptors per process (RLIMIT_NOFILE)"})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not self.wall_time_s > 0:
            raise ValueError(f"wall_time_s must be > 0, got {self.wall_time_s}")
        if self.cpu_time_s is not None and self.cpu_time_s < 1:
            raise ValueError(f"cpu_time_s must be >= 1 (whole seconds) or None, got {self.cpu_time_s}")
        for name, least in (("memory_mb", 64), ("max_processes", 2), ("scratch_mb", 1),
                            ("max_output_bytes", 1024), ("max_open_files", 16)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_time_s if self.cpu_time_s is not None else max(1, math.ceil(self.wall_time_s))


@dataclass(frozen=True)
class SandboxResult:
    """What one call produced. ``exit_code`` is the program's (None when the call stopped it);
    ``signal`` the signal that ended it, if one did."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_truncated: bool
    duration_s: float


def _find(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")


def _default_python() -> str:
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(path):
            return path
    raise SandboxUnavailable("no system Python (/usr/bin/python3) to run in the sandbox; pass python=")


class PythonSandbox:
    """Runs Python programs, one fresh sandbox per ``run``. Thread-safe: calls share nothing.

    ``python``: the interpreter inside the sandbox (default the system's ``/usr/bin/python3``, so
    that no virtual environment, home or work directory is exposed). One outside ``/usr`` has its
    installation prefix bound read-only as well; it must be readable by the sandbox's user.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, python: str | None = None):
        self.limits = limits or SandboxLimits()
        tools = {name: _find(name) for name in ("bwrap", "prlimit", "setpriv", "choom")}
        if tools["bwrap"] is None:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed: run scripts/setup.sh as root, or "
                "`apt-get install bubblewrap`")
        if tools["prlimit"] is None or (os.geteuid() == 0 and tools["setpriv"] is None):
            raise SandboxUnavailable("util-linux's prlimit and setpriv are needed for the sandbox")
        self._tools = tools
        self.python = python or _default_python()
        real = os.path.realpath(self.python)
        prefix = os.path.dirname(os.path.dirname(real))
        self._extra_binds = [] if real.startswith("/usr/") else [prefix]

    def command(self, code_fd: int, info_fd: int) -> list[str]:
        """The argv of one call: the program is read from the open file ``code_fd``; bwrap
        writes the host pid of the sandbox's pid 1 to ``info_fd``."""
        lim = self.limits
        scratch = str(lim.scratch_mb * 1024 * 1024)
        argv: list[str] = []
        if self._tools["choom"] is not None:
            argv += [self._tools["choom"], "-n", "1000", "--"]
        if os.geteuid() == 0:
            argv += [self._tools["setpriv"], f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                     "--clear-groups", "--"]
        argv += [self._tools["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns",
                 "--die-with-parent", "--new-session", "--hostname", "sandbox",
                 "--info-fd", str(info_fd),
                 "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                 "--setenv", "LANG", "C.UTF-8",
                 "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = "/" + name
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for path in self._extra_binds:
            argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--size", scratch, "--tmpfs", "/tmp",
                 "--size", scratch, "--tmpfs", "/dev/shm",
                 "--remount-ro", "/dev",
                 "--ro-bind-data", str(code_fd), "/tmp/main.py",
                 "--remount-ro", "/",
                 "--chdir", "/tmp",
                 "--", self._tools["prlimit"],
                 f"--as={lim.memory_mb * 1024 * 1024}", f"--cpu={lim.cpu_seconds}",
                 f"--nproc={lim.max_processes}", f"--nofile={lim.max_open_files}",
                 f"--fsize={scratch}", "--core=0",
                 "--", self.python, "-I", "/tmp/main.py"]
        return argv

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a program; never raises for the program's sake."""
        lim = self.limits
        code_fd = os.memfd_create("sandbox-main.py")
        info_r, info_w = os.pipe()  # bwrap reports the sandbox's pid 1 here
        try:
            view = memoryview(code.encode("utf-8", errors="replace"))
            while view:
                view = view[os.write(code_fd, view):]
            os.lseek(code_fd, 0, os.SEEK_SET)
            start = time.monotonic()
            proc = subprocess.Popen(self.command(code_fd, info_w), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                    pass_fds=(code_fd, info_w), start_new_session=True)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(code_fd)
            os.close(info_w)
        run = _Run(proc, info_r, lim.max_output_bytes)
        try:
            run.collect(start + lim.wall_time_s)
        finally:
            run.stop()
        stopped = run.timed_out or run.truncated
        status = proc.returncode
        sig = None
        exit_code: int | None = None if stopped else status
        if not stopped and status < 0:  # bwrap itself died of a signal not sent by this call
            sig, exit_code = -status, None
        elif not stopped and status > _SIGNAL_EXIT_BASE:
            sig, exit_code = status - _SIGNAL_EXIT_BASE, None
        return SandboxResult(
            stdout=bytes(run.out).decode("utf-8", errors="replace"),
            stderr=bytes(run.err).decode("utf-8", errors="replace"),
            exit_code=exit_code, signal=sig, timed_out=run.timed_out,
            output_truncated=run.truncated, duration_s=time.monotonic() - start)

    def check(self) -> None:
        """Run a trivial program; raise ``SandboxUnavailable`` with bwrap's message if it fails
        (e.g. user namespaces disabled on this host, or an interpreter the sandbox cannot read)."""
        result = self.run("print('ok')")
        if result.stdout.strip() != "ok":
            raise SandboxUnavailable(
                f"the Python sandbox does not start on this host (exit code {result.exit_code}): "
                f"{(result.stderr or result.stdout).strip()[:2000]}")


def format_result(result: SandboxResult, limits: SandboxLimits) -> ToolResult:
    """The tool response: stdout, then stderr, then a bracketed status line when the program did
    not end normally; its outcome for metrics."""
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    status, outcome = None, OK
    if result.timed_out:
        status = f"[timed out: the program ran longer than {limits.wall_time_s:g} s and was stopped]"
        outcome = TIMEOUT
    elif result.output_truncated:
        status = (f"[output truncated: the program wrote more than {limits.max_output_bytes} bytes "
                  "and was stopped]")
        outcome = OUTPUT_TRUNCATED
    elif result.signal == signal.SIGXCPU:
        status = f"[stopped: the program used more than {limits.cpu_seconds} s of CPU time]"
        outcome = TIMEOUT
    elif result.signal is not None:
        try:
            name = signal.Signals(result.signal).name
        except ValueError:
            name = str(result.signal)
        status, outcome = f"[killed by signal {name}]", TOOL_ERROR
    elif result.exit_code:
        status, outcome = f"[exit code {result.exit_code}]", TOOL_ERROR
    if status is not None:
        text += ("" if not text or text.endswith("\n") else "\n") + status
    return ToolResult(text if text else "(no output)", outcome)


def python_tool(sandbox: PythonSandbox | None = None, *, name: str = "python", check: bool = True) -> Tool:
    """The code interpreter tool over ``sandbox`` (default limits when None). ``check`` runs one
    trivial program now, so that a host where the sandbox cannot start fails at setup."""
    box = sandbox or PythonSandbox()
    if check:
        box.check()

    def run(code: str) -> ToolResult:
        return format_result(box.run(code), box.limits)

    return Tool(
        name=name,
        description=(
            "Run a Python 3 program and return what it prints (stdout, then stderr). Each call is "
            "a fresh process with no network and nothing kept from earlier calls; nothing can be "
            "installed. Print the values you need. Limits: "
            f"{box.limits.wall_time_s:g} s, {box.limits.memory_mb} MiB per process."),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the complete program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        fn=run,
    )
