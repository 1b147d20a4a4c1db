"""ParallelConfig's timeouts: --distributed-timeout-minutes (megatron's flag) and
--rank-wait-timeout-minutes, as flags and YAML keys, checked."""
import pytest

from megatron_rl.config import parse_config

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]


def test_timeouts_are_flags_and_yaml_keys_in_minutes(tmp_path):
    cfg = parse_config(BASE)
    assert (cfg.parallel.distributed_timeout_minutes, cfg.parallel.rank_wait_timeout_minutes) == (
        30.0, 360.0)
    cfg = parse_config(BASE + ["--distributed-timeout-minutes", "0.5",
                               "--rank-wait-timeout-minutes", "90"])
    assert (cfg.parallel.distributed_timeout_minutes, cfg.parallel.rank_wait_timeout_minutes) == (
        0.5, 90.0)
    path = tmp_path / "run.yaml"
    path.write_text("distributed_timeout_minutes: 45\n")
    assert parse_config(BASE + ["--config", str(path)]).parallel.distributed_timeout_minutes == 45


@pytest.mark.parametrize("flag", ["--distributed-timeout-minutes", "--rank-wait-timeout-minutes"])
def test_a_timeout_must_be_positive(flag):
    with pytest.raises(ValueError, match=f"{flag} 0.0: must be > 0"):
        parse_config(BASE + [flag, "0"])
