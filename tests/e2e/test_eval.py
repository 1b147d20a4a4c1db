"""`megatron-rl eval` end to end on the tiny model: the process engine (the local decoder in a
child process, built by the engine builder as training builds it) samples what the local
engine samples at the same seeds, so the tables and the trajectories agree; the child is
stopped when the evaluation ends, and when it fails. ctx.step is training's convention in
both evaluations: the evaluation after step s's update has s, as that step's batch, and
`megatron-rl eval` of a checkpoint has its periodic evaluation's."""
import json
import os
import subprocess
import sys

import psutil
import pytest

from conftest import train_args, train_cmd, train_env  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1)

HERE = os.path.dirname(os.path.abspath(__file__))


def _eval_args(model, data, out, *extra):
    return ["--hf-checkpoint", model, "--eval-data", data, "--samples", "3", "--seeds", "0", "1",
            "--max-new-tokens", "3", "--max-prompts", "8", "--prompt-template", "{prompt}=",
            "--no-task-instruction", "--out", str(out), *extra]


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_process_engine_evaluates_as_the_local_engine_and_is_stopped(
        tiny_char_model, arithmetic_jsonl, tmp_path, capsys):
    from multiprocessing import resource_tracker

    from megatron_rl.evaluation import main
    from megatron_rl.rollout.trajectory_log import main as rollouts

    resource_tracker.ensure_running()  # multiprocessing's helper of this process's lifetime
    children = lambda: [p for p in psutil.Process().children(recursive=True)  # noqa: E731
                        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    before = {p.pid for p in children()}
    results = {}
    for engine in ("local", "process"):
        main(_eval_args(tiny_char_model, arithmetic_jsonl, tmp_path / f"{engine}.json",
                        "--rollout-engine", engine, "--save-rollouts", str(tmp_path / engine)))
        results[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
        assert "| arithmetic | 8 |" in capsys.readouterr().out
        assert {p.pid for p in children()} <= before  # the child (and the scorer's) stopped
    local, proc = results["local"], results["process"]
    assert proc["per_seed"] == local["per_seed"] and proc["mean"] == local["mean"]
    for seed in (0, 1):  # the same samples, token for token
        a, b = (_rows(tmp_path / e / f"eval_seed_{seed}.jsonl") for e in ("local", "process"))
        assert len(a) == 8 * 3
        assert [(r["uid"], r["prompt_ids"], r["reward"]) for r in b] == [
            (r["uid"], r["prompt_ids"], r["reward"]) for r in a]
        assert [[s["ids"] for s in r["segments"]] for r in b] == [
            [s["ids"] for s in r["segments"]] for r in a]
        logprobs = lambda rows: [x for r in rows for s in r["segments"]  # noqa: E731
                                 for x in s["logprobs"]]
        assert logprobs(b) == pytest.approx(logprobs(a), abs=1e-5)
    assert _rows(tmp_path / "local" / "eval_seed_0.jsonl") != _rows(
        tmp_path / "local" / "eval_seed_1.jsonl")  # each seed samples its own
    rollouts([str(tmp_path / "local" / "eval_seed_0.jsonl"), "--list"])  # `megatron-rl rollouts`
    assert "eval_seed_0.jsonl: 24 trajectories" in capsys.readouterr().out

    # an evaluation that fails stops the child too
    with pytest.raises(RuntimeError, match="this rollout function fails"):
        main(_eval_args(tiny_char_model, arithmetic_jsonl, tmp_path / "failed.json",
                        "--rollout-engine", "process", "--rollout-function",
                        "eval_rollouts:failing", "--work-dir", str(tmp_path / "work")))
    assert {p.pid for p in children()} <= before
    assert not (tmp_path / "failed.json").exists()


def test_ctx_step_counts_from_0_in_training_and_both_evaluations(
        tiny_char_model, arithmetic_jsonl, tmp_path):
    record = tmp_path / "steps.jsonl"
    env = dict(train_env(), RECORD_STEPS=str(record), PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    save = str(tmp_path / "run")
    proc = subprocess.run(train_cmd(*train_args(
        tiny_char_model, arithmetic_jsonl, save, 2,
        ["--eval-data", arithmetic_jsonl, "--eval-interval", "1", "--eval-max-prompts", "4",
         "--eval-samples", "2", "--rollout-function", "eval_rollouts:recording"])),
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (evaluation, ctx.step): step 0's batch, the evaluation after step 0, step 1's, ...
    assert _rows(record) == [[False, 0], [True, 0], [False, 1], [True, 1]]
    record.unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "eval",
         *_eval_args(tiny_char_model, arithmetic_jsonl, tmp_path / "eval.json", "--load", save,
                     "--rollout-function", "eval_rollouts:recording")],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(map(tuple, _rows(record))) == {(True, 1)}  # the checkpoint of step 2


def test_an_eval_user_error_exits_2_naming_the_flag(tiny_char_model, arithmetic_jsonl):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.evaluation", "--hf-checkpoint", tiny_char_model,
         "--eval-data", arithmetic_jsonl, "--rollout-function", "agent"],
        env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "megatron-rl eval: error: --agent-max-tokens 4096: an episode longer than the model's "
        "max_position_embeddings (256) cannot be generated; lower it to at most 256")
