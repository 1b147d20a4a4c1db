"""Daemon worker threads for rollout requests (the trainer's background generation, a server
pool's one thread per server).

Why not concurrent.futures.ThreadPoolExecutor: the interpreter joins its threads at exit, so a
request stuck on a server that never answers holds a failed or interrupted trainer for the
request's whole timeout (an hour by default). These threads are daemons: such a request ends
with the process.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class BackgroundThreads:
    """`workers` daemon threads running submitted calls in submission order. `submit` returns a
    concurrent.futures.Future (cf.wait and friends work on it); the call's exception, whatever
    it is, is delivered through the future."""

    def __init__(self, workers: int = 1, name: str = "rollout"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("BackgroundThreads: submit after shutdown")
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more submits. `cancel_futures`: calls not started yet are cancelled (a running
        one is not interrupted; waiters in cf.wait are woken); `wait`: join the threads, after
        the calls still to run (not the calling thread, when a worker shuts its own pool)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                            item[0].set_running_or_notify_cancel()  # wakes cf.wait's waiters
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
