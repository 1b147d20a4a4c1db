"""`megatron-rl eval`: its sampling values and its rollout function are checked, naming the flag,
before any model is built (the --hf-checkpoint here does not exist: reaching the model would
fail otherwise)."""
import pytest

from megatron_rl.evaluation import main

BASE = ["--hf-checkpoint", "no-such-model", "--eval-data", "no-such-data.jsonl"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["--top-p", "1.5"], r"--top-p 1.5: a probability mass in \(0, 1\]"),
    (["--top-p", "0"], r"--top-p 0.0: a probability mass in \(0, 1\]"),
    (["--samples", "0"], "--samples 0: must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--rollout-function", "no_such_agent_module:loop"],
     "--rollout-function 'no_such_agent_module:loop': cannot import module"),
])
def test_sampling_values_are_checked_first(flags, message):
    with pytest.raises(ValueError, match=message):
        main(BASE + flags)
