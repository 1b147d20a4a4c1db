"""A user's plug-ins trained end to end on the tiny model, as docs/agent.md ("A first run on the
tiny CPU model") shows: an environment of their own with settings and a reward per policy turn,
and a tool of their own by import path with its settings beside the built-in tools. Each run
saves its trajectories (--save-rollouts 1), and the saved rows are checked against what made
them: the environment's and the tool's own answers, recomputed here from the saved policy
turns; the model's log-probs of the sampled tokens under the weights that sampled them,
recomputed with transformers; the rewards against the metrics the trainer logged.

The environment run samples from a random tiny model (tests/e2e/conftest.py): its turns are
noise, so its guesses are the numbers that noise holds, which is all the environment needs.
A random model never writes a tool call, so the tool run samples from make_tool_caller_model's
model, whose weights are set to write `<tool_call>{"name": "lookup", "arguments": {}}
</tool_call>` at every turn: the trainer, the engine, the agent loop, the tool's import and
settings and the rows are the real ones; only the policy is made to call. Its call takes no
arguments, so the tool answers with the value of its `default` setting."""
import json
import os
import subprocess

import pytest
import torch

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
ENV_ARGS = {"lo": 0, "hi": 150, "hint_style": "distance", "shaping": 0.25, "max_guesses": 3}
TOOL = "lookup_tool:make_lookup"
TOOL_ARGS = {TOOL: {"table": {"pi": "3.14159", "e": "2.71828"}, "default": "pi"}}


def _run(args):
    env = dict(train_env(), PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(train_cmd(*args), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _rows(save, step, kind="train"):
    from megatron_rl.rollout.trajectory_log import read_rows, rollouts_path

    return read_rows(rollouts_path(save, step, kind))


def _check_turn_rewards(rows):
    for r in rows:
        policy = [s for s in r["segments"] if s["source"] == "policy"]
        assert len(r["turn_rewards"]) == len(policy), r
        assert sum(r["turn_rewards"]) == pytest.approx(r["reward"], abs=1e-6), r


def _check_environment(rows, records):
    """Each row's environment segments are exactly what a GuessNumber made with ENV_ARGS
    answers to the row's policy segments, and its turn rewards are that GuessNumber's."""
    from guess_env import GuessNumber

    for r in rows:
        segments = r["segments"]
        assert [s["source"] for s in segments] == \
            ["policy", "environment"] * (len(segments) // 2) + ["policy"], r
        record = records[int(r["uid"].rsplit(":", 1)[1])]  # uid: "<data set>:<row>"
        assert record.answer == r["answer"]
        env = GuessNumber(**ENV_ARGS)
        assert env.reset(record) is None  # the prompt is the record's
        results = [env.step(s["text"]) for s in segments[::2]]
        assert [res.done for res in results] == [False] * (len(results) - 1) + [True], r
        for res, seg in zip(results, segments[1::2]):
            assert seg["text"] == f"\n{res.observation}\n"  # no chat template: "\n...\n"
        assert r["turn_rewards"] == [res.reward for res in results]
        end = results[-1].end
        assert r["end"] == ("length" if end == "answer" and r["finish_reason"] == "length"
                            else end)


def _check_logprobs(rows, hf_dir):
    """The engine's log-prob of every policy token equals its log-prob under the checkpoint's
    weights (transformers, fp32) given everything before it, environment tokens included."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for r in rows:
        ids = list(r["prompt_ids"])
        positions, expected = [], []
        for s in r["segments"]:
            if s["source"] == "policy":
                positions += range(len(ids), len(ids) + len(s["ids"]))
                expected += s["logprobs"]
            ids += s["ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        pos = torch.tensor(positions)
        got = logprobs[pos - 1, torch.tensor(ids)[pos]]
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-4, rtol=0)


def test_a_user_environment_with_settings_and_turn_rewards(tiny_char_model, tmp_path):
    from megatron_rl.data.prompts import PromptRecord

    data = tmp_path / "guess.jsonl"
    secrets = [(7 * i + 3) % 151 for i in range(16)]
    with open(data, "w") as f:
        for i, s in enumerate(secrets):
            f.write(json.dumps({"prompt": f"Guess {i}", "answer": str(s), "task": "guess",
                                "metadata": {"secret": s}}) + "\n")
    records = [PromptRecord(f"guess:{i}", f"Guess {i}=", "guess", str(s), {"secret": s})
               for i, s in enumerate(secrets)]
    save = str(tmp_path / "run")
    _run(train_args(tiny_char_model, str(data), save, STEPS, [
        "--rollout-function", "agent", "--agent-environment", "guess_env:GuessNumber",
        "--agent-env-args", json.dumps(ENV_ARGS), "--agent-max-turns", "4",
        "--agent-max-tokens", "128", "--max-new-tokens", "4", "--save-rollouts", "1",
        "--eval-data", str(data), "--eval-interval", str(STEPS), "--eval-samples", "2"]))

    metrics = read_metrics(save)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    every = []
    for m in metrics:
        rows = _rows(save, m["step"])
        assert len(rows) == 8  # 4 prompts x 2 samples
        _check_turn_rewards(rows)
        _check_environment(rows, records)
        rewards = [r["reward"] for r in rows]
        assert m["reward/mean"] == pytest.approx(sum(rewards) / len(rows), abs=1e-6)
        assert m["reward/accuracy"] == pytest.approx(
            sum(x >= 1 for x in rewards) / len(rows), abs=1e-6)
        every += rows
    # not vacuous: episodes of several turns, shaping rewards given before the last turn
    assert any(len(r["turn_rewards"]) == ENV_ARGS["max_guesses"] for r in every)
    assert any(x == ENV_ARGS["shaping"] for r in every for x in r["turn_rewards"][:-1])
    # the step-1 batch was sampled from the initial weights: the HF checkpoint's
    _check_logprobs(_rows(save, 1), tiny_char_model)

    evaluated = _rows(save, STEPS, "eval")
    assert len(evaluated) == 2 * len(records)
    _check_turn_rewards(evaluated)
    _check_environment(evaluated, records)
    solved = sum(r["reward"] >= 1 for r in evaluated) / len(evaluated)
    assert metrics[-1]["eval/mean_at_k"] == pytest.approx(solved, abs=1e-6)


@pytest.fixture(scope="module")
def lookup_caller(tmp_path_factory):
    """A tiny model that calls `lookup` with no arguments at every turn."""
    from megatron_rl.experiments.tiny_model import make_tool_caller_model

    return make_tool_caller_model(str(tmp_path_factory.mktemp("caller")), "lookup",
                                  max_position_embeddings=256)


def test_a_user_tool_by_import_path_with_settings(lookup_caller, arithmetic_jsonl, tmp_path):
    from lookup_tool import make_lookup

    from megatron_rl.agent import ToolCall, ToolRegistry, parse_tool_calls
    from megatron_rl.agent.tools import execute_tool_call

    save = str(tmp_path / "run")
    turns = 3
    _run(train_args(lookup_caller, arithmetic_jsonl, save, 2, [
        "--rollout-function", "agent", "--agent-tools", "calculator", TOOL,
        "--agent-tool-args", json.dumps(TOOL_ARGS), "--agent-max-turns", str(turns),
        "--agent-max-tokens", "256", "--save-rollouts", "1"]))

    registry = ToolRegistry([make_lookup(**TOOL_ARGS[TOOL])])
    for step in (1, 2):
        rows = _rows(save, step)
        assert len(rows) == 8
        _check_turn_rewards(rows)
        for r in rows:
            segments = r["segments"]
            assert [s["source"] for s in segments] == \
                ["policy", "environment"] * (turns - 1) + ["policy"], r
            assert r["end"] == "max_turns"
            for call, response in zip(segments[::2], segments[1::2]):
                calls = parse_tool_calls(call["text"], "qwen")
                assert len(calls) == 1 and isinstance(calls[0], ToolCall), call
                assert calls[0].name == "lookup"
                result = execute_tool_call(registry, calls[0])
                assert (result.outcome, result.text) == ("ok", "3.14159")  # the settings'
                assert response["text"] == f"\n<tool_response>\n{result.text}\n</tool_response>\n"
            assert r["counts"]["agent/tool_ok"] == turns - 1
