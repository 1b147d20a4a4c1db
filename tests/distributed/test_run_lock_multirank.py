"""The lock on --save under torchrun: global rank 0 alone takes it. A start into a directory in
use ends every rank, naming the run that holds it; a lock a killed run left is taken over once
(by rank 0) and released when the run ends."""
import os
import subprocess
import sys

import pytest

from megatron_rl.rollout.net import free_port
from megatron_rl.run_lock import LOCK

pytestmark = pytest.mark.distributed

HOLD = ("import sys, time; from megatron_rl.run_lock import RunLock\n"
        "lock = RunLock(sys.argv[1], take=True); lock.acquire(); print('held', flush=True)\n"
        "time.sleep(300)")


def _torchrun(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), capture_output=True,
        text=True, timeout=timeout)


def test_two_ranks_take_the_lock_once_and_a_held_one_ends_them_both(char_model,
                                                                     arithmetic_jsonl, tmp_path):
    save = str(tmp_path / "run")
    args = ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
            "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", "2",
            "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "3",
            "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
            "--no-task-instruction", "--seed", "3"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, save], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = _torchrun(args, timeout=180)  # no rank waits for the refused one
        out = refused.stdout + refused.stderr
        assert refused.returncode != 0 and f"pid {holder.pid}" in out, out[-6000:]
        assert not os.path.exists(os.path.join(save, "metrics.jsonl"))
    finally:
        holder.kill()
        holder.wait()

    done = _torchrun(args, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert out.count("taking over the lock of the run of host") == 1, out[-6000:]
    assert not os.path.exists(os.path.join(save, LOCK))
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000002"
