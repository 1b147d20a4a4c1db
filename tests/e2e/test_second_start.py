"""Two starts into one --save: the second is refused naming the first, which runs on alone; the
lock a SIGKILL leaves behind is taken over, with a warning, by the next start, which resumes
with every step logged once."""
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py
from megatron_rl.run_lock import LOCK

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses


def test_a_second_start_is_refused_naming_the_first_and_a_killed_ones_lock_taken_over(
        tiny_char_model, arithmetic_jsonl, tmp_path):
    save = str(tmp_path / "run")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 200, ["--save-interval", "1"])
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(train_cmd(*args), env=train_env(), stdout=out, stderr=out,
                                 start_new_session=True)
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(save, "latest")):  # step 1 saved
            assert first.poll() is None, log.read_text()[-4000:]
            assert time.time() < deadline, "step 1 never saved"
            time.sleep(0.05)
        second = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True,
                                text=True, timeout=300)
        # refused as a user's error: the message naming the first, status 2, no traceback
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-4000:]
        assert f"{socket.gethostname()}, pid {first.pid}" in second.stderr, second.stderr[-4000:]
        assert os.path.join(save, LOCK) in second.stderr
        assert first.poll() is None, "the first run stopped"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert os.path.exists(os.path.join(save, LOCK))  # a kill leaves the lock behind

    with open(os.path.join(save, "latest")) as f:
        saved = int(f.read().strip()[len("iter_"):])
    iters = saved + 1
    third = subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, save, iters,
                                                 ["--save-interval", "1"])),
                           env=train_env(), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-4000:]
    assert f"taking over the lock of the run of host {socket.gethostname()}, pid {first.pid}" \
        in third.stderr
    assert [r["step"] for r in read_metrics(save)] == list(range(1, iters + 1))
    assert not os.path.exists(os.path.join(save, LOCK))  # released at the end
