"""`megatron-rl eval`: the settings it shares with `megatron-rl train` are train's flags, with
train's help and checks, refused naming the flag before any model is built (the
--hf-checkpoint of the first tests does not exist: reaching the model would fail otherwise);
its data is checked against the model's context as training's is (an agent episode longer
than the context, an overlong prompt), before the model; a damaged --load checkpoint is
refused naming the file."""
import argparse
import os
import shutil

import pytest

from megatron_rl.errors import ConfigError, UserError
from megatron_rl.evaluation import main

BASE = ["--hf-checkpoint", "no-such-model", "--eval-data", "no-such-data.jsonl"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
    (["--top-p", "1.5"], r"--top-p 1.5: a probability mass in \(0, 1\]"),
    (["--top-p", "0"], r"--top-p 0.0: a probability mass in \(0, 1\]"),
    (["--samples", "0"], "--samples 0: must be >= 1"),
    (["--max-prompts", "-1"], "--max-prompts -1: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--rollout-function", "no_such_agent_module:loop"],
     "--rollout-function 'no_such_agent_module:loop': cannot import module"),
    (["--rollout-url", "http://127.0.0.1:1"],
     "--rollout-url needs --rollout-engine vllm or sglang, not local"),
    (["--rollout-engine", "process", "--weight-sync", "distributed"],
     "--weight-sync distributed: --rollout-engine process takes auto, disk, tensor"),
    (["--agent-max-turns", "0"], "--agent-max-turns 0: must be >= 1"),
])
def test_settings_are_checked_as_train_checks_them(flags, message):
    with pytest.raises(ConfigError, match=message):
        main(BASE + flags)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_shared_flags_are_trains_flags():
    """Every flag eval shares with train has train's help (what it does, its default), default,
    choices and type: one declaration (config.py's dataclasses)."""
    from megatron_rl.config import build_parser as train_parser
    from megatron_rl.evaluation import build_parser

    train, ev = _flags(train_parser()), _flags(build_parser())
    own = {"--eval-data", "--samples", "--seeds", "--max-prompts", "--out", "--load",
           "--save-rollouts", "--work-dir"}  # the data, k, seeds, the weights, the output
    assert own <= set(ev)
    shared = set(train) & set(ev) - own
    for flag in ("--temperature", "--top-p", "--max-new-tokens", "--chat-template",
                 "--prompt-template", "--no-task-instruction", "--rollout-function",
                 "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--rollout-engine", "--rollout-url", "--rollout-num-servers", "--weight-sync",
                 "--rollout-process-cores", "--rollout-max-context-len", "--agent-max-tokens",
                 "--agent-max-turns", "--filter-overlong-prompts", "--bf16"):
        assert flag in shared, flag
    for flag in sorted(shared - {"-h", "--help"}):
        t, e = train[flag], ev[flag]
        assert (e.help, e.default, e.choices, e.type, e.nargs) == (
            t.help, t.default, t.choices, t.type, t.nargs), flag
    assert "--train-data" not in ev and "--rollout-release-memory" not in ev


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny random Qwen2 of 256 positions with the character tokenizer (HF directory)."""
    from megatron_rl.experiments.tiny_model import make_char_model

    return make_char_model(str(tmp_path_factory.mktemp("char_model")), seed=0,
                           max_position_embeddings=256)


def _jsonl(path, prompts):
    from megatron_rl.data.records import TaskExample, write_jsonl

    write_jsonl(path, [TaskExample(p, "1", "arithmetic") for p in prompts])
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: what is checked must be refused before."""
    from megatron_rl.models import policy

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the data was checked")

    monkeypatch.setattr(policy, "Policy", built)


def test_an_agent_episode_longer_than_the_context_is_refused_before_the_model(
        char_model, tmp_path, no_model):
    """The default --agent-max-tokens (4096) on a 256-position model: refused up front naming
    the flag and the limit, as `megatron-rl train` refuses it."""
    data = _jsonl(tmp_path / "eval.jsonl", ["Calculate 1+0."])
    with pytest.raises(ConfigError, match=r"^--agent-max-tokens 4096: an episode longer than the "
                                          r"model's max_position_embeddings \(256\) cannot be "
                                          r"generated; lower it to at most 256$"):
        main(["--hf-checkpoint", char_model, "--eval-data", data, "--rollout-function", "agent",
              "--max-new-tokens", "8"])


def test_an_overlong_prompt_is_refused_naming_its_line_before_the_model(char_model, tmp_path,
                                                                         no_model):
    data = _jsonl(tmp_path / "eval.jsonl", ["Calculate 1+0.", "x" * 250])  # 250 + 8 > 256
    with pytest.raises(UserError, match=rf"--eval-data: 1 of 2 prompts are too long .*{data}:2 "
                                        r"\(250 tokens\)"):
        main(["--hf-checkpoint", char_model, "--eval-data", data, "--max-new-tokens", "8",
              "--no-task-instruction"])
    # only the rows evaluated are checked
    with pytest.raises(AssertionError, match="a model was built"):
        main(["--hf-checkpoint", char_model, "--eval-data", data, "--max-new-tokens", "8",
              "--no-task-instruction", "--max-prompts", "1"])


def test_a_damaged_checkpoint_is_not_evaluated(tiny_qwen2, tmp_path):
    """--load of a checkpoint damaged since its save (a shard overwritten in place, same size)
    is refused naming the file, instead of evaluating garbage weights."""
    from megatron_rl.convert import main as convert
    from megatron_rl.experiments.tiny_model import make_char_tokenizer

    root = tmp_path / "converted"
    convert(["hf-to-megatron", "--load", tiny_qwen2, "--save", str(root)])
    ckpt = root / "iter_0000000"
    shard = max((p for p in ckpt.iterdir() if p.name.endswith(".distcp")),
                key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))
    model = tmp_path / "model"  # the checkpoint's architecture, with a tokenizer
    model.mkdir()
    shutil.copy(os.path.join(tiny_qwen2, "config.json"), model)
    make_char_tokenizer(str(model), vocab_size=512)
    data = _jsonl(tmp_path / "eval.jsonl", ["Calculate 1+0."])
    with pytest.raises(ValueError, match="damaged") as e:
        main(["--hf-checkpoint", str(model), "--eval-data", data, "--load", str(root),
              "--max-new-tokens", "8"])
    assert str(shard) in str(e.value)
