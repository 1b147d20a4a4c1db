"""The Python interpreter tool's bubblewrap sandbox: code runs and reports stdout/stderr, and
hostile programs (fork bomb, busy loop, writes outside the scratch dir, reading host files and
environment, network, killing the parent, a 10 GiB allocation, memory outside the address space,
endless output, taking over the sandbox's pid 1) each end in an error or timeout response, change
nothing outside, and leave no process behind, not even a zombie.

Skipped only where bwrap is not installed (scripts/setup.sh installs it as root)."""
import ast
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.agent import (PythonSandbox, SandboxLimits, SandboxUnavailable, ToolCall, ToolExecutor,
                               ToolRegistry, python_tool)
from megatron_rl.agent.sandbox import SANDBOX_UID, format_result
from megatron_rl.agent.tools import OK, OUTPUT_TRUNCATED, TIMEOUT, TOOL_ERROR

BWRAP = shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")
NO_BWRAP = "bubblewrap (bwrap) is not installed; scripts/setup.sh installs it when run as root"
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason=NO_BWRAP)
REPO = Path(__file__).resolve().parents[3]
LIMITS = SandboxLimits(wall_time_s=2.0, memory_mb=256, max_processes=8, scratch_mb=8, max_output_bytes=16384)
x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the ptrace injection is x86_64 code")

# A take-over of bwrap's init (the sandbox's pid 1, which runs as the sandbox's user): attach
# with ptrace, make it clear its parent-death signal, close its stdout and stderr, and write
# exit status 0 to the eventfd bwrap waits on. bwrap then returns at once while the sandbox's
# processes run on. Run inside the sandbox on pid 1, or by the test on pid 1's host pid.
FORGE_EXIT = r'''
import ctypes, os

def forge_exit(pid):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    ATTACH, DETACH, GETREGS, SETREGS, SINGLESTEP, PEEKTEXT, POKEDATA = 16, 17, 12, 13, 9, 1, 5
    RAX, ORIG_RAX, RIP, RSP, RDI, RSI, RDX = 10, 15, 16, 19, 14, 13, 12  # user_regs_struct

    def call(request, addr=0, data=0):
        ctypes.set_errno(0)
        res = libc.ptrace(request, pid, ctypes.c_void_p(addr), ctypes.c_void_p(data))
        if res == -1 and ctypes.get_errno():
            raise OSError(ctypes.get_errno(), f"ptrace({request}): {os.strerror(ctypes.get_errno())}")
        return res

    eventfd = next(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
                   if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[eventfd]")
    call(ATTACH)
    os.waitpid(pid, 0x40000000)  # __WALL
    Regs = ctypes.c_ulonglong * 27
    saved = Regs()
    call(GETREGS, 0, ctypes.addressof(saved))
    insn = saved[RIP] - 2  # init waits in wait4: the syscall instruction just before
    assert call(PEEKTEXT, insn) & 0xFFFF == 0x050F
    scratch = (saved[RSP] - 1024) & ~7
    call(POKEDATA, scratch, 1)

    def syscall(nr, *args):
        regs = Regs.from_buffer_copy(saved)
        regs[RIP], regs[RAX], regs[ORIG_RAX] = insn, nr, 2**64 - 1
        for index, value in zip((RDI, RSI, RDX), args):
            regs[index] = value
        call(SETREGS, 0, ctypes.addressof(regs))
        call(SINGLESTEP)
        os.waitpid(pid, 0x40000000)

    syscall(157, 1, 0)  # prctl(PR_SET_PDEATHSIG, 0)
    syscall(3, 1)  # close(1)
    syscall(3, 2)  # close(2)
    syscall(1, eventfd, scratch, 8)  # write(eventfd, 1): bwrap exits with status 0
    try:
        call(SETREGS, 0, ctypes.addressof(saved))
        call(DETACH)
    except ProcessLookupError:
        pass  # pid 1 was killed once bwrap returned
'''


@pytest.fixture(scope="module")
def sandbox():
    if BWRAP is None:
        pytest.skip(NO_BWRAP)
    box = PythonSandbox(LIMITS)
    box.check()
    return box


def _run(box: PythonSandbox, code: str):
    result = box.run(textwrap.dedent(code))
    return result, format_result(result, box.limits)


def _sandboxed_pids() -> list[int]:
    """Live processes of the sandbox's user in a pid namespace other than this test's."""
    uid = SANDBOX_UID if os.geteuid() == 0 else os.getuid()
    own = os.readlink("/proc/self/ns/pid")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid or os.readlink(f"/proc/{entry}/ns/pid") == own:
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _leftover_pids(timeout_s: float = 1.0) -> list[int]:
    """Sandboxed processes still alive after ``timeout_s``: when ``run`` returns, every process of
    the call has been killed and has closed its files; the kernel reaps them within milliseconds."""
    deadline = time.monotonic() + timeout_s
    while (pids := _sandboxed_pids()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def test_runs_code_and_returns_stdout_and_stderr(sandbox):
    result, response = _run(sandbox, """
        import sys
        print(sum(i * i for i in range(10)))
        print("warning: careful", file=sys.stderr)
        open("state.txt", "w").write("from the first call")
    """)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "285\n", "warning: careful\n")
    assert response.outcome == OK and response.text == "285\nwarning: careful\n"

    result, response = _run(sandbox, """
        import os
        print(os.path.exists("state.txt"), os.getcwd())
        def f():
            return 1 / 0
        f()
    """)
    assert result.stdout == "False /tmp\n"  # a fresh scratch dir: nothing kept from the last call
    assert response.outcome == TOOL_ERROR and result.exit_code == 1
    assert 'File "/tmp/main.py", line 5, in f' in response.text
    assert response.text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert str(REPO) not in response.text

    assert _run(sandbox, "")[1].text == "(no output)"
    assert _run(sandbox, "import sys; sys.exit(3)")[1].text == "[exit code 3]"


def test_the_tool_reports_outcomes_through_the_registry(sandbox):
    registry = ToolRegistry([python_tool(sandbox)])
    with ToolExecutor(registry, num_workers=4) as executor:
        start = time.perf_counter()
        results = executor.run([ToolCall("python", {"code": f"import time; time.sleep(1); print({i})"})
                                for i in range(4)] + [ToolCall("python", {"source": "print(1)"})])
        elapsed = time.perf_counter() - start
    assert [(r.text, r.outcome) for r in results[:4]] == [(f"{i}\n", OK) for i in range(4)]
    assert "missing required argument 'code'" in results[4].text
    assert elapsed < 2.5, f"4 one-second calls on 4 workers took {elapsed:.2f} s"


def test_a_fork_bomb_stalls_at_the_process_limit_and_dies_at_the_wall_limit(sandbox):
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(_sandboxed_pids()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result, response = _run(sandbox, """
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """)
    finally:
        done.set()
        watcher.join()
    assert response.outcome == TIMEOUT and result.timed_out
    assert "ran longer than 2 s" in response.text
    assert result.duration_s < LIMITS.wall_time_s + 2.5
    assert 2 <= peak[0] <= LIMITS.max_processes, peak
    assert _leftover_pids() == []  # the whole pid namespace is gone


def test_busy_and_sleeping_programs_are_stopped(sandbox):
    result, response = _run(sandbox, "while True: pass")
    assert response.outcome == TIMEOUT, response
    # under load the wall clock may come first, on an idle machine the CPU limit
    assert response.text in ("[timed out: the program ran longer than 2 s and was stopped]",
                             "[stopped: the program used more than 2 s of CPU time]")
    result, response = _run(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert response.outcome == TIMEOUT and result.timed_out
    assert response.text == "started\n[timed out: the program ran longer than 2 s and was stopped]"
    assert result.duration_s < LIMITS.wall_time_s + 1.0 and _leftover_pids() == []


def test_limits_are_set_inside(sandbox):
    result, response = _run(sandbox, """
        import resource
        for name in ("AS", "CPU", "NPROC", "NOFILE", "FSIZE", "CORE"):
            print(name, resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
        print("oom_score_adj", open("/proc/self/oom_score_adj").read().strip())
    """)
    mib = 1024 * 1024
    assert result.stdout.splitlines() == [
        f"AS ({256 * mib}, {256 * mib})", "CPU (2, 2)", "NPROC (8, 8)", "NOFILE (256, 256)",
        f"FSIZE ({8 * mib}, {8 * mib})", "CORE (0, 0)", "oom_score_adj 1000"], response.text


def test_writes_outside_the_scratch_dir_change_nothing(sandbox, tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    marker = f"sandbox-marker-{secrets.token_hex(4)}"
    result, response = _run(sandbox, f"""
        import os
        for path in [{str(host_file)!r}, "/usr/lib/{marker}", "/{marker}", "/dev/{marker}",
                     "/proc/{marker}", "/etc/{marker}", "/tmp/{marker}", "/dev/shm/{marker}"]:
            try:
                with open(path, "w") as f:
                    f.write("changed")
                print("WROTE", path)
            except OSError as e:
                print("denied", path, e.strerror)
        st = os.statvfs("/tmp")
        assert st.f_blocks * st.f_frsize <= 8 << 20, "scratch is not the small tmpfs"
        written = 0
        try:
            with open("/tmp/fill", "wb") as f:
                while written < 64 << 20:
                    f.write(b"x" * (1 << 20))
                    written += 1 << 20
        except OSError as e:
            print("scratch full after", written >> 20, "MiB:", e.strerror)
    """)
    wrote = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("WROTE")]
    assert wrote == [f"/tmp/{marker}", f"/dev/shm/{marker}"], response.text
    assert "scratch full after" in result.stdout and ("File too large" in result.stdout
                                                      or "No space left on device" in result.stdout)
    assert int(result.stdout.split("scratch full after ")[1].split()[0]) <= 8
    assert host_file.read_text() == "original"
    for host_path in (f"/tmp/{marker}", f"/dev/shm/{marker}", f"/{marker}", f"/usr/lib/{marker}"):
        assert not os.path.exists(host_path), host_path


def test_host_files_processes_and_environment_are_invisible(sandbox, monkeypatch):
    secret = f"secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", secret)
    result, response = _run(sandbox, f"""
        import os
        print("root:", sorted(os.listdir("/")))
        for path in ["/work", "/root", "/home", "/etc/passwd", "/etc/shadow", {str(REPO)!r}, {__file__!r},
                     {sys.executable!r}, "/sys/kernel"]:
            print("exists" if os.path.exists(path) else "missing", path)
        print("env:", dict(os.environ))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            for name in ("environ", "cmdline"):
                try:
                    print(pid, name, open(f"/proc/{{pid}}/{{name}}", "rb").read())
                except OSError as e:
                    print(pid, name, e.strerror)
        print("fds:", sorted(os.listdir("/proc/self/fd")))
        print("uid:", os.getuid(), "pid:", os.getpid())
    """)
    assert response.outcome == OK, response.text
    assert secret not in result.stdout and "MEGATRON_RL_TEST_SECRET" not in result.stdout
    lines = result.stdout.splitlines()
    root = ast.literal_eval(lines[0].removeprefix("root: "))
    assert {"usr", "tmp", "dev", "proc"} <= set(root) <= {"usr", "tmp", "dev", "proc", "bin", "sbin", "lib",
                                                          "lib32", "lib64", "libx32"}, root
    assert [line for line in lines if line.startswith("exists ")] == []
    assert "env: {'PATH': '/usr/bin:/bin', 'HOME': '/tmp', 'LANG': 'C.UTF-8', 'PWD': '/tmp'}" in result.stdout
    assert "fds: ['0', '1', '2', '3']" in result.stdout  # 3 is listdir's own
    assert "pid: 2" in result.stdout  # its own pid namespace: bwrap's init is 1
    assert f"uid: {SANDBOX_UID if os.geteuid() == 0 else os.getuid()}" in result.stdout


def test_no_network_not_even_the_hosts_loopback(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result, response = _run(sandbox, f"""
            import socket
            print("interfaces:", [name for _, name in socket.if_nameindex()])
            for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
                try:
                    socket.create_connection(address, timeout=1).close()
                    print("CONNECTED", address)
                except OSError as e:
                    print("refused", address, e)
            try:
                socket.getaddrinfo("pypi.org", 443)
                print("RESOLVED")
            except OSError as e:
                print("no dns", e)
        """)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came in
    assert response.outcome == OK, response.text
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert "interfaces: ['lo']" in result.stdout
    assert [line.split(" [")[0] for line in result.stdout.splitlines() if line.startswith("refused")] == [
        f"refused ('127.0.0.1', {port})", "refused ('1.1.1.1', 53)", "refused ('8.8.8.8', 443)"]


def test_killing_the_parent_or_everything_fails_and_the_caller_survives(sandbox):
    me = os.getpid()
    result, response = _run(sandbox, f"""
        import os, signal
        for target in (os.getppid(), {me}, {os.getppid()}):
            try:
                os.kill(target, signal.SIGKILL)
                print("sent", target)
            except OSError as e:
                print("cannot signal", target, e.strerror)
        try:
            os.kill(-1, signal.SIGKILL)  # every process it may signal, but itself
        except ProcessLookupError:
            print("nothing else to kill")
        print("still here")
    """)
    assert "still here" in result.stdout, response.text
    assert f"cannot signal {me} No such process" in result.stdout
    assert _run(sandbox, "print('next call works')")[1].text == "next call works\n"


def test_a_10_gib_allocation_fails_inside(sandbox):
    result, response = _run(sandbox, "data = bytearray(10 * 2**30)\nprint(len(data))")
    assert response.outcome == TOOL_ERROR and "MemoryError" in response.text
    assert result.duration_s < 2.0


def test_endless_output_is_cut_and_the_program_stopped(sandbox):
    result, response = _run(sandbox, "while True:\n    print('x' * 1000)")
    assert response.outcome == OUTPUT_TRUNCATED and result.output_truncated and not result.timed_out
    assert len(result.stdout) == LIMITS.max_output_bytes
    assert response.text.endswith(f"[output truncated: the program wrote more than {LIMITS.max_output_bytes} "
                                  "bytes and was stopped]")
    assert result.duration_s < LIMITS.wall_time_s


def test_background_processes_end_with_the_program(sandbox):
    result, response = _run(sandbox, """
        import os, subprocess, time
        subprocess.Popen(["sleep", "30"], start_new_session=True)
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        print("left children behind")
    """)
    assert response.text == "left children behind\n" and result.duration_s < 1.5, result
    assert _leftover_pids() == []


@x86_64_only
def test_a_program_cannot_take_over_the_sandboxs_init(sandbox):
    result, response = _run(sandbox, FORGE_EXIT + """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(64)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
remote = (ctypes.c_void_p * 2)(int(open("/proc/1/maps").read().split("-")[0], 16), 64)
got = libc.process_vm_readv(1, iov, 1, remote, 1, 0)
print("process_vm_readv:", "denied" if ctypes.get_errno() == 1 else f"returned {got}", flush=True)
got = libc.syscall(438, os.pidfd_open(1), 0, 0)  # pidfd_getfd(pid 1's stdin)
print("pidfd_getfd:", "denied" if got == -1 and ctypes.get_errno() == 1 else f"returned {got}", flush=True)
try:
    forge_exit(1)
except PermissionError:
    print("ptrace: denied")
    sys.exit()
null = os.open("/dev/null", os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
time.sleep(5)
""")
    assert result.stdout == "process_vm_readv: denied\npidfd_getfd: denied\nptrace: denied\n", response.text
    assert _leftover_pids() == []


def _sandbox_init_pid(others: set[int]) -> int | None:
    """The host pid of a running sandbox's pid 1 (bwrap's init) not in ``others``, if any."""
    for pid in set(_sandboxed_pids()) - others:
        try:
            nspid = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("NSpid:")][0].split()
        except (OSError, IndexError):
            continue
        if nspid[-1] == "1" and len(nspid) > 2:
            return pid
    return None


@x86_64_only
def test_the_call_ends_every_process_even_when_bwrap_is_made_to_return(sandbox):
    """Whatever happened inside (here the test takes over pid 1 from outside, as a program could
    without the seccomp filter): when the call returns, nothing of it runs or waits to be reaped."""
    calls: list = []
    program = """
        import os, time
        null = os.open("/dev/null", os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(5)
    """
    others = set(_sandboxed_pids())
    caller = threading.Thread(target=lambda: calls.append(_run(sandbox, program)[0]))
    caller.start()
    try:
        deadline = time.monotonic() + 10
        while (len(set(_sandboxed_pids()) - others) < 2 or _sandbox_init_pid(others) is None
               ) and time.monotonic() < deadline:
            time.sleep(0.02)
        init = _sandbox_init_pid(others)
        assert init is not None
        time.sleep(0.2)  # the program has closed its output, pid 1 waits for it
        pids = set(_sandboxed_pids()) - others
        namespace: dict = {}
        exec(FORGE_EXIT, namespace)
        namespace["forge_exit"](init)
    finally:
        caller.join()
    result = calls[0]
    assert result.duration_s < LIMITS.wall_time_s, result  # bwrap returned early, as forged
    # and still every process of the call has ended and been reaped (a zombie keeps its /proc entry)
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


def test_no_call_leaves_a_zombie():
    """The caller is a child subreaper here, so that a process of the call left unreaped would
    become its child: none does, whether the program exits, fails, runs too long or writes too
    much."""
    if BWRAP is None:
        pytest.skip(NO_BWRAP)
    script = textwrap.dedent("""
        import ctypes, os
        assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
        from megatron_rl.agent import PythonSandbox, SandboxLimits
        box = PythonSandbox(SandboxLimits(wall_time_s=1.0, max_output_bytes=2048))
        for code in ["print(1)", "import sys; sys.exit(3)", "import time; time.sleep(30)",
                     "while True: print(1)", "import os, time; os.fork(); time.sleep(30)"]:
            box.run(code)
        try:
            print("orphans:", os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG))
        except ChildProcessError:
            print("orphans: none")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout == "orphans: none\n", done.stdout + done.stderr


def test_memory_outside_the_address_space_is_refused():
    """memfd files and System V shared memory hold memory that RLIMIT_AS does not count: both
    are refused, so a program holds no more than its address space and the two tmpfs."""
    if BWRAP is None:
        pytest.skip(NO_BWRAP)
    box = PythonSandbox(SandboxLimits(wall_time_s=5.0, memory_mb=64, max_processes=2, scratch_mb=8))
    result, response = _run(box, """
        import ctypes, mmap, os
        held = 0
        try:
            for i in range(4):
                fd = os.memfd_create(f"held{i}")
                os.write(fd, b"x" * (8 << 20))  # kept while fd is open
                held += 8
            print("memfd: held", held, "MiB")
        except OSError as e:
            print("memfd:", e.strerror)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        for i in range(4):
            shmid = libc.shmget(0, 8 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if shmid < 0:
                print("shmget:", os.strerror(ctypes.get_errno()))
                break
            address = libc.shmat(shmid, None, 0)
            ctypes.memset(address, 1, 8 << 20)
            libc.shmdt(ctypes.c_void_p(address))  # out of the address space, still held
            held += 8
        print("held outside the address space:", held, "MiB")
    """)
    assert result.stdout == ("memfd: Operation not permitted\nshmget: Operation not permitted\n"
                             "held outside the address space: 0 MiB\n"), response.text


@needs_bwrap
def test_a_killed_parent_leaves_no_sandbox_behind():
    parent = textwrap.dedent("""
        from megatron_rl.agent import PythonSandbox, SandboxLimits, ToolCall, ToolExecutor, ToolRegistry, python_tool
        tool = python_tool(PythonSandbox(SandboxLimits(wall_time_s=60)), check=False)
        executor = ToolExecutor(ToolRegistry([tool]))
        future = executor.submit(ToolCall("python", {"code": "import time; time.sleep(60)"}))
        print("submitted", flush=True)
        future.result()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "submitted\n"
        deadline = time.monotonic() + 10
        while len(_sandboxed_pids()) < 2 and time.monotonic() < deadline:  # bwrap's init and python
            time.sleep(0.02)
        assert len(_sandboxed_pids()) >= 2
    finally:
        proc.kill()
        proc.wait()
    assert _leftover_pids(3.0) == []


def test_limits_are_validated_and_a_missing_bwrap_is_named(monkeypatch):
    with pytest.raises(ValueError, match="wall_time_s must be > 0"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="max_processes must be >= 2, got 1"):
        SandboxLimits(max_processes=1)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match="scripts/setup.sh"):
        PythonSandbox()
