"""Loading a run's data (runtime.load_data): every prompt the run will send is checked against
the context its flags give it, before any model is built."""
import logging

import pytest

from megatron_rl.data.records import TaskExample, write_jsonl


@pytest.fixture(scope="module")
def char_tokenizer_dir(tmp_path_factory):
    """An --hf-checkpoint directory with the tests' character tokenizer (all load_data reads)."""
    from megatron_rl.experiments.tiny_model import make_char_tokenizer

    return make_char_tokenizer(str(tmp_path_factory.mktemp("chars")))


def _jsonl(path, lengths):
    """Row i (line i + 1): a prompt of lengths[i] characters, i.e. lengths[i] + 1 tokens with
    the template "{prompt}="."""
    write_jsonl(path, [TaskExample(f"{i:02d}" + "x" * (n - 2), "1", "arithmetic")
                       for i, n in enumerate(lengths)])
    return str(path)


def _load(tmp_path, tokenizer_dir, train, *flags, evals=None, positions=64):
    from megatron_rl.config import parse_config
    from megatron_rl.data.prompts import load_tokenizer
    from megatron_rl.data.prompts import Codec
    from megatron_rl.runtime import load_data

    cfg = parse_config(["--hf-checkpoint", tokenizer_dir, "--train-data", train,
                        *(["--eval-data", evals] if evals else []), "--save",
                        str(tmp_path / "run"), "--max-new-tokens", "16",
                        "--prompt-template", "{prompt}=", "--no-task-instruction", *flags])
    codec = Codec.from_tokenizer(load_tokenizer(tokenizer_dir), cfg.data.chat_template)
    return load_data(cfg, codec, positions)


def test_an_overlong_prompt_is_refused_against_the_models_positions(tmp_path,
                                                                     char_tokenizer_dir):
    train = _jsonl(tmp_path / "train.jsonl", [10, 47, 48, 20])  # 49 tokens + 16 > 64
    with pytest.raises(ValueError, match=(
            rf"--train-data: 1 of 4 prompts are too long \(a prompt's tokens \+ --max-new-tokens "
            rf"\(16\) must fit the model's max_position_embeddings \(64\): at most 48 prompt "
            rf"tokens\): {train}:3 \(49 tokens\)\. .*--filter-overlong-prompts")):
        _load(tmp_path, char_tokenizer_dir, train)
    data, _ = _load(tmp_path, char_tokenizer_dir, train, positions=65)
    assert len(data) == 4 and data.max_prompt_tokens() == 49  # the counts, kept


def test_rollout_max_context_len_is_the_limit_of_started_servers(tmp_path, char_tokenizer_dir):
    train = _jsonl(tmp_path / "train.jsonl", [10, 30, 20])  # 31 tokens + 16 > 40
    servers = ["--rollout-engine", "vllm", "--rollout-max-context-len", "40"]
    with pytest.raises(ValueError, match=rf"must fit --rollout-max-context-len 40: at most 24 "
                                         rf"prompt tokens\): {train}:2 \(31 tokens\)\. .*raise "
                                         rf"--rollout-max-context-len"):
        _load(tmp_path, char_tokenizer_dir, train, *servers)
    attached = ["--rollout-url", "http://127.0.0.1:1"]  # an attached server has its own length
    assert len(_load(tmp_path, char_tokenizer_dir, train, *servers, *attached)[0]) == 3


def test_an_agent_episode_longer_than_the_model_is_refused_before_any_model(tmp_path,
                                                                           char_tokenizer_dir):
    train = _jsonl(tmp_path / "train.jsonl", [10, 20])
    agent = ["--rollout-function", "agent", "--agent-max-tokens", "100"]
    with pytest.raises(ValueError, match=r"--agent-max-tokens 100: an episode longer than the "
                                         r"model's max_position_embeddings \(64\) cannot be "
                                         r"generated; lower it to at most 64"):
        _load(tmp_path, char_tokenizer_dir, train, *agent)
    assert len(_load(tmp_path, char_tokenizer_dir, train, *agent, positions=128)[0]) == 2


def test_filter_overlong_prompts_and_the_evaluated_rows(tmp_path, char_tokenizer_dir, caplog):
    """--filter-overlong-prompts skips overlong rows of the training and the evaluated data;
    evaluation data is checked only where evaluated (--eval-interval), in its first
    --eval-max-prompts rows."""
    train = _jsonl(tmp_path / "train.jsonl", [10, 60, 20, 50])  # rows 2 and 4 too long
    evals = _jsonl(tmp_path / "eval.jsonl", [10, 20, 70, 30])  # row 3 too long
    fits = _jsonl(tmp_path / "fits.jsonl", [10, 20])
    with pytest.raises(ValueError, match=rf"--eval-data: 1 of 4 .*{evals}:3 \(71 tokens\)"):
        _load(tmp_path, char_tokenizer_dir, fits, "--eval-interval", "1", evals=evals)
    _, unevaluated = _load(tmp_path, char_tokenizer_dir, fits, evals=evals)
    assert unevaluated is not None and len(unevaluated) == 4
    _, first_two = _load(tmp_path, char_tokenizer_dir, fits, "--eval-interval", "1",
                         "--eval-max-prompts", "2", evals=evals)
    assert first_two is not None and len(first_two) == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.lengths"):
        data, ev = _load(tmp_path, char_tokenizer_dir, train, "--filter-overlong-prompts",
                         "--eval-interval", "1", evals=evals)
    assert [ex.prompt[:2] for ex in data.examples] == ["00", "02"]
    assert ev is not None and [ex.prompt[:2] for ex in ev.examples] == ["00", "01", "03"]
    assert [r.getMessage().split(" prompts ")[0] for r in caplog.records] == [
        "--filter-overlong-prompts: skipping 2 of 4 --train-data",
        "--filter-overlong-prompts: skipping 1 of 4 --eval-data"]
    assert f"{train}:2, {train}:4" in caplog.records[0].getMessage()
