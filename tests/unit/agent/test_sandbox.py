"""The Python interpreter tool's bubblewrap sandbox: code runs and reports stdout/stderr, and
hostile programs (fork bomb, busy loop, writes outside the scratch dir, reading host files and
environment, network, killing the parent, a 10 GiB allocation, endless output) each end in an
error or timeout response, change nothing outside, and leave no process behind.

Skipped only where bwrap is not installed (scripts/setup.sh installs it as root)."""
import ast
import os
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
