"""Reward functions by task name: ``get_reward_fn("math")(response, gold, metadata) -> float``.

One dict, ``REWARDS``; an unknown name raises a ValueError listing the valid ones. A task whose
verifier may be slow or unsafe on model output (math: sympy) is *sandboxed*: it is split into
``prepare`` (cheap, in the trainer) and ``verify`` (in a worker process with a hard time limit,
see scorer.py). Calling a ``TaskReward`` directly runs everything in-process with no time limit:
fine for trusted strings and tests; use ``score_batch`` for rollouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron_rl.rewards.countdown import score_countdown
from megatron_rl.rewards.math_verifier import prepare_math, score_math, verify_math
from megatron_rl.rewards.simple import score_choice_letter, score_last_number
from megatron_rl.rewards.types import Scored

ScoreFn = Callable[..., Scored]  # (response, gold, metadata, **options) -> Scored


@dataclass(frozen=True)
class TaskReward:
    name: str
    score: ScoreFn
    prepare: Callable[..., Scored | tuple] | None = None  # parent side of a sandboxed task
    verify: Callable[..., Scored] | None = None  # worker side: module-level, picklable

    @property
    def sandboxed(self) -> bool:
        return self.verify is not None

    def __call__(self, response: str, gold: str, metadata: dict[str, Any] | None = None, **options) -> float:
        return self.score(response, gold, metadata or {}, **options).reward


REWARDS: dict[str, TaskReward] = {}


def register(name: str, score: ScoreFn, *, prepare=None, verify=None, overwrite: bool = False) -> TaskReward:
    """Add a task. ``prepare`` and ``verify`` come together (a sandboxed task) or not at all."""
    if (prepare is None) != (verify is None):
        raise ValueError("prepare and verify must be given together")
    if name in REWARDS and not overwrite:
        raise ValueError(f"reward for task {name!r} is already registered")
    REWARDS[name] = TaskReward(name, score, prepare, verify)
    return REWARDS[name]


def get_reward_fn(name: str) -> TaskReward:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(REWARDS)}") from None


register("math", score_math, prepare=prepare_math, verify=verify_math)
register("countdown", score_countdown)
register("mmlu", score_choice_letter)
register("gsm8k", score_last_number)
register("arithmetic", score_last_number)
