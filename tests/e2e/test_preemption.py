"""Preemption and the last step: SIGTERM (what SLURM sends before a time limit) and a wall-clock
budget save the step they stop at and exit with the resumable status; a resume then continues
to the uninterrupted run's metrics; the last step is always saved."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import (RESUME_FLAGS, RESUME_ITERS, read_metrics, train_args,  # tests/e2e/conftest.py
                      train_cmd, train_env)
from megatron_rl.stopping import EXIT_RESUMABLE, STOPPED_EARLY

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses





def _checkpoints(save):
    return sorted(n for n in os.listdir(save) if n.startswith("iter_"))


def _latest(save):
    with open(os.path.join(save, "latest")) as f:
        return f.read().strip()


def _live_processes(pgid, wait_s=5.0):
    """The pids of process group `pgid` that still run (zombies left to an init that does not
    reap them are not running), after waiting up to `wait_s` for them to end."""
    deadline = time.time() + wait_s
    while True:
        live = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp
                live.append(int(pid))
        if not live or time.time() > deadline:
            return live
        time.sleep(0.1)


def test_sigterm_saves_the_step_in_flight_then_resume_matches_uninterrupted_run(
        tiny_char_model, tiny_char_ref, arithmetic_jsonl, tmp_path, uninterrupted_run):
    iters = RESUME_ITERS
    stopped_dir = str(tmp_path / "stopped")
    # no periodic saves: whatever is saved comes from the signal. SIGTERM to the whole process
    # group, as SLURM signals every process of a job step, once step 2 is logged
    args = train_args(tiny_char_model, arithmetic_jsonl, stopped_dir, iters, RESUME_FLAGS,
                      ref=tiny_char_ref)
    log = tmp_path / "stopped.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(train_cmd(*args), env=train_env(), stdout=out, stderr=out,
                                start_new_session=True)
    metrics = os.path.join(stopped_dir, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 2):
        assert proc.poll() is None, "training exited before the signal:\n" + log.read_text()
        assert time.time() < deadline, "step 2 never logged"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=300)
    assert rc == EXIT_RESUMABLE, log.read_text()[-4000:]
    stopped_at = len(read_metrics(stopped_dir))  # the step in flight was finished, logged and saved
    assert 2 <= stopped_at < iters
    assert _checkpoints(stopped_dir) == [f"iter_{stopped_at:07d}"]
    assert _latest(stopped_dir) == f"iter_{stopped_at:07d}"
    with open(os.path.join(stopped_dir, STOPPED_EARLY)) as f:
        assert json.load(f) == {"step": stopped_at, "reason": "SIGTERM"}
    assert _live_processes(proc.pid) == []  # helpers (checkpoint, rewards) are gone with it

    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    ref, resumed = uninterrupted_run, read_metrics(stopped_dir)
    assert [r["step"] for r in resumed] == list(range(1, iters + 1))  # none lost, none repeated
    assert ref[-1]["kl_k1"] != ref[0]["kl_k1"]
    for a, b in zip(ref, resumed):
        for key in ("reward/mean", "kl_k1", "pg_loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert not os.path.exists(os.path.join(stopped_dir, STOPPED_EARLY))
    assert _latest(stopped_dir) == f"iter_{iters:07d}"


def test_a_stop_under_async_level_resumes_on_the_batch_generated_ahead(
        tiny_char_model, tiny_char_ref, arithmetic_jsonl, tmp_path):
    """--async-level 1 with the process engine: step 2's batch is generated during step 1 from
    the weights one update old. A stop after step 1 (the SIGTERM path, triggered by the time
    budget at a known step) saves that batch with step 1's checkpoint, so the resumed run
    trains on it at staleness 1 and logs what the run that was not stopped logs."""
    iters = 4
    flags = RESUME_FLAGS + ["--rollout-engine", "process", "--async-level", "1"]

    def run(name, extra=()):
        save = str(tmp_path / name)
        args = train_args(tiny_char_model, arithmetic_jsonl, save, iters, [*flags, *extra],
                          ref=tiny_char_ref)
        return save, subprocess.run(train_cmd(*args), env=train_env(), capture_output=True,
                                    text=True, timeout=600)

    ref_save, p = run("uninterrupted")
    assert p.returncode == 0, p.stderr[-4000:]
    save, p = run("stopped", ["--exit-duration-in-mins", "0.00001"])
    assert p.returncode == EXIT_RESUMABLE, p.stderr[-4000:]
    assert _checkpoints(save) == ["iter_0000001"]
    _, p = run("stopped")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "generated again" not in p.stderr
    ref, resumed = read_metrics(ref_save), read_metrics(save)
    assert [r["step"] for r in resumed] == list(range(1, iters + 1))
    assert [r["rollout/staleness"] for r in resumed] == [0.0, 1.0, 1.0, 1.0]
    for a, b in zip(ref, resumed):
        for key in ("reward/mean", "kl_k1", "pg_loss", "grad_norm", "entropy",
                    "rollout/staleness", "response/length_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.parametrize("interval, iters, saved", [(0, 2, [2]), (2, 3, [2, 3])])
def test_the_last_step_is_always_saved(tiny_char_model, arithmetic_jsonl, tmp_path, interval,
                                       iters, saved):
    """--save-interval 0 (the default) and a --train-iters that is not a multiple of it both
    end with a checkpoint of the last step."""
    save = str(tmp_path / "run")
    subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, iters,
                                          ["--save-interval", str(interval)])),
                   check=True, env=train_env(), capture_output=True, timeout=600)
    assert _checkpoints(save) == [f"iter_{s:07d}" for s in saved]
    assert _latest(save) == f"iter_{iters:07d}"
    assert not os.path.exists(os.path.join(save, STOPPED_EARLY))


def test_exit_duration_saves_and_exits_resumable(tiny_char_model, arithmetic_jsonl, tmp_path):
    """A budget of 0.6 ms is spent by the first step boundary: the run saves step 1 and exits
    with the resumable status."""
    save = str(tmp_path / "run")
    p = subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, 4,
                                              ["--exit-duration-in-mins", "0.00001"])),
                       env=train_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == EXIT_RESUMABLE, p.stderr[-4000:]
    assert "stopped at step 1" in p.stderr
    assert _checkpoints(save) == ["iter_0000001"]
    assert [r["step"] for r in read_metrics(save)] == [1]
    with open(os.path.join(save, STOPPED_EARLY)) as f:
        assert json.load(f)["reason"] == "--exit-duration-in-mins 1e-05 spent"


def test_no_helper_outlives_a_killed_trainer(tiny_char_model, arithmetic_jsonl, tmp_path):
    """SIGKILL of the trainer alone (the OOM killer, a node agent) once it has saved: megatron's
    checkpoint helper (a multiprocessing Manager) and its resource tracker die with it."""
    save = str(tmp_path / "run")
    proc = subprocess.Popen(
        train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, 50,
                               ["--save-interval", "1"])),
        env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    latest = os.path.join(save, "latest")
    deadline = time.time() + 300
    try:
        while not (os.path.exists(latest) and _latest(save) >= "iter_0000002"):
            assert proc.poll() is None, "training exited before it could be killed"
            assert time.time() < deadline, "step 2 never saved"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = _live_processes(proc.pid)
    finally:
        for pid in _live_processes(proc.pid, wait_s=0):
            os.kill(pid, signal.SIGKILL)
    assert left == []


def test_sigterm_to_every_process_with_the_process_engine(tiny_char_model, arithmetic_jsonl,
                                                          tmp_path):
    """SIGTERM to the whole process group (a scheduler signals every process of a job) while
    the process engine's child generates: the step still finishes and is saved, and the child
    stops with the trainer."""
    save = str(tmp_path / "run")
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, 50,
                                   ["--rollout-engine", "process"])),
            env=train_env(), stdout=out, stderr=out, start_new_session=True)
    metrics = os.path.join(save, "metrics.jsonl")
    deadline = time.time() + 300
    try:
        while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 1):
            assert proc.poll() is None, "training exited before the signal:\n" + log.read_text()
            assert time.time() < deadline, "step 1 never logged"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=300)
        left = _live_processes(proc.pid)
    finally:
        for pid in _live_processes(proc.pid, wait_s=0):
            os.kill(pid, signal.SIGKILL)
    assert rc == EXIT_RESUMABLE, log.read_text()[-4000:]
    step = len(read_metrics(save))
    assert 1 <= step < 50 and _checkpoints(save) == [f"iter_{step:07d}"]
    assert left == []


def test_no_exit_signal_handler_leaves_sigterm_its_default(tiny_char_model, arithmetic_jsonl,
                                                           tmp_path):
    """--no-exit-signal-handler: SIGTERM ends the trainer at once, with no save."""
    save = str(tmp_path / "run")
    proc = subprocess.Popen(
        train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, 50,
                               ["--no-exit-signal-handler"])),
        env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = os.path.join(save, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 1):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == -signal.SIGTERM
    assert _checkpoints(save) == [] and not os.path.exists(os.path.join(save, STOPPED_EARLY))
