"""A Python interpreter tool: each call runs the policy's program in a fresh bubblewrap sandbox.

One call is one process tree, started as::

    python3 -I -S -c <keeper> \\                               (kills and reaps what bwrap leaves)
      choom -n 1000 -- setpriv --reuid=65534 --regid=65534 --clear-groups -- \\   (only as root)
      bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session \\
            --seccomp FD  --ro-bind /usr /usr  (+ the /bin, /lib... links)  --proc /proc \\
            --dev /dev --tmpfs /tmp (sized)  --tmpfs /dev/shm (sized)  --remount-ro / ... -- \\
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
  them have ended, and been reaped, when the call returns: when the program exits, at the
  wall-clock limit, whatever the program did; and when the thread that started the call dies
  (parent-death signals; a killed trainer leaves no sandbox). bwrap exits as soon as its init
  (the sandbox's pid 1) reports the program's exit status, before that init ends, so the init
  would be orphaned on every call (a zombie forever under a container's init that does not
  reap). The keeper, a child subreaper between the caller and bwrap, inherits it, kills it (its
  whole pid namespace dies with it) and reaps it, then exits with bwrap's status.
- **System calls**: a seccomp filter (``seccomp_filter``) refuses, with EPERM, access to other
  processes (ptrace, process_vm_readv/writev, process_madvise, pidfd_getfd, kcmp: the init runs
  as the sandbox's user, and a program that took it over could make bwrap return with its
  processes still running), memory that RLIMIT_AS does not count (memfd_create, memfd_secret,
  System V shared memory, message queues, semaphores), and kernel interfaces an interpreter's
  programs have no use for (bpf, perf_event_open, userfaultfd, io_uring, key rings); 32-bit and
  x32 system calls fail with ENOSYS. x86_64 and aarch64 only.
- **Limits**: wall clock ``wall_time_s`` (the whole tree is killed); per process: CPU time
  ``cpu_time_s`` (SIGXCPU), address space ``memory_mb`` (a large allocation fails with
  ``MemoryError``), open files; ``max_processes`` processes and threads in the sandbox
  (``RLIMIT_NPROC`` counted in its own user namespace, so sandboxes do not share the count and a
  fork bomb stalls at the limit until the wall clock ends it); output: the call stops the program
  once it has written more than ``max_output_bytes`` to stdout and stderr together. Its
  ``oom_score_adj`` is 1000, so under memory pressure the kernel kills sandboxed programs first.
- **Memory**: bounded per sandbox by ``max_processes x memory_mb`` (address space) plus the two
  tmpfs (``2 x scratch_mb``), memfd and System V memory being refused, plus what the kernel holds
  for its open files (pipe and socket buffers), which no rlimit counts. There is no memory
  cgroup (one cannot be made on every host, and the bound should not depend on the host).
  CPU is shared with the host.

Per-call overhead and measured limits are in docs/agent.md. Calls run concurrently on
``ToolExecutor``'s threads: each call is its own process tree, so a pool of Python worker
processes between them would add a hop and no isolation. The keeper is started without a
``preexec_fn`` (which would make Python ``fork()`` the whole trainer, unsafe with threads): it
sets its own ``PR_SET_PDEATHSIG`` (as ``set_parent_death_signal`` of ``megatron_rl.processes``
does in a child), and bwrap's ``--die-with-parent`` does the same below it. It fires when the
*thread* that started the keeper ends; each call's thread waits for it, so no call outlives its
thread. ``start_new_session`` keeps the
terminal's Ctrl-C for the trainer to handle.
"""
from __future__ import annotations

import math
import os
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields

from megatron_rl.agent.tools import OK, OUTPUT_TRUNCATED, TIMEOUT, TOOL_ERROR, Tool, ToolResult

SANDBOX_UID = 65534  # "nobody": the host user a sandbox runs as when the trainer is root
_READ_CHUNK = 65536
_SIGNAL_EXIT_BASE = 128  # bwrap exits with 128 + N when its command dies of signal N
_EXIT_GRACE_S = 2.0  # for a killed sandbox's processes to exit and close their pipes
_KEEPER_GRACE_S = 5.0  # for the keeper to kill and reap the sandbox once asked

# The keeper: the process between the caller and bwrap (``python3 -I -S -c _KEEPER <caller pid>
# -- <bwrap argv>``). It dies with the caller's thread (PR_SET_PDEATHSIG), is a child subreaper
# (PR_SET_CHILD_SUBREAPER: the sandbox's pid 1 becomes its child when bwrap exits, which bwrap
# does as soon as the program's exit status is reported, before pid 1 ends), starts bwrap, and
# once bwrap has exited, or on SIGTERM, kills every child left (pid 1: its whole pid namespace
# dies with it) and reaps them, then exits with bwrap's status (128 + N for a signal N).
# A child is killed by pid only while unreaped, so the pid cannot belong to another process.
_KEEPER = r"""
import os, signal, sys
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) or libc.prctl(36, 1, 0, 0, 0):
    sys.exit("sandbox keeper: prctl: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the caller is gone already
argv = sys.argv[3:]
bwrap = None
stopping = False

def stop(signum, frame):
    global stopping
    stopping = True
    if bwrap is not None:
        os.kill(bwrap, signal.SIGKILL)

def children():
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
        return found

signal.signal(signal.SIGTERM, stop)
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        os.write(2, f"sandbox keeper: cannot run {argv[0]}: {e}\n".encode())
    os._exit(127)
bwrap = pid
if stopping:
    os.kill(bwrap, signal.SIGKILL)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.closerange(3, 65536)
os.waitid(os.P_PID, bwrap, os.WEXITED | os.WNOWAIT)  # a zombie: its pid stays reserved
bwrap = None
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
while True:
    for child in children():
        os.kill(child, signal.SIGKILL)
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
os._exit(128 - status if status < 0 else status)
"""

# The seccomp filter (a classic BPF program, given to bwrap with --seccomp): these system calls
# fail with EPERM inside the sandbox, and so does every call of another ABI (32-bit x86, x32).
# Denied are: access to other processes (ptrace, process_vm_*, process_madvise, pidfd_getfd,
# kcmp: the sandbox's pid 1 runs as the same user, so without this a program could take it
# over and end the call while its processes run on); memory that RLIMIT_AS does not count
# (memfd_create, memfd_secret, System V shared memory, message queues and semaphores); and
# kernel interfaces an interpreter's programs have no use for (bpf, perf_event_open,
# userfaultfd, io_uring, the key rings). {name: (x86_64 number, aarch64 number)}.
_DENIED_SYSCALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "process_madvise": (440, 440), "pidfd_getfd": (438, 438), "kcmp": (312, 272),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194),
    "msgget": (68, 186), "semget": (64, 190), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218),
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # seccomp_data.arch
_X32_SYSCALL_BIT = 0x40000000


def seccomp_filter(machine: str | None = None) -> bytes:
    """The sandbox's seccomp program for ``machine`` (default this one's), as bwrap reads it:
    an array of ``struct sock_filter``. Raises SandboxUnavailable on another architecture."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise SandboxUnavailable(
            f"the sandbox's seccomp filter knows x86_64 and aarch64, not {machine!r}")
    column = 0 if machine == "x86_64" else 1
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, |JGE|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_*

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [op(ld_abs, 4), op(jeq, _AUDIT_ARCH[machine], 1, 0), op(ret, enosys), op(ld_abs, 0)]
    if machine == "x86_64":
        prog += [op(jge, _X32_SYSCALL_BIT, 0, 1), op(ret, enosys)]
    for nr in sorted({numbers[column] for numbers in _DENIED_SYSCALLS.values()}):
        prog += [op(jeq, nr, 0, 1), op(ret, eperm)]
    prog.append(op(ret, allow))
    return b"".join(prog)


class _Run:
    """The parent's side of one sandboxed call: its pipes, the output kept, how it ended."""

    def __init__(self, proc: subprocess.Popen, max_output_bytes: int):
        self.proc = proc
        self.cap = max_output_bytes
        self.out, self.err = bytearray(), bytearray()
        self.timed_out = self.truncated = False
        self.selector = selectors.DefaultSelector()
        self.selector.register(proc.stdout, selectors.EVENT_READ, self.out)  # type: ignore[arg-type]
        self.selector.register(proc.stderr, selectors.EVENT_READ, self.err)  # type: ignore[arg-type]

    def _read(self, timeout: float, keep: bool) -> None:
        for key, _ in self.selector.select(timeout):
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                self.selector.unregister(key.fileobj)
            elif keep:
                key.data.extend(chunk)

    def collect(self, deadline: float) -> None:
        """Keep stdout and stderr until both close and the keeper exits, the deadline passes
        (``timed_out``), or they hold more than the cap together (``truncated``, cut to it)."""
        while self.selector.get_map() or self.proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return
            if not self.selector.get_map():  # pipes closed: only the keeper's exit is left
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

    def stop(self) -> None:
        """End what is still running and wait until the whole tree is gone and reaped: SIGTERM
        asks the keeper to kill bwrap and the sandbox's pid 1 and reap them (it exits when it
        has); SIGKILL is the last resort for a keeper that does not (bwrap and pid 1 then die of
        their parent-death signals). Then the pipes are drained to EOF: every sandboxed process
        holds them, so EOF means none is left."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=_KEEPER_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            deadline = time.monotonic() + _EXIT_GRACE_S
            while self.selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
                self._read(remaining, keep=False)
        finally:
            self.selector.close()
            for f in (self.proc.stdout, self.proc.stderr):
                if f is not None:
                    f.close()


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or util-linux) is missing, or a sandbox cannot start on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed call. Each field's metadata holds its help text and its
    bound ("gt" or "min"), which ``validate`` checks and which the flags of these limits
    (agent/settings.py, --agent-sandbox-*) declare."""

    wall_time_s: float = field(default=10.0, metadata={"gt": 0, "help": (
        "wall-clock limit of one call in seconds; the whole sandbox is killed past it")})
    cpu_time_s: int | None = field(default=None, metadata={"min": 1, "help": (
        "CPU seconds per process (RLIMIT_CPU; SIGXCPU past it); unset: the wall-clock limit "
        "rounded up")})
    memory_mb: int = field(default=1024, metadata={"min": 64, "help": (
        "address space per process in MiB (RLIMIT_AS); a larger allocation raises MemoryError")})
    max_processes: int = field(default=16, metadata={"min": 2, "help": (
        "processes and threads in the sandbox (RLIMIT_NPROC in its own user namespace)")})
    scratch_mb: int = field(default=64, metadata={"min": 1, "help": (
        "size in MiB of each writable tmpfs (/tmp and /dev/shm); also the largest file")})
    max_output_bytes: int = field(default=64 * 1024, metadata={"min": 1024, "help": (
        "bytes of stdout plus stderr kept from one call; the program is stopped once it writes "
        "more")})
    max_open_files: int = field(default=256, metadata={"min": 16, "help": (
        "open file descriptors per process (RLIMIT_NOFILE)")})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first limit outside its declared bound."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if "gt" in f.metadata and not value > f.metadata["gt"]:
                raise ValueError(f"{f.name} must be > {f.metadata['gt']}, got {value}")
            if "min" in f.metadata and not value >= f.metadata["min"]:
                raise ValueError(f"{f.name} must be >= {f.metadata['min']}, got {value}")

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
        self._keeper_python = sys.executable or self.python
        self._seccomp = seccomp_filter()

    def command(self, code_fd: int, seccomp_fd: int) -> list[str]:
        """The argv of one call: the program is read from the open file ``code_fd``, the seccomp
        filter (``seccomp_filter()``) from ``seccomp_fd``."""
        lim = self.limits
        scratch = str(lim.scratch_mb * 1024 * 1024)
        argv: list[str] = [self._keeper_python, "-I", "-S", "-c", _KEEPER, str(os.getpid()), "--"]
        if self._tools["choom"] is not None:
            argv += [self._tools["choom"], "-n", "1000", "--"]
        if os.geteuid() == 0:
            argv += [self._tools["setpriv"], f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                     "--clear-groups", "--"]
        argv += [self._tools["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns",
                 "--die-with-parent", "--new-session", "--hostname", "sandbox",
                 "--seccomp", str(seccomp_fd),
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
        """Run ``code`` as a program; never raises for the program's sake. When it returns, every
        process of the call has ended and been reaped."""
        lim = self.limits
        code_fd = os.memfd_create("sandbox-main.py")
        seccomp_fd = os.memfd_create("sandbox-seccomp")
        try:
            for fd, data in ((code_fd, code.encode("utf-8", errors="replace")), (seccomp_fd, self._seccomp)):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.lseek(fd, 0, os.SEEK_SET)
            start = time.monotonic()
            proc = subprocess.Popen(self.command(code_fd, seccomp_fd), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                    pass_fds=(code_fd, seccomp_fd), start_new_session=True)
        finally:
            os.close(code_fd)
            os.close(seccomp_fd)
        run = _Run(proc, lim.max_output_bytes)
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
