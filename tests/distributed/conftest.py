"""Launching multi-process tests with torchrun on CPU (gloo, one thread per rank)."""
import os
import subprocess
import sys

import pytest

from megatron_rl.rollout.net import free_port


@pytest.fixture(scope="session")
def torchrun():
    """torchrun(nproc, [args...], timeout=...) runs `python -m torch.distributed.run` and fails
    the test with the ranks' output when it exits non-zero."""

    def run(nproc: int, args: list[str], timeout: int = 300) -> str:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}")
        return out

    return run
