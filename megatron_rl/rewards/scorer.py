"""Batch scoring for the trainer: ``score(responses, golds, tasks, metadata) -> [Scored]`` (each
response's reward and, for a reward of 0 with a countable cause, its reason), and
``score_batch(...) -> (rewards, stats)``.

Never raises for a response's sake: a timeout, a verifier error, an over-long answer or a
missing answer scores 0 and is counted in ``stats`` under ``timeout``, ``error``, ``too_long``
or ``no_answer`` (``total`` is the batch size). Sandboxed tasks (math) run in a ``VerifierPool``
that the scorer keeps between calls; ``close()`` or the context manager stops it. One scorer
serves several threads (the trainer's background rollouts under --async-level): their calls
take turns.
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Sequence

from megatron_rl.rewards.pool import VerifierPool, default_num_workers
from megatron_rl.rewards.registry import get_reward_fn
from megatron_rl.rewards.types import ERROR, REASONS, Scored


class RewardScorer:
    """Scores batches of responses; reuse one per training run.

    Args:
        num_workers: verifier processes for sandboxed tasks (default: min(4, cpu count)).
        timeout_s: hard wall-clock limit per verified answer; the worker is killed past it.
        task_options: extra keyword options per task, e.g. ``{"countdown": {"format_reward": 0.1}}``
            or ``{"math": {"max_answer_chars": 256}}``.
        memory_limit_mb: address-space cap of each worker (None: no cap).
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 5.0,
        task_options: dict[str, dict[str, Any]] | None = None,
        *,
        memory_limit_mb: int | None = 4096,
    ):
        self.task_options = {k: dict(v) for k, v in (task_options or {}).items()}
        for name in self.task_options:
            get_reward_fn(name)  # fail early on a typo
        self.pool = VerifierPool(
            num_workers or default_num_workers(),
            timeout_s,
            memory_limit_mb=memory_limit_mb,
            warmup=("megatron_rl.rewards.math_verifier", "warmup"),
        )
        self._lock = threading.Lock()  # one call at a time: the pool serves one caller

    def score_batch(
        self,
        responses: Sequence[str],
        golds: Sequence[str],
        tasks: Sequence[str],
        metadata: Sequence[dict[str, Any] | None] | None = None,
    ) -> tuple[list[float], dict[str, int]]:
        """Rewards in input order and counts by reason. Raises only if the lengths differ."""
        results = self.score(responses, golds, tasks, metadata)
        stats = {reason: 0 for reason in REASONS}
        stats["total"] = len(results)
        for r in results:
            if r.reason is not None:
                stats[r.reason] += 1
        return [float(r.reward) for r in results], stats

    def score(
        self,
        responses: Sequence[str],
        golds: Sequence[str],
        tasks: Sequence[str],
        metadata: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[Scored]:
        """Each response's Scored (reward, reason) in input order. Raises only if the lengths
        differ. Thread-safe: calls from several threads take turns."""
        with self._lock:
            return self._score(responses, golds, tasks, metadata)

    def _score(self, responses, golds, tasks, metadata) -> list[Scored]:
        n = len(responses)
        if metadata is None:
            metadata = [None] * n
        if not (len(golds) == len(tasks) == len(metadata) == n):
            raise ValueError(
                f"scoring needs equal lengths: {n} responses, {len(golds)} golds, "
                f"{len(tasks)} tasks, {len(metadata)} metadata"
            )
        results: list[Scored | None] = [None] * n
        sandboxed: dict[Any, list[tuple[int, tuple]]] = {}
        for i, (response, gold, task, meta) in enumerate(zip(responses, golds, tasks, metadata)):
            try:
                reward_fn = get_reward_fn(task)
                options = self.task_options.get(task, {})
                if not isinstance(response, str):
                    raise TypeError(f"response must be str, got {type(response).__name__}")
                if reward_fn.sandboxed:
                    prepared = reward_fn.prepare(response, gold, meta or {}, **options)
                    if isinstance(prepared, Scored):
                        results[i] = prepared
                    else:
                        sandboxed.setdefault(reward_fn.verify, []).append((i, tuple(prepared)))
                else:
                    results[i] = reward_fn.score(response, gold, meta or {}, **options)
            except Exception:
                results[i] = Scored(0.0, ERROR)
        for verify, items in sandboxed.items():
            try:
                verified = self.pool.run(verify, [args for _, args in items])
            except Exception:
                verified = [Scored(0.0, ERROR)] * len(items)
            for (i, _), result in zip(items, verified):
                results[i] = result
        return [r if r is not None else Scored(0.0, ERROR) for r in results]

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_scorer: RewardScorer | None = None


def score_batch(responses, golds, tasks, metadata=None) -> tuple[list[float], dict[str, int]]:
    """``RewardScorer.score_batch`` on a process-wide default scorer (closed at exit)."""
    global _default_scorer
    if _default_scorer is None:
        _default_scorer = RewardScorer()
        atexit.register(close_default_scorer)
    return _default_scorer.score_batch(responses, golds, tasks, metadata)


def close_default_scorer() -> None:
    global _default_scorer
    if _default_scorer is not None:
        _default_scorer.close()
        _default_scorer = None
