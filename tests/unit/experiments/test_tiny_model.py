"""The tiny models' character tokenizer (experiments/tiny_model.py) as transformers loads it
from a model's directory: every character, spaces and newlines included, is one token and comes
back from decoding, so a tool response or an environment's message keeps its layout."""
import string

import pytest
from transformers import AutoTokenizer

from megatron_rl.experiments.tiny_model import (make_char_model, make_char_tokenizer,
                                                make_demo_model)

TEXT = "a b\nc  12 * 34 = 408\n\n<tool_response>\n{\"x\": [1, 2]}\n</tool_response>\n"
CHARS = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))


@pytest.mark.parametrize("make", [make_char_tokenizer, make_char_model, make_demo_model])
def test_text_round_trips_one_token_per_character(tmp_path, make):
    """Alone and beside a Qwen2 model's config.json (which makes transformers load it as
    Qwen2Tokenizer), with the same id for each character."""
    tok = AutoTokenizer.from_pretrained(make(str(tmp_path / "m")))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert len(ids) == len(TEXT)
    assert tok(CHARS, add_special_tokens=False)["input_ids"] == list(range(3, 3 + len(CHARS)))


def test_special_tokens_are_one_token_each(tmp_path):
    path = make_char_model(str(tmp_path / "m"))
    make_char_tokenizer(path, special=("</tool_call>",))
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("x </tool_call>\n<eos>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5
    assert (ids[2], ids[4]) == (tok.convert_tokens_to_ids("</tool_call>"), tok.eos_token_id)
    assert tok.decode(ids, skip_special_tokens=False) == "x </tool_call>\n<eos>"
