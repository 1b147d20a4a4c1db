"""`--rollout-engine process` on one GPU: the child process builds its own copy of the policy on
the same device, the trainer's weights reach it through shared memory after every step, and
under --async-level 1 it generates the next batch while the trainer trains.

- fp32, synchronous, with the trainer's recompute forward: the child's log-probs equal the
  trainer's after every optimizer step (the weights arrived), and the run logs the local
  engine's samples (the same decoder and seed, in another process);
- --async-level 1: batches after the first come from weights one update old, all finite.
"""
import json
import os
import subprocess
import sys

import pytest

from gpu_helpers import arithmetic_jsonl, char_model, train_args

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KL = ["--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_process")
    return {"model": char_model(str(root / "model"), seed=0),
            "ref": char_model(str(root / "ref"), seed=1),
            "data": arithmetic_jsonl(str(root / "train.jsonl"))}


def _train(inputs, save, extra) -> list[dict]:
    args = train_args(inputs["model"], inputs["data"], save, 3, KL + extra, ref=inputs["ref"])
    env = dict(os.environ, OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_process_engine_serves_the_trainers_weights_on_gpu(inputs, tmp_path):
    local = _train(inputs, str(tmp_path / "local"), ["--rollout-engine", "local"])
    proc = _train(inputs, str(tmp_path / "process"),
                  ["--rollout-engine", "process", "--old-logprobs", "recompute"])
    assert [r["rollout/generate_calls"] for r in proc] == [1.0, 2.0, 3.0]
    assert all(r["grad_norm"] > 1e-4 for r in proc)
    for r in proc:
        assert r["mismatch/abs_delta_max"] < 1e-3, (r["step"], r["mismatch/abs_delta_max"])
    assert [r["response/length_mean"] for r in proc] == [r["response/length_mean"]
                                                         for r in local]


def test_async_process_engine_on_gpu(inputs, tmp_path):
    rows = _train(inputs, str(tmp_path / "async"),
                  ["--rollout-engine", "process", "--async-level", "1"])
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        assert all(v == v and abs(v) != float("inf") for v in r.values()), r
