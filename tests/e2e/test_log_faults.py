"""A log that cannot be written mid-run never takes training down: the run goes on, reports the
failure once naming the log, and ends with its checkpoint; the next start refuses a
metrics.jsonl it cannot use, naming it, before any model is built, and resumes once it is
repaired."""
import json
import os
import subprocess

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses


def _tensorboard_steps(save):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(save, "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")]


def test_logs_made_unwritable_mid_run_leave_the_run_finishing_and_saving(
        tiny_char_model, arithmetic_jsonl, tmp_path):
    save = str(tmp_path / "run")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(train_env(), LOG_FAULT_STEP="2", PYTHONPATH=os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p))

    def start(iters):
        args = train_args(tiny_char_model, arithmetic_jsonl, save, iters,
                          ["--rollout-function", "log_fault_rollout:breaking_logs",
                           "--rollout-function-args", json.dumps({"save": save})])
        return subprocess.run(train_cmd(*args), env=env, capture_output=True, text=True,
                              timeout=600)

    # the default --save-interval 0: every step is unsaved until the last one
    p = start(5)
    assert p.returncode == 0, p.stderr[-4000:]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000005"
    metrics = os.path.join(save, "metrics.jsonl")
    assert p.stderr.count(f"{metrics}: writing the metrics failed (IsADirectoryError") == 1
    tensorboard = os.path.join(save, "tensorboard")
    assert p.stderr.count(f"{tensorboard}: writing the metrics failed (FileNotFoundError") == 1
    assert "metrics.jsonl: steps 3-5 of this run were not written" in p.stderr
    with open(metrics + ".moved") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert _tensorboard_steps(save) == [3, 4, 5]  # its directory made again, no step lost

    # the next start refuses the directory in metrics.jsonl's place, naming it, before any
    # model is built (a start that builds one records itself in config_history.jsonl)
    p = start(6)
    assert p.returncode != 0
    assert f"{metrics} cannot be read and appended to (IsADirectoryError" in p.stderr
    with open(os.path.join(save, "config_history.jsonl")) as f:
        assert len(f.readlines()) == 1

    # repaired: the run resumes from step 5 and logs step 6 after the rows it kept
    os.rmdir(metrics)
    os.rename(metrics + ".moved", metrics)
    p = start(6)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [r["step"] for r in read_metrics(save)] == [1, 2, 6]
    assert "writing the metrics failed" not in p.stderr
