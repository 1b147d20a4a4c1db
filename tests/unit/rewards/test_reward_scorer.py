"""score_batch on hostile answers: everything scores 0 within the time limit, nothing executes,
the pool survives stuck and dying workers, and close() leaves no process behind."""
import os
import signal
import time

import pytest

from megatron_rl.rewards import RewardScorer
from megatron_rl.rewards.pool import VerifierPool
from megatron_rl.rewards.types import ERROR, TIMEOUT

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=TIMEOUT_S) as s:
        s.pool.start()
        yield s


def test_known_answers_and_stats(scorer):
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", "no box here", "<answer>(3+5)*2</answer>",
                 "Answer: C", "so 18", "<answer>2*2</answer>"]
    golds = ["0.5", "2", "1", "16", "C", "18", "16"]
    tasks = ["math", "math", "math", "countdown", "mmlu", "gsm8k", "countdown"]
    meta = [None, None, None, {"numbers": [3, 5, 2]}, {"choices": list("wxyz")}, None, {"numbers": [2, 2]}]
    rewards, stats = scorer.score_batch(responses, golds, tasks, meta)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert stats == {"timeout": 0, "error": 0, "too_long": 0, "no_answer": 1, "total": 7}


def test_hostile_answers_score_zero_in_time(scorer, tmp_path):
    sentinel = tmp_path / "pwned"
    injection = f"__import__('os').system('touch {sentinel}')"
    hostile = [
        r"\boxed{9^{9^{9^{9}}}}",
        r"\boxed{(x+1)^{100000}}",
        r"\boxed{" + "(" * 150 + "1" + ")" * 150 + "}",  # deep nesting, under the length cap
        r"\boxed{" + "{" * 2000 + "1" + "}" * 2000 + "}",  # deeper: over the cap
        r"\boxed{" + injection + "}",
        r"\boxed{\text{" + injection + "}}",
        "\\boxed{" + "9" * 1_000_000 + "}",  # 1 MB answer
        "x" * 1_000_000,  # 1 MB response, no answer
        "\\boxed{\u202e\u0000\ud800 \U0001F600 ∞ 𝟘}",  # odd unicode, a lone surrogate
    ]
    start = time.monotonic()
    rewards, stats = scorer.score_batch(hostile, ["1"] * len(hostile), ["math"] * len(hostile))
    wall = time.monotonic() - start
    assert rewards == [0.0] * len(hostile)
    assert stats["total"] == len(hostile)
    assert stats["too_long"] >= 2 and stats["no_answer"] >= 1
    # Each verified answer costs at most TIMEOUT_S; two workers run side by side, plus respawns.
    assert wall < len(hostile) * TIMEOUT_S / 2 + 6, wall
    cd = [f"<answer>{injection}</answer>", "<answer>" + "(" * 5000 + "</answer>", "<answer>9**9**9**9</answer>",
          "<answer>" * 100_000, "<answer>" + "1+" * 500_000 + "1</answer>"]
    rewards, stats = scorer.score_batch(cd, ["24"] * len(cd), ["countdown"] * len(cd), [{"numbers": [1, 9]}] * len(cd))
    assert rewards == [0.0] * len(cd)
    assert not sentinel.exists()


def test_unknown_task_and_bad_input_never_raise(scorer):
    rewards, stats = scorer.score_batch(["x", None, r"\boxed{1}"], ["1", "1", ""], ["chess", "math", "math"])
    assert rewards == [0.0, 0.0, 0.0]
    assert stats["error"] == 3
    with pytest.raises(ValueError, match="equal lengths"):
        scorer.score_batch(["x"], [], [])


def test_pool_kills_stuck_worker_and_survives_dying_one():
    pool = VerifierPool(num_workers=1, timeout_s=1.0, memory_limit_mb=None)
    try:
        (result,) = pool.run(time.sleep, [(30,)])  # the worker's own alarm interrupts a sleep
        assert result.reason == TIMEOUT and pool.num_restarts == 0
        # Block SIGALRM in the worker (as a long C-level computation effectively does): only the
        # parent's kill can end the next job. (The first job "fails": it returns no Scored.)
        pool.run(signal.pthread_sigmask, [(signal.SIG_BLOCK, [signal.SIGALRM])])
        start = time.monotonic()
        (result,) = pool.run(time.sleep, [(30,)])
        assert result.reason == TIMEOUT and pool.num_restarts == 1
        assert time.monotonic() - start < 5
        (result,) = pool.run(os._exit, [(3,)])  # the worker dies mid-job
        assert result.reason == ERROR
        (result,) = pool.run(divmod, [(7, 0)])  # raises: an error, the worker lives on
        assert result.reason == ERROR
        pids = pool.alive_pids()
        assert len(pids) == 1
    finally:
        pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
