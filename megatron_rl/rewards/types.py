"""The result type every task scorer returns, and the reasons a reward of 0 is counted under."""
from __future__ import annotations

from dataclasses import dataclass

# Reasons logged by score_batch. A plain wrong answer has no reason (it is just incorrect).
TIMEOUT = "timeout"  # the verifier ran past its wall-clock limit and was killed
ERROR = "error"  # the verifier raised, its worker died, or the gold/metadata was unusable
TOO_LONG = "too_long"  # the extracted answer exceeded the length cap and was not verified
NO_ANSWER = "no_answer"  # no \boxed{}, <answer> tag, letter or number was found
REASONS = (TIMEOUT, ERROR, TOO_LONG, NO_ANSWER)


@dataclass(frozen=True)
class Scored:
    """One response's reward and, when it scored 0 for a countable cause, which one."""

    reward: float
    reason: str | None = None

    def __post_init__(self):
        assert self.reason is None or self.reason in REASONS, self.reason
