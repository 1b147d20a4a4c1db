"""--rollout-engine process: the local decoder in a child process with its own weights.

- Synchronous, it is the local engine moved out of the trainer: 3 RL steps log the local
  engine's samples and losses, with one generate request per step. After every optimizer step
  the child serves the trainer's new weights, in both sync modes (shared-memory buckets and an
  HF directory): the trainer's recomputed log-probs equal the child's to float rounding.
- Under --async-level 1 it generates the next batch while the trainer trains: batches after the
  first come from weights one update old; a checkpoint keeps the batch generated ahead, which a
  resume trains on, or generates again (with a warning) under settings that deal it otherwise.
- A child that dies or fails a request is reported by name, exit code and request."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from conftest import train_args  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses

KL = ["--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0"]


def _run(model, ref, data, save, iters, extra):
    return _run_logged(model, ref, data, save, iters, extra)[0]


def _run_logged(model, ref, data, save, iters, extra):
    """(the metrics.jsonl rows, stderr) of a run that must succeed."""
    args = train_args(model, data, save, iters, KL + extra, ref=ref)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], proc.stderr


def test_process_engine_is_the_local_engine_out_of_process(tiny_char_model, tiny_char_ref,
                                                            arithmetic_jsonl, tmp_path):
    run = lambda name, extra: _run(tiny_char_model, tiny_char_ref, arithmetic_jsonl,  # noqa: E731
                                   str(tmp_path / name), 3, extra)
    local = run("local", ["--rollout-engine", "local"])
    proc = run("process", ["--rollout-engine", "process"])
    assert local[-1]["kl_k1"] != local[0]["kl_k1"]  # the weights moved
    for a, b in zip(local, proc):
        for key in ("reward/mean", "response/length_mean", "response/truncated_fraction"):
            assert b[key] == a[key], (a["step"], key)
        for key in ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert [r["rollout/generate_calls"] for r in proc] == [1.0, 2.0, 3.0]  # once per step
    assert all(r["rollout/weight_sync_mb"] > 0 for r in proc[1:])


@pytest.mark.parametrize("sync", [  # disk sync into a server: test_vllm_engine.py
    "tensor", pytest.param("disk", marks=pytest.mark.extended)])
def test_child_serves_the_trainers_weights_after_every_step(sync, tiny_char_model, tiny_char_ref,
                                                            arithmetic_jsonl, tmp_path):
    rows = _run(tiny_char_model, tiny_char_ref, arithmetic_jsonl, str(tmp_path / sync), 3,
                ["--rollout-engine", "process", "--weight-sync", sync,
                 "--old-logprobs", "recompute"])
    assert all(r["grad_norm"] > 1e-4 for r in rows)
    for r in rows:  # the child's log-probs vs the trainer's forward of the same tokens
        assert r["mismatch/abs_delta_max"] < 1e-4, (r["step"], r["mismatch/abs_delta_max"])


def test_async_process_engine_overlaps_and_resumes(tiny_char_model, tiny_char_ref,
                                                   arithmetic_jsonl, tmp_path):
    save = str(tmp_path / "async")
    extra = ["--rollout-engine", "process", "--async-level", "1", "--save-interval", "2"]
    rows = _run(tiny_char_model, tiny_char_ref, arithmetic_jsonl, save, 3, extra)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("mismatch/abs_delta_max" not in r for r in rows)  # the child's log-probs
    assert abs(rows[0]["ratio_mean"] - 1.0) < 1e-5
    assert abs(rows[2]["ratio_mean"] - 1.0) > 1e-3  # trained on one-update-old samples
    # as if killed after step 2's save: step 3's batch, generated ahead, was saved with it
    shutil.copytree(save, str(tmp_path / "copy"))

    def resume_from_step_2(save, extra):
        shutil.rmtree(os.path.join(save, "iter_0000003"))
        with open(os.path.join(save, "latest"), "w") as f:
            f.write("iter_0000002\n")
        return _run_logged(tiny_char_model, tiny_char_ref, arithmetic_jsonl, save, 4, extra)

    resumed, err = resume_from_step_2(save, extra)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2] == {**rows[2], **{k: v for k, v in resumed[2].items()
                                        if k.startswith(("time/", "throughput/", "rollout/"))
                                        and k != "rollout/staleness"}}
    assert [r["rollout/staleness"] for r in resumed] == [0.0, 1.0, 1.0, 1.0]
    assert "generated again" not in err
    # a resume that deals batches otherwise generates it again, from the resumed weights
    resumed, err = resume_from_step_2(str(tmp_path / "copy"), extra + ["--micro-batch-size", "4"])
    assert ("the batches generated ahead (--async-level) for steps 3 and saved with the "
            "checkpoint of step 2 are generated again") in err
    assert "--micro-batch-size: 8 -> 4" in err
    assert [r["rollout/staleness"] for r in resumed] == [0.0, 1.0, 0.0, 1.0]


def test_failed_request_and_dead_child_are_reported(tiny_char_model, tmp_path):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.process import ProcessConfig, ProcessEngine
    from megatron_rl.rollout.base import ServerError

    engine = ProcessEngine(ProcessConfig(hf_checkpoint=tiny_char_model,
                                         work_dir=str(tmp_path / "w")))
    try:
        params = SamplingParams(max_new_tokens=4, seed=1)
        with pytest.raises(ServerError, match=r"pid \d+, alive\) failed on 'generate 1 prompts "
                                              r"x 2': ValueError: prompt \(100000\) \+ "
                                              r"max_new_tokens \(4\) exceeds"):
            engine.generate([[5] * 100000], 2, params)
        out = engine.generate([[5, 6, 7]], 2, params)  # the child lives on
        assert len(out) == 1 and len(out[0]) == 2 and all(c.token_ids for c in out[0])
        # killed in the middle of a long request: named, with the exit code
        threading.Timer(1.0, os.kill, (engine._proc.pid, signal.SIGKILL)).start()
        long = SamplingParams(max_new_tokens=200, seed=1)
        with pytest.raises(ServerError, match=r"died during 'generate 64 prompts x 8'.*"
                                              r"exit code -9"):
            for _ in range(20):  # until the kill lands
                engine.generate([[5, 6, 7]] * 64, 8, long)
        assert not engine.health()
        with pytest.raises(ServerError, match=r"not running \(pid \d+, exit code -9\).*generate"):
            engine.generate([[5, 6, 7]], 2, params)
    finally:
        engine.shutdown()


def test_child_is_a_world_of_its_own_under_torchrun(tiny_char_model, tmp_path, monkeypatch):
    """Started from a torchrun worker (its variables in the environment), the child forms its
    own world of one: with them it would join the trainer's world or wait for torchrun's store
    (TORCHELASTIC_USE_AGENT_STORE) and never start."""
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "TORCHELASTIC_RUN_ID": "none",
                 "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(k, v)
    engine = ProcessEngine(ProcessConfig(hf_checkpoint=tiny_char_model, startup_timeout=120,
                                         work_dir=str(tmp_path / "w")))
    try:
        out = engine.generate([[5, 6, 7]], 2, SamplingParams(max_new_tokens=4, seed=1))
        assert len(out) == 1 and len(out[0]) == 2 and all(c.token_ids for c in out[0])
    finally:
        engine.shutdown()
