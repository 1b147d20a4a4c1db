"""Fixtures of the agent tests: the demo's character tokenizer (as transformers loads it) and a
reward scorer with one worker."""
import pytest
from transformers import AutoTokenizer

from megatron_rl.experiments.tiny_model import make_char_tokenizer
from megatron_rl.rewards import RewardScorer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_char_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=1) as s:
        yield s
