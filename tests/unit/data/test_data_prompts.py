"""Prompt rendering per task, with a local tokenizer's chat template or a plain template, and the
resumable, seed-shuffled PromptDataset: its position survives rows removed or added."""
import json
import random
from collections import Counter

import pytest

from megatron_rl.data.prompts import PromptBuilder, PromptDataset, format_choices, row_keys
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
    with pytest.raises(ValueError, match="checkpoint seed 3 != data seed 4"):
        PromptDataset(rows, seed=4).load_state_dict(state)


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


def _rows(n, start=0):
    return [TaskExample(f"Problem {i}?", str(i), "gsm8k") for i in range(start, start + n)]


def _epoch_rest(data):
    """The prompts `data` gives until its current epoch ends."""
    return [r.text for r in data.next_batch(len(data) - data.index)]


@pytest.mark.parametrize("removed", ["taken", "last taken", "not taken"])
def test_removing_a_row_mid_epoch_loses_and_repeats_nothing(removed):
    """A run resumed on its data set less one row (fixed by hand, or --filter-overlong-prompts)
    takes, over the epoch, every row of the new data set exactly once, and the others keep
    their relative order."""
    rows = _rows(40)
    old = PromptDataset(rows, seed=7)
    taken = [r.text for r in old.next_batch(8) + old.next_batch(8)]  # two steps of 8 prompts
    state = json.loads(json.dumps(old.state_dict()))
    place = {"taken": 3, "last taken": 15, "not taken": 27}[removed]
    gone = old.order(0)[place]
    kept = rows[:gone] + rows[gone + 1:]
    new = PromptDataset(kept, seed=7)
    assert ([kept[i].prompt for i in new.order(0)]
            == [rows[i].prompt for i in old.order(0) if i != gone])
    new.load_state_dict(state)
    epoch = Counter(taken + _epoch_rest(new))
    expected = Counter(PromptBuilder()(ex) for ex in kept)
    if place < 16:  # taken before it was removed: once, and not again
        expected[PromptBuilder()(rows[gone])] += 1
    assert epoch == expected and max(epoch.values()) == 1
    assert new.next_batch(1)[0].epoch == 1


def test_a_row_added_mid_epoch_comes_in_this_epoch_only_where_it_has_not_passed():
    """A row added to the data set of a resumed run comes in the rest of the epoch when its
    place is after the position, else in the next epoch; the other rows once each."""
    rows = _rows(30)
    old = PromptDataset(rows, seed=1)
    taken = [r.text for r in old.next_batch(15)]
    state = old.state_dict()
    sides = set()
    for extra in _rows(6, start=100):  # some sort before the position, some after
        new = PromptDataset(rows[:10] + [extra] + rows[10:], seed=1)
        new.load_state_dict(state)
        rest = _epoch_rest(new)
        text = PromptBuilder()(extra)
        assert Counter(taken + rest) - Counter([text]) == Counter(PromptBuilder()(ex) for ex in rows)
        place = [new.examples[i].prompt for i in new.order(0)].index(extra.prompt)
        assert rest.count(text) == (place >= 15)  # its place is after the 15 rows taken
        assert [r.text for r in new.next_batch(len(new))].count(text) == 1  # the next epoch
        sides.add(place >= 15)
    assert sides == {True, False}


def test_repeated_rows_are_counted_right_when_one_goes():
    """Rows of the same content are told apart by their occurrence; removing one of them
    mid-epoch takes each remaining copy once and none already taken again."""
    rows = _rows(12) + [TaskExample("Twice?", "2", "gsm8k")] * 3
    twice = PromptBuilder()(rows[-1])
    order = PromptDataset(rows, seed=5).order(0)
    places = sorted(order.index(i) for i in (12, 13, 14))  # where the three copies come
    for consumed in sorted({p + d for p in places for d in (0, 1)}):  # before and after each
        data = PromptDataset(rows, seed=5)
        taken = [r.text for r in data.next_batch(consumed)]
        state = data.state_dict()
        new = PromptDataset(rows[:-1], seed=5)  # the last copy gone
        new.load_state_dict(state)
        epoch = Counter(taken + _epoch_rest(new))
        kept_untaken = sum(order.index(i) >= consumed for i in (12, 13))
        assert epoch[twice] == taken.count(twice) + kept_untaken
        assert all(epoch[PromptBuilder()(ex)] == 1 for ex in rows[:12])


def test_repeated_rows_spread_like_a_uniform_shuffle():
    """A data set that repeats each problem many times (DAPO-Math-17k holds each ~100 times):
    20 problems x 100 copies in batches of 64 hold about as many distinct problems as a uniform
    shuffle of the 2000 rows gives (19.29 expected; copies sorted together give 1 or 2)."""
    from math import comb

    rows = [TaskExample(f"Problem {i}?", str(i), "gsm8k") for i in range(20)] * 100
    data = PromptDataset(rows, seed=0)
    batch, per_epoch = 64, len(rows) // 64
    uniform = 20 * (1 - comb(1900, batch) / comb(2000, batch))
    for epoch in range(2):
        distinct = [len({r.answer for r in data.next_batch(batch)}) for _ in range(per_epoch)]
        data.epoch, data.index = epoch + 1, 0
        mean = sum(distinct) / len(distinct)
        assert abs(mean - uniform) < 0.4 and min(distinct) >= 15, (epoch, distinct)


def test_provenance_is_not_part_of_a_rows_key():
    """metadata.source and .row (where tools/prepare_data.py read the row) move when the source
    file is edited; the row's place in the order does not."""
    a = TaskExample("Q?", "1", "gsm8k", {"source": "a.csv", "row": 7, "id": 3})
    b = TaskExample("Q?", "1", "gsm8k", {"source": "b.csv", "row": 6, "id": 3})
    c = TaskExample("Q?", "1", "gsm8k", {"source": "a.csv", "row": 7, "id": 4})
    assert row_keys([a]) == row_keys([b]) != row_keys([c])


def test_an_index_position_resumes_its_permutation_to_the_epochs_end():
    """A checkpoint whose position is (epoch, index) into a random.Random(f"{seed}:{epoch}")
    permutation resumes that epoch exactly, then continues in the content order; on a data set
    of another size it is refused, naming the sizes."""
    rows = _rows(20)
    perm = list(range(20))
    random.Random("3:2").shuffle(perm)
    state = {"epoch": 2, "index": 6, "seed": 3, "num_examples": 20}
    data = PromptDataset(rows, seed=3)
    data.load_state_dict(state)
    first = data.next_batch(4)
    assert [r.uid for r in first] == [f"data:{i}" for i in perm[6:10]]
    again = PromptDataset(rows, seed=3)
    again.load_state_dict(data.state_dict())  # saved within that epoch: still an index
    assert [r.uid for r in again.next_batch(10)] == [f"data:{i}" for i in perm[10:20]]
    fresh = PromptDataset(rows, seed=3)
    assert [r.uid for r in again.next_batch(20)] == [f"data:{i}" for i in fresh.order(3)]
    assert "after" in again.state_dict()
    with pytest.raises(ValueError, match=r"index into the order of the 20 rows .* has 19"):
        PromptDataset(rows[1:], seed=3).load_state_dict(state)


def test_evaluation_data_keeps_file_order():
    data = PromptDataset(_rows(9), shuffle=False)
    assert [r.uid for r in data.next_batch(12)] == [f"data:{i}" for i in [*range(9), 0, 1, 2]]
