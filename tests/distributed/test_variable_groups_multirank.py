"""Groups of their own sizes on two data-parallel ranks (gloo): a rollout function declaring
RolloutNeeds(variable_groups=True) (tests/e2e/more_samples_rollout.py: group_size + answer % 3
samples per prompt, fixed rewards) trains 2 steps under DP2 with the local engine, each rank
rolling out its half of the prompts -- groups, and rows, of different numbers on the two ranks
-- dealt whole to the ranks by token count (--sequence-packing) or kept where they were
sampled (--no-sequence-packing): the logged reward mean is the mean over every trajectory of
both ranks, as saved (--save-rollouts 1), and each saved group has its answer's size."""
import json
import math
import os

import pytest

pytestmark = pytest.mark.distributed

E2E = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e")


@pytest.mark.parametrize("packing", ["--sequence-packing", "--no-sequence-packing"])
def test_two_ranks_train_on_every_trajectory_of_groups_of_their_own_sizes(
        packing, char_model, arithmetic_jsonl, tmp_path, torchrun, monkeypatch):
    from megatron_rl.rollout.trajectory_log import read_rows, rollouts_path

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (E2E, os.environ.get("PYTHONPATH")) if p))
    save = str(tmp_path / "run")
    torchrun(2, ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
                 "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", "2",
                 "--num-prompts-per-step", "8", "--group-size", "2", "--max-new-tokens", "3",
                 "--lr", "1e-2", "--micro-batch-size", "2", "--prompt-template", "{prompt}=",
                 "--no-task-instruction", "--seed", "3", "--ppo-minibatches", "2", packing,
                 "--save-rollouts", "1",
                 "--rollout-function", "more_samples_rollout:by_answer"], timeout=300)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    ranks_rows = set()
    for r in rows:
        saved = read_rows(rollouts_path(save, r["step"], "train"))
        groups: dict[int, list[dict]] = {}
        for row in saved:
            groups.setdefault(row["group"], []).append(row)
        assert len(groups) == 8
        for members in groups.values():
            assert len(members) == 2 + int(members[0]["answer"]) % 3
        # group g was sampled on rank g % 2 (every dp_size-th prompt)
        ranks_rows.add(tuple(sum(len(m) for g, m in groups.items() if g % 2 == k)
                             for k in (0, 1)))
        rewards = [row["reward"] for row in saved]
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert r["reward_errors/total"] == len(rewards)
        assert r["skipped_update"] == 0.0 and r["grad_norm"] > 1e-4, r
    assert any(a != b for a, b in ranks_rows)  # the ranks sampled different numbers of rows
