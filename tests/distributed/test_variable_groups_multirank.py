"""Groups of their own sizes on two data-parallel ranks (gloo): a rollout function declaring
RolloutNeeds(variable_groups=True) (tests/e2e/more_samples_rollout.py) trains 2 steps under
DP2 with the local engine, each rank rolling out its half of the prompts and the groups dealt
whole to the ranks by token count (--sequence-packing): the logged reward mean is the mean over
every trajectory of both ranks."""
import json
import math
import os

import pytest

pytestmark = pytest.mark.distributed

E2E = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e")


def test_two_ranks_train_on_every_trajectory_of_groups_of_their_own_sizes(
        char_model, arithmetic_jsonl, tmp_path, torchrun, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (E2E, os.environ.get("PYTHONPATH")) if p))
    save = str(tmp_path / "run")
    torchrun(2, ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
                 "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", "2",
                 "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "3",
                 "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
                 "--no-task-instruction", "--seed", "3", "--ppo-minibatches", "2",
                 "--rollout-function", "more_samples_rollout:more_samples"], timeout=300)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # each rank's call rolls out its 2 prompts: groups of 2 and 3, rewards [1, 0], [1, 0, 1]
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0] * 2
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert r["reward_errors/total"] == len(rewards)
        assert r["skipped_update"] == 0.0 and r["grad_norm"] > 1e-4, r
