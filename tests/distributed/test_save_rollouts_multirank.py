"""--save-rollouts on two data-parallel ranks of the in-process engine (gloo): each replica rolls
out its share of the prompts (every other one), and global rank 0 writes one file of the whole
batch in the batch's order, for the training step and for the evaluation."""
import json
import os
import re

import pytest

pytestmark = pytest.mark.distributed


def test_dp2_shares_are_written_as_one_file_in_order(char_model, arithmetic_jsonl, tmp_path,
                                                     torchrun):
    from megatron_rl.rollout.trajectory_log import read_rows, rollouts_path

    save = str(tmp_path / "run")
    torchrun(2, ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
                 "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", "2",
                 "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "3",
                 "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
                 "--no-task-instruction", "--seed", "3", "--save-rollouts", "2",
                 "--eval-data", arithmetic_jsonl, "--eval-interval", "2",
                 "--eval-max-prompts", "6", "--eval-samples", "2"], timeout=300)
    assert sorted(os.listdir(os.path.join(save, "rollouts"))) == [
        "eval_step_000002.jsonl", "step_000002.jsonl"]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    rows = read_rows(rollouts_path(save, 2, "train"))
    assert [(r["group"], r["index"]) for r in rows] == [(g, j) for g in range(4) for j in range(2)]
    # the whole batch of both ranks: its lengths are the step's (all-reduced) metrics
    assert (sum(r["policy_tokens"] for r in rows) / len(rows)
            == metrics[1]["response/policy_tokens_mean"])
    assert sum(r["reward"] for r in rows) / len(rows) == metrics[1]["reward/mean"]
    evaluated = read_rows(rollouts_path(save, 2, "eval"))
    # the eval set's first 6 rows in file order, rank 0 having rolled out 0, 2, 4 and rank 1
    # 1, 3, 5
    assert [r["uid"] for r in evaluated] == [f"train:{i}" for i in range(6) for _ in range(2)]
    assert [r["index"] for r in evaluated] == [0, 1] * 6
    for r in rows + evaluated:
        a, b = map(int, re.fullmatch(r"Calculate (\d)\+(\d)\.=", r["prompt"]).groups())
        assert r["answer"] == str(a + b)
        assert [s["source"] for s in r["segments"]] == ["policy"]
