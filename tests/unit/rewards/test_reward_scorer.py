"""score_batch on hostile answers: everything scores 0, the unbounded ones as timeouts (the time
limit fired), nothing executes, the honest answers beside them are still scored, the pool
survives stuck and dying workers, and close() leaves no process behind.

No assert reads the wall clock (they flaked on a loaded machine): that the limit worked is seen
in what the pool reports (a "timeout" reason, a killed and replaced worker), not in how long the
batch took."""
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


def test_hostile_answers_score_zero_and_time_out(scorer, tmp_path):
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
    # honest answers (correct, gold "1") interleaved with the hostile ones: a stuck or killed
    # worker must not cost its neighbours their score
    honest = [r"\boxed{1}", r"\boxed{\frac{2}{2}}", "so the answer is \\boxed{1.0}"]
    batch = []
    for i, h in enumerate(hostile):
        batch += [h, honest[i % len(honest)]]
    is_hostile = [i % 2 == 0 for i in range(len(batch))]
    restarts = scorer.pool.num_restarts
    rewards, stats = scorer.score_batch(batch, ["1"] * len(batch), ["math"] * len(batch))
    assert [r for r, h in zip(rewards, is_hostile) if h] == [0.0] * len(hostile)
    assert [r for r, h in zip(rewards, is_hostile) if not h] == [1.0] * len(hostile)
    assert stats["total"] == len(batch)
    assert stats["too_long"] >= 2 and stats["no_answer"] >= 1
    # 9^(9^(9^9)) and (x+1)^100000 cannot be verified in any time: each one ends as a timeout
    # (the worker's alarm, or the parent's kill past TIMEOUT_S), never as a hang or a score
    assert stats["timeout"] >= 2, stats
    # every job past the hard limit had its worker killed and replaced: the pool is whole again
    assert len(scorer.pool.alive_pids()) == scorer.pool.num_workers
    assert scorer.pool.num_restarts - restarts <= stats["timeout"] + stats["error"]
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
        (stuck,) = pool.alive_pids()
        (result,) = pool.run(time.sleep, [(30,)])
        # A timeout with the alarm blocked can only be the parent's kill at the hard deadline
        # (a sleep that ran its 30 s would return None: an error, not a timeout).
        assert result.reason == TIMEOUT and pool.num_restarts == 1
        with pytest.raises(ProcessLookupError):  # killed (and reaped), not left to finish
            os.kill(stuck, 0)
        (fresh,) = pool.alive_pids()
        assert fresh != stuck
        (result,) = pool.run(time.sleep, [(0,)])  # the replacement works: sleep returns None,
        assert result.reason == ERROR  # which is no Scored: an error, from a live worker
        assert pool.alive_pids() == [fresh]
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


def test_threads_scoring_at_once_each_get_their_own_rewards(scorer):
    """Two threads scoring math at the same time (background rollouts under --async-level, one
    thread per batch in flight) share the scorer's pool: each call gets its own responses'
    rewards and reasons."""
    import threading

    n = 24
    correct = [rf"\boxed{{{i}}}" for i in range(n)]  # against golds 0..n-1: all right
    wrong = [rf"\boxed{{{i + 1000}}}" for i in range(n)]  # all wrong
    golds = [str(i) for i in range(n)]
    got: dict[str, list] = {"correct": [], "wrong": []}

    def score(name, responses):
        for _ in range(3):
            got[name].append(scorer.score(responses, golds, ["math"] * n))

    # daemons: a pool that mixes the two callers up can hang them, which must fail the test,
    # not hold the interpreter at exit
    threads = [threading.Thread(target=score, args=("correct", correct), daemon=True),
               threading.Thread(target=score, args=("wrong", wrong), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got["correct"]) == len(got["wrong"]) == 3
    assert all(s.reward == 1.0 and s.reason is None for r in got["correct"] for s in r)
    assert all(s.reward == 0.0 and s.reason is None for r in got["wrong"] for s in r)
