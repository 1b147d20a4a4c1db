"""--save-rollouts on a short training run: the trajectories of every Nth step's batch and of
every evaluation land in <save>/rollouts under the step they belong to, each row the trajectory
the trainer trained on (its lengths are the step's response metrics), with its prompt record;
`megatron-rl rollouts` reads them from the run directory. The rollout function is
tests/e2e/two_turn_rollout.py: two policy turns around 3 environment tokens, rewards 1 and 0 in
each group, so the policy and environment token metrics are known."""
import os
import re
import subprocess
import sys

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses


@pytest.mark.parametrize("engine", [
    # the in-process engine: the rollout runs on every rank, each data-parallel rank its share
    [],
    # the client rank rolls out the whole batch in a background thread, a step ahead: the
    # batch trained at step 2 is generated during step 1 and written under step 2
    ["--rollout-engine", "process", "--async-level", "1"],
], ids=["local", "process-async"])
def test_every_nth_step_and_every_evaluation_are_written(engine, tiny_char_model,
                                                         arithmetic_jsonl, tmp_path):
    save = str(tmp_path / "run")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 3,
                      ["--rollout-function", "two_turn_rollout:two_turns", "--save-rollouts",
                       "2", "--eval-data", arithmetic_jsonl, "--eval-interval", "1",
                       "--eval-max-prompts", "4", "--eval-samples", "2", *engine])
    path = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = dict(train_env(), PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(train_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from megatron_rl.rollout.trajectory_log import read_rows, rollouts_path

    assert sorted(os.listdir(os.path.join(save, "rollouts"))) == [
        "eval_step_000001.jsonl", "eval_step_000002.jsonl", "eval_step_000003.jsonl",
        "step_000002.jsonl"]
    metrics = read_metrics(save)
    for m in metrics:  # each trajectory: the environment's 3 tokens between two policy turns
        assert m["response/env_tokens_mean"] == 3.0
        assert m["response/policy_tokens_mean"] == m["response/length_mean"] - 3.0
    rows = read_rows(rollouts_path(save, 2, "train"))
    # 4 prompts x 2 samples, in the batch's order, each the trajectory trained on at step 2
    assert [(r["step"], r["kind"], r["group"], r["index"]) for r in rows] == [
        (2, "train", g, j) for g in range(4) for j in range(2)]
    policy = sum(r["policy_tokens"] for r in rows) / len(rows)
    assert policy == metrics[1]["response/policy_tokens_mean"]
    for r in rows:
        _check_row(r)
    evaluated = read_rows(rollouts_path(save, 3, "eval"))
    assert [(r["step"], r["kind"], r["group"], r["index"]) for r in evaluated] == [
        (3, "eval", g, j) for g in range(4) for j in range(2)]
    stem = os.path.splitext(os.path.basename(arithmetic_jsonl))[0]  # the eval data's first rows
    assert [r["uid"] for r in evaluated[::2]] == [f"{stem}:{i}" for i in range(4)]
    for r in evaluated:
        _check_row(r)
    listed = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "rollouts", save, "--list"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    assert listed.splitlines()[0].endswith("step_000002.jsonl: 8 trajectories")
    shown = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "rollouts", save, "--eval",
                            "--step", "1", "--index", "1"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert shown.startswith("step 1 (eval)  group 0 sample 1")
    assert "reward 0 (no_answer)" in shown and "=== 2. environment (3 tokens) ===" in shown


def _check_row(r: dict) -> None:
    """A row of two_turns: its record's answer is its prompt's sum, its segments the two
    policy turns around the environment's ids, its reward the function's."""
    a, b = map(int, re.fullmatch(r"Calculate (\d)\+(\d)\.=", r["prompt"]).groups())
    assert r["answer"] == str(a + b) and r["task"] == "arithmetic"
    assert [s["source"] for s in r["segments"]] == ["policy", "environment", "policy"]
    assert r["segments"][1]["ids"] == [5, 6, 7] and r["environment_tokens"] == 3
    assert all(len(s["logprobs"]) == len(s["ids"]) and all(lp <= 0 for lp in s["logprobs"])
               for s in r["segments"][::2])
    assert (r["reward"], r["reward_error"]) == ((1.0, None) if r["index"] == 0
                                                else (0.0, "no_answer"))
    assert r["counts"] == {"two_turn/turns": 2.0, "two_turn/odd": float(r["index"])}
