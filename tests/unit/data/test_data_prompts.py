"""Prompt rendering per task, with a local tokenizer's chat template or a plain template, and the
resumable, seed-shuffled PromptDataset."""
import json

import pytest

from megatron_rl.data.prompts import PromptBuilder, PromptDataset, format_choices
from megatron_rl.data.records import TaskExample, write_jsonl

MATH = TaskExample("What is 1/2 + 0?", "0.5", "math")
CD = TaskExample("Using the numbers [3, 5, 2], create an equation that equals 16.", "16", "countdown",
                 {"numbers": [3, 5, 2], "target": 16})
MMLU = TaskExample("Which is a noble gas?", "C", "mmlu", {"choices": ["N", "O", "Ne", "H"]})
GSM = TaskExample("Eggs?", "18", "gsm8k")


def test_plain_prompts_carry_task_instructions():
    b = PromptBuilder(template="Question: {prompt}\nAnswer:")
    assert b(MATH).startswith("Question: What is 1/2 + 0?") and "\\boxed{}" in b(MATH)
    assert b(MATH).endswith("Answer:")
    assert "<answer>" in b(CD) and "at most once" in b(CD)
    assert "exactly once" in PromptBuilder(countdown_require_all=True)(CD)
    assert "A. N\nB. O\nC. Ne\nD. H" in b(MMLU) and "single letter" in b(MMLU)
    assert "final numerical answer" in b(GSM)
    assert format_choices(["x", "y"]) == "A. x\nB. y"
    with pytest.raises(ValueError, match="prompt"):
        PromptBuilder(template="no placeholder")


def _tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|im_end|>",
        "chat_template": template}))
    return tmp_path


def test_chat_template_from_local_tokenizer_dir(tmp_path):
    pytest.importorskip("transformers")
    b = PromptBuilder(tokenizer=_tokenizer_dir(tmp_path), system_prompt="Be brief.")
    text = b(MATH)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1/2 + 0?")
    assert text.endswith("<|im_start|>assistant\n")
    plain = PromptBuilder(tokenizer=b.tokenizer, use_chat_template=False)(MATH)
    assert "<|im_start|>" not in plain


def test_dataset_is_deterministic_and_resumable(tmp_path):
    rows = [TaskExample(f"Problem {i}?", str(i), "gsm8k") for i in range(7)]
    path = tmp_path / "d.jsonl"
    write_jsonl(path, rows)
    a = PromptDataset.from_jsonl(path, seed=3)
    first = [r.uid for r in a.next_batch(10)]  # crosses into epoch 1
    assert sorted(first[:7]) == sorted(f"d:{i}" for i in range(7))
    assert (a.epoch, a.index) == (1, 3)
    state = a.state_dict()
    cont = [r.uid for r in a.next_batch(5)]

    b = PromptDataset.from_jsonl(path, seed=3)
    assert [r.uid for r in b.next_batch(10)] == first  # same seed: same order
    c = PromptDataset.from_jsonl(path, seed=3)
    c.load_state_dict(json.loads(json.dumps(state)))  # resume from a saved position
    resumed = c.next_batch(5)
    assert [r.uid for r in resumed] == cont
    assert resumed[0].epoch == 1 and resumed[0].task == "gsm8k" and resumed[0].answer == rows[int(cont[0][2:])].answer
    assert [r.uid for r in PromptDataset.from_jsonl(path, seed=4).next_batch(7)] != first[:7]
    assert [r.uid for r in PromptDataset(rows, shuffle=False, name="d").next_batch(3)] == ["d:0", "d:1", "d:2"]
    with pytest.raises(ValueError, match="checkpoint"):
        PromptDataset(rows[:5], seed=3).load_state_dict(state)


def test_longest_prompt_is_counted_as_rendered():
    """max_prompt_tokens: the longest prompt as the engine gets it (template and task
    instruction included), in the given encoder's tokens."""
    rows = [TaskExample("a b", "1", "arithmetic"), TaskExample("a b c d e", "1", "arithmetic")]
    words = lambda text: text.split()  # noqa: E731
    bare = PromptDataset(rows, PromptBuilder(template="Q: {prompt} A:", task_instruction=False))
    assert bare.max_prompt_tokens(words) == 7  # "Q:" + 5 words + "A:"
    assert bare.max_prompt_tokens(words, first=1) == 4  # the rows evaluation reads
    full = PromptDataset(rows, PromptBuilder(template="{prompt}"))
    assert full.max_prompt_tokens(words) == 5 + len(PromptBuilder().user_message(
        TaskExample("", "1", "arithmetic")).split())
