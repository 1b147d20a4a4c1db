"""An agent environment that fails every episode stops `megatron-rl train` and `megatron-rl
eval` at the first rollout with its own error (the environment, how many episodes failed, the
first one's error and record) and exit status 1, without a traceback: not a run that trains on
nothing until the non-finite-update guard stops it (FloatingPointError), nor one that exits 0
with every update skipped."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import train_args, train_cmd, train_env  # tests/e2e/conftest.py

from megatron_rl.errors import EXIT_FAILURE

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses

HERE = Path(__file__).resolve().parent
AGENT = ["--rollout-function", "agent", "--agent-environment", "failing_env:BrokenStep",
         "--agent-max-turns", "2", "--agent-max-tokens", "40"]


def _env():
    return dict(train_env(), PYTHONPATH=os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))


def _check(proc, command, episodes):
    assert proc.returncode == EXIT_FAILURE == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "FloatingPointError" not in proc.stderr, \
        proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{command}: error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    last = errors[0]
    assert last.startswith(
        f"{command}: error: agent environment failing_env:BrokenStep (--agent-environment) "
        f"failed {episodes} of {episodes} episodes of this rollout, more than "
        "--agent-max-env-failures 0.5 of them"), last
    # the record (its uid: the data set and row), the error and where the environment raised it
    assert re.search(r"the first: step on record \w+:\d+ raised KeyError: 'no such board' "
                     r"\(at \S+failing_env.py:\d+ in step\)$", last), last


def test_a_broken_environment_stops_train_and_eval_with_its_error(tiny_char_model,
                                                                  arithmetic_jsonl, tmp_path):
    save = tmp_path / "run"
    proc = subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, str(save), 3,
                                                AGENT)),
                          env=_env(), capture_output=True, text=True, timeout=600)
    _check(proc, "megatron-rl train", 8)  # 4 prompts x 2
    assert not (save / "metrics.jsonl").exists() or not (save / "metrics.jsonl").read_text()

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "eval", "--hf-checkpoint", tiny_char_model,
         "--eval-data", arithmetic_jsonl, "--samples", "2", "--max-new-tokens", "4",
         "--max-prompts", "3", "--prompt-template", "{prompt}=", "--no-task-instruction", *AGENT],
        env=_env(), capture_output=True, text=True, timeout=600)
    _check(proc, "megatron-rl eval", 6)
