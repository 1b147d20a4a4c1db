"""The lock on --save (run_lock.RunLock): a second run into one directory is refused naming the
first; the lock is released however the run ends; one left by a killed run is taken over with a
warning (at once on the same machine, after STALE_AFTER_S from another); only global rank 0
takes it."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_rl import run_lock
from megatron_rl.run_lock import LOCK, RunDirectoryInUse, RunLock

HOLD = ("import sys, time; from megatron_rl.run_lock import RunLock\n"
        "lock = RunLock(sys.argv[1], take=True); lock.acquire(); print('held', flush=True)\n"
        "time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of tmp_path/run: (save, process)."""
    save = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", HOLD, save], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield save, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_live_runs_lock_refuses_a_second_start_naming_it(holder):
    save, proc = holder
    with pytest.raises(RunDirectoryInUse) as e:
        RunLock(save, take=True).acquire()
    message = str(e.value)
    assert f"pid {proc.pid}" in message and socket.gethostname() in message
    assert os.path.join(save, LOCK) in message and "--save" in message
    assert sorted(os.listdir(save)) == [LOCK]  # the holder's lock, untouched


def test_a_killed_runs_lock_is_taken_over_with_a_warning(holder):
    save, proc = holder
    proc.kill()
    proc.wait()
    with pytest.warns(UserWarning, match=rf"taking over the lock of .*pid {proc.pid}.*no longer"):
        with RunLock(save, take=True) as lock:
            with open(os.path.join(save, LOCK)) as f:
                assert json.load(f)["pid"] == os.getpid() == (lock.owner or {}).get("pid")
    assert os.listdir(save) == []


def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path):
    """The lock of a dead process whose pid now belongs to another (a container restarted with
    the same pids): its start time tells them apart."""
    save = str(tmp_path / "run")
    with RunLock(save, take=True) as lock:
        assert lock.owner is not None
        record = dict(lock.owner, start_ticks=lock.owner["start_ticks"] - 1, token="old")
    with open(os.path.join(save, LOCK), "w") as f:
        json.dump(record, f)
    with pytest.warns(UserWarning, match="no longer running"):
        RunLock(save, take=True).acquire()


def test_the_lock_is_released_when_the_run_raises(tmp_path):
    save = str(tmp_path / "run")
    for error in (RuntimeError("a crash"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with RunLock(save, take=True):
                assert os.path.exists(os.path.join(save, LOCK))
                raise error
        assert not os.path.exists(os.path.join(save, LOCK))


def _foreign_lock(save: str, age_s: float) -> None:
    """The lock of a run on another host, its heartbeat `age_s` seconds old."""
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, LOCK)
    with open(path, "w") as f:
        json.dump({"host": "node-7", "pid": 4242, "boot_id": "x", "pid_namespace": "y",
                   "token": "t", "started": "then"}, f)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_another_hosts_lock_is_refused_while_its_heartbeat_is_fresh(tmp_path):
    save = str(tmp_path / "run")
    _foreign_lock(save, age_s=10)
    with pytest.raises(RunDirectoryInUse, match=r"host node-7, pid 4242.*heartbeat"):
        RunLock(save, take=True).acquire()
    _foreign_lock(save, age_s=run_lock.STALE_AFTER_S + 30)
    with pytest.warns(UserWarning, match=r"taking over the lock of the run of host node-7"):
        with RunLock(save, take=True):
            pass


def test_the_owner_keeps_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    save = str(tmp_path / "run")
    with RunLock(save, take=True):
        path = os.path.join(save, LOCK)
        os.utime(path, (time.time() - 1000, time.time() - 1000))
        time.sleep(0.3)
        assert time.time() - os.path.getmtime(path) < 5


def test_only_global_rank_0_takes_the_lock(tmp_path, monkeypatch):
    save = str(tmp_path / "run")
    _foreign_lock(save, age_s=0)
    monkeypatch.setenv("RANK", "1")
    with RunLock(save):  # rank 1 neither takes nor checks it: rank 0 does
        pass
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunDirectoryInUse):
        RunLock(save).acquire()
