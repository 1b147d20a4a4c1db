"""rollout.threads.BackgroundThreads: the daemon threads of the trainer's background generation
and of a server pool. A user relies on: calls run in order and deliver results and exceptions
through their futures; cancelled queued calls never run; and a call that never returns does not
hold the process at exit (ThreadPoolExecutor's would, for the request's whole timeout)."""
import concurrent.futures as cf
import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.rollout.threads import BackgroundThreads


def test_calls_run_in_order_and_deliver_results_and_exceptions():
    pool = BackgroundThreads(1)
    seen = []
    futures = [pool.submit(seen.append, i) for i in range(5)]
    boom = pool.submit(lambda: 1 / 0)
    interrupt = pool.submit(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert [f.result(timeout=10) for f in futures] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        boom.result(timeout=10)
    with pytest.raises(KeyboardInterrupt):
        interrupt.result(timeout=10)
    assert pool.submit(lambda x: x * 2, 21).result(timeout=10) == 42  # the thread survived
    pool.shutdown()


def test_shutdown_cancels_queued_calls_and_refuses_new_ones():
    pool = BackgroundThreads(1)
    release = threading.Event()
    running = pool.submit(release.wait, 10)
    queued = [pool.submit(time.sleep, 0) for _ in range(3)]
    time.sleep(0.1)
    waited = {}  # a pool's generate waits on its chunks with cf.wait: it must wake up
    waiter = threading.Thread(target=lambda: waited.update(
        done=cf.wait(queued, timeout=10, return_when=cf.ALL_COMPLETED).done))
    waiter.start()
    pool.shutdown(wait=False, cancel_futures=True)
    waiter.join()
    assert all(f.cancelled() for f in queued) and waited["done"] == set(queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(time.sleep, 0)
    release.set()
    assert running.result(timeout=10) is True  # the running call was not interrupted
    pool.shutdown()  # a second call still joins the threads
    assert not any(t.is_alive() for t in pool._threads)


def test_a_call_that_never_returns_does_not_hold_the_exit():
    code = ("from megatron_rl.rollout.threads import BackgroundThreads; import time; "
            "BackgroundThreads(2).submit(time.sleep, 600); time.sleep(0.2)")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert time.monotonic() - t0 < 30
