"""Prompt lengths checked when the data loads: an overlong prompt is refused naming its file,
line and token count, or skipped under --filter-overlong-prompts with one warning; the counts
are those generation sees (the rendered prompt, the run's tokenizer)."""
import logging

import pytest

from megatron_rl.data.lengths import ContextLimit, check_prompt_lengths
from megatron_rl.data.prompts import PromptBuilder, PromptDataset
from megatron_rl.data.records import TaskExample, write_jsonl

TEMPLATE = "{prompt}="  # the e2e tests' template: a prompt is its text and "="


@pytest.fixture(scope="module")
def char_tokenize(tmp_path_factory):
    """The tests' character tokenizer (one token per character), as the run's Codec calls it."""
    from megatron_rl.data.prompts import load_tokenizer
    from megatron_rl.experiments.tiny_model import make_char_tokenizer

    tok = load_tokenizer(make_char_tokenizer(str(tmp_path_factory.mktemp("chars"))))
    return lambda texts: tok(texts, add_special_tokens=True)["input_ids"]


def _data(tmp_path, lengths, **kwargs):
    """A JSONL file whose row i (line i + 1) is a prompt of lengths[i] characters."""
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [TaskExample(f"{i:03d}" + "x" * (n - 3), "1", "arithmetic")
                       for i, n in enumerate(lengths)])
    builder = PromptBuilder(template=TEMPLATE, task_instruction=False)
    return path, PromptDataset.from_jsonl(path, builder, **kwargs)


LIMIT = ContextLimit(64, "the model's max_position_embeddings (64)", max_new_tokens=16)


def test_overlong_prompts_are_refused_naming_file_line_and_tokens(tmp_path, char_tokenize):
    lengths = [10, 47, 48, 20, 60, 70, 80, 90, 100, 30, 200]  # 47 chars + "=": 48 tokens, fits
    path, data = _data(tmp_path, lengths)
    with pytest.raises(ValueError) as e:
        check_prompt_lengths(data, char_tokenize, LIMIT, what="--train-data", skip=False)
    msg = str(e.value)
    assert msg.startswith("--train-data: 7 of 11 prompts are too long (a prompt's tokens + "
                          "--max-new-tokens (16) must fit the model's max_position_embeddings "
                          "(64): at most 48 prompt tokens)")
    assert (f"{path}:3 (49 tokens), {path}:5 (61 tokens), {path}:6 (71 tokens), "
            f"{path}:7 (81 tokens), {path}:8 (91 tokens) and 2 more. ") in msg
    assert "--filter-overlong-prompts to skip them" in msg


def test_rows_that_fit_are_kept_with_their_counts(tmp_path, char_tokenize):
    _, data = _data(tmp_path, [5, 47, 12])
    rows, counts = check_prompt_lengths(data, char_tokenize, LIMIT, what="--train-data",
                                        skip=False)
    assert rows == [0, 1, 2] and counts == [6, 48, 13]
    assert data.subset(rows, counts).max_prompt_tokens() == 48  # no second tokenization


def test_filter_overlong_prompts_skips_them_with_one_warning(tmp_path, char_tokenize, caplog):
    path, data = _data(tmp_path, [10, 90, 20, 60, 30])
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.lengths"):
        rows, counts = check_prompt_lengths(data, char_tokenize, LIMIT, what="--train-data",
                                            skip=True)
    assert rows == [0, 2, 4] and counts == [11, 21, 31]
    [warning] = caplog.records
    assert warning.getMessage() == (
        "--filter-overlong-prompts: skipping 2 of 5 --train-data prompts (a prompt's tokens + "
        "--max-new-tokens (16) must fit the model's max_position_embeddings (64): at most 48 "
        f"prompt tokens): {path}:2, {path}:4")
    kept = data.subset(rows, counts)
    assert [ex.prompt[:3] for ex in kept.examples] == ["000", "002", "004"]
    assert kept.locations == [f"{path}:1", f"{path}:3", f"{path}:5"]
    with pytest.raises(ValueError, match="--filter-overlong-prompts leaves none"):
        check_prompt_lengths(data.subset([1, 3]), char_tokenize, LIMIT, what="--train-data",
                             skip=True)


def test_only_the_evaluated_rows_count_unless_skipping(tmp_path, char_tokenize):
    """Evaluation reads the first --eval-max-prompts rows: a longer row past them is no
    error; skipping counts them all, so that the rows evaluated after it are counted too."""
    _, data = _data(tmp_path, [10, 20, 90, 30], shuffle=False)
    rows, counts = check_prompt_lengths(data, char_tokenize, LIMIT, what="--eval-data",
                                        skip=False, first=2)
    assert rows == [0, 1, 2, 3] and counts == [11, 21]
    assert data.subset(rows, counts).max_prompt_tokens(first=2) == 21
    rows, counts = check_prompt_lengths(data, char_tokenize, LIMIT, what="--eval-data",
                                        skip=True, first=2)
    assert rows == [0, 1, 3] and counts == [11, 21, 31]


def test_counting_goes_in_batches_and_shows_progress_on_large_sets(tmp_path, char_tokenize,
                                                                     monkeypatch, capsys):
    from megatron_rl.data import lengths

    monkeypatch.setattr(lengths, "BATCH", 3)
    _, data = _data(tmp_path, [5, 6, 7, 8, 9, 10, 11])
    monkeypatch.setattr(lengths, "PROGRESS_ROWS", 8)
    assert lengths.count_prompt_tokens(data, char_tokenize) == [6, 7, 8, 9, 10, 11, 12]
    assert capsys.readouterr().err == ""  # a small set: no progress lines
    monkeypatch.setattr(lengths, "PROGRESS_ROWS", 7)
    assert lengths.count_prompt_tokens(data, char_tokenize, first=7) == [6, 7, 8, 9, 10, 11, 12]
    assert "counting the tokens of train's prompts: 7/7 (100%) done" in capsys.readouterr().err
