"""TrainConfig: which behaviour-policy log-probs the trainer uses (--old-logprobs)."""
import pytest

from megatron_rl.config import parse_config

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]


@pytest.mark.parametrize("flags, expected", [
    ([], True),                                          # local engine, fp32, T=1, top-p 1
    (["--temperature", "0.7"], False),                   # engine log-probs are of softmax(z/T)
    (["--top-p", "0.9"], False),                         # ... of the truncated distribution
    (["--bf16"], False),                                 # decode and train numerics differ
    (["--rollout-engine", "vllm"], False),               # another implementation's numerics
    (["--old-logprobs", "recompute"], False),
    (["--old-logprobs", "rollout", "--rollout-engine", "sglang"], True),
])
def test_auto_uses_engine_logprobs_only_where_they_are_the_policys(flags, expected):
    assert parse_config(BASE + flags).use_rollout_logprobs() is expected


def test_unknown_choice_is_refused():
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--old-logprobs", "engine"])
