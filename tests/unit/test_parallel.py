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


SINGLE_PROCESS_INIT = """
import socket
import megatron_rl.rollout.net as net
from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

# a port that was free when probed and is taken before the store binds it (as by the process
# group of a test worker beside this one): the probe is made to answer with a port in use
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
net.free_port = lambda host="127.0.0.1": taken.getsockname()[1]
for _ in range(2):
    init_distributed(ParallelConfig())
    destroy_distributed()
print("ok")
"""


@pytest.mark.distributed
def test_a_single_process_world_never_races_for_its_port():
    """Without torchrun, init_distributed's store binds a port the kernel picks at bind time,
    so tests and tools starting side by side never collide (EADDRINUSE)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", SINGLE_PROCESS_INIT], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
