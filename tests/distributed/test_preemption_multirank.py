"""SIGTERM under torchrun: the ranks agree at the step boundary, so a signal that reaches one
rank only stops both at the same step, with one complete checkpoint of it, and the run resumes
from it to the end."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.rollout.net import free_port
from megatron_rl.stopping import STOPPED_EARLY

pytestmark = pytest.mark.distributed


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_sigterm_to_one_rank_stops_both_at_one_saved_step(char_model, arithmetic_jsonl,
                                                          tmp_path, torchrun):
    save, iters = str(tmp_path / "run"), 20
    args = ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
            "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", str(iters),
            "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "3",
            "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
            "--no-task-instruction", "--seed", "3"]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
             "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args],
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), stdout=out,
            stderr=out, start_new_session=True)
    metrics = os.path.join(save, "metrics.jsonl")
    deadline = time.time() + 300
    try:
        while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 1):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.time() < deadline, "step 1 never logged"
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGTERM)  # one rank only
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode != 0  # torchrun's own status: a worker exited 75
    with open(os.path.join(save, STOPPED_EARLY)) as f:
        step = json.load(f)["step"]
    assert 1 <= step < iters and f"stopped at step {step} (SIGTERM)" in text, text[-6000:]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == f"iter_{step:07d}"
    # both ranks saved that step: the rank without the signal stopped there too
    files = os.listdir(os.path.join(save, f"iter_{step:07d}"))
    assert {"extra_rank0.pt", "extra_rank1.pt"} <= set(files)
    assert len(open(metrics).readlines()) == step

    torchrun(2, args, timeout=300)
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, iters + 1))
    assert not os.path.exists(os.path.join(save, STOPPED_EARLY))
