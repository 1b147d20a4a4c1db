"""`megatron-rl eval`: its sampling values and its rollout function are checked, naming the flag,
before any model is built (the --hf-checkpoint here does not exist: reaching the model would
fail otherwise); a damaged --load checkpoint is refused naming the file."""
import os

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


def test_a_damaged_checkpoint_is_not_evaluated(tiny_qwen2, tmp_path):
    """--load of a checkpoint damaged since its save (a shard overwritten in place, same size)
    is refused naming the file, instead of evaluating garbage weights."""
    from megatron_rl.convert import main as convert

    root = tmp_path / "converted"
    convert(["hf-to-megatron", "--load", tiny_qwen2, "--save", str(root)])
    ckpt = root / "iter_0000000"
    shard = max((p for p in ckpt.iterdir() if p.name.endswith(".distcp")),
                key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))
    with pytest.raises(ValueError, match="damaged") as e:
        main(["--hf-checkpoint", tiny_qwen2, "--eval-data", str(tmp_path / "eval.jsonl"),
              "--load", str(root)])
    assert str(shard) in str(e.value)
