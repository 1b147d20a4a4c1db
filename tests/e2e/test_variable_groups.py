"""A rollout function that returns more than --group-size trajectories per prompt, groups of
their own sizes (tests/e2e/more_samples_rollout.py: group_size + (i % 3) single-turn samples
for prompt i, fixed rewards), trained end to end on the tiny model with the in-process engine and the process engine:
the run trains on every trajectory of every group (the logged reward mean is the mean over all
of them, not over group_size per prompt), the saved rollouts keep each group whole and the
evaluation's mean@k takes each group's own samples."""
import os
import subprocess

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("engine", [
    [],  # the in-process engine: the function runs on the rank, the batch is its groups
    # the process engine, one batch ahead: the function runs on a background thread
    ["--rollout-engine", "process", "--async-level", "1", "--rollout-correction", "tis",
     "--old-logprobs", "recompute"],
], ids=["local", "process"])
def test_a_rollout_function_with_groups_of_their_own_sizes_trains_on_all_of_them(
        engine, tiny_char_model, arithmetic_jsonl, tmp_path):
    from megatron_rl.rollout.trajectory_log import read_rows, rollouts_path
    from more_samples_rollout import sizes

    save = str(tmp_path / "run")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 2,
                      ["--rollout-function", "more_samples_rollout:more_samples",
                       "--advantage-estimator", "rloo", "--ppo-minibatches", "2",
                       "--save-rollouts", "1", "--eval-data", arithmetic_jsonl,
                       "--eval-interval", "2", "--eval-max-prompts", "4", "--eval-samples", "2",
                       *engine])
    env = dict(train_env(), PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(train_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    groups = sizes(2, 4)  # 4 prompts, --group-size 2: [2, 3, 4, 2]
    rewards = [float(j % 2 == 0) for n in groups for j in range(n)]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert r["reward_errors/total"] == len(rewards)
        assert r["reward_errors/no_answer"] == rewards.count(0.0)
        assert r["grad_norm"] > 1e-4 and r["skipped_update"] == 0
    # evaluated with the same function: mean@k is the mean of each group's own accuracy
    accuracy = [sum(float(j % 2 == 0) for j in range(n)) / n for n in groups]
    assert rows[1]["eval/mean_at_k"] == pytest.approx(sum(accuracy) / 4, abs=1e-6)
    assert rows[1]["eval/pass_at_k"] == 1.0
    for step in (1, 2):
        saved = read_rows(rollouts_path(save, step, "train"))
        by_group: dict[int, list[int]] = {}
        for row in saved:
            by_group.setdefault(row["group"], []).append(row["index"])
        assert [sorted(v) for _, v in sorted(by_group.items())] == [
            list(range(n)) for n in groups]
