"""A tiny character-level model and arithmetic data for end-to-end training tests."""
import json
import os
import sys

import pytest


def _char_model(path, seed, **overrides):
    from megatron_rl.experiments.tiny_model import make_char_model

    return make_char_model(path, seed, **overrides)


@pytest.fixture(scope="session")
def tiny_char_model(tmp_path_factory):
    """A random tiny Qwen2 with the character tokenizer (HF dir), as the demo builds it."""
    return _char_model(str(tmp_path_factory.mktemp("char_model")), seed=0)


@pytest.fixture(scope="session")
def tiny_char_ref(tmp_path_factory):
    """Another random model of the same shape: a reference that differs from the policy, so the
    KL term has a gradient from the first step."""
    return _char_model(str(tmp_path_factory.mktemp("char_ref")), seed=1)


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory):
    """(policy, reference): two random tiny Qwen3-MoE checkpoints (4 experts, top-2, one sparse
    and one dense layer) with the character tokenizer."""
    return tuple(_char_model(str(tmp_path_factory.mktemp(f"moe{seed}")), seed=seed,
                             family="qwen3_moe") for seed in (0, 1))


@pytest.fixture(scope="session")
def arithmetic_jsonl(tmp_path_factory):
    """64 two-term additions as prepared JSONL (task "arithmetic")."""
    from megatron_rl.data.records import TaskExample, write_jsonl

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
            for a in range(8) for b in range(8)]
    write_jsonl(path, rows)
    return str(path)


# A run that a kill or a signal interrupts and a resume completes must log what this
# uninterrupted run logs: KL to a different reference in the loss and the reward (the policy
# moves from step 1 on), the reference taking the policy's weights after step 3 (a resume needs
# the reference of its step, saved with it), deterministic kernels (on a GPU too both runs agree
# to float rounding).
RESUME_ITERS = 6
RESUME_FLAGS = ["--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0",
                "--ref-reset-interval", "3", "--deterministic-mode"]


@pytest.fixture(scope="session")
def uninterrupted_run(tiny_char_model, tiny_char_ref, arithmetic_jsonl, tmp_path_factory):
    """The metrics.jsonl rows of RESUME_ITERS steps with RESUME_FLAGS, run once per session."""
    import subprocess

    save = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, RESUME_ITERS,
                                         RESUME_FLAGS, ref=tiny_char_ref)),
                   check=True, env=train_env(), capture_output=True, timeout=600)
    return read_metrics(save)


def train_args(model, data, save, iters, extra=(), ref=None):
    return ["--hf-checkpoint", model, "--train-data", data, "--save", save,
            *(["--ref-checkpoint", ref] if ref else []),
            "--train-iters", str(iters), "--num-prompts-per-step", "4", "--group-size", "2",
            "--max-new-tokens", "3", "--lr", "1e-2", "--micro-batch-size", "8",
            "--prompt-template", "{prompt}=", "--no-task-instruction", "--seed", "3", *extra]


def train_cmd(*args):
    """The trainer's command line (one process) with `args`."""
    return [sys.executable, "-m", "megatron_rl.train", *args]


def train_env():
    """The trainer's environment: one thread per process."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def read_metrics(save):
    """The rows of <save>/metrics.jsonl."""
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
