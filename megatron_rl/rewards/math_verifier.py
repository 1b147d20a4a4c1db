"""Math reward: the last ``\\boxed{}`` of the response, checked against the gold with math-verify.

Split in two so the untrusted, possibly slow part runs in a worker process (see pool.py):
``prepare_math`` (parent, cheap, linear time) extracts the answer and applies the length cap;
``verify_math`` (worker) parses both sides with math-verify and compares them. math-verify's
own SIGALRM timeouts are disabled here: the worker's alarm and the parent's kill govern.
Called in-process (``score_math``), nothing bounds the time: use ``score_batch`` for model output.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from megatron_rl.rewards.extract import last_boxed
from megatron_rl.rewards.types import ERROR, NO_ANSWER, TOO_LONG, Scored

MAX_ANSWER_CHARS = 512  # longest extracted answer handed to the verifier


class _QuietTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _import_math_verify():
    import math_verify  # noqa: F401  (heavy: pulls in sympy)

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    mv = _import_math_verify()
    return mv.parse("\\boxed{" + gold + "}", parsing_timeout=None)


def verify_math(pred: str, gold: str) -> Scored:
    """math-verify equivalence of two LaTeX answers (contents of \\boxed{}), no time limit."""
    mv = _import_math_verify()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return Scored(0.0, ERROR)
    pred_parsed = mv.parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not pred_parsed:
        return Scored(0.0)
    return Scored(1.0 if mv.verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0)


def prepare_math(response: str, gold: str, metadata: dict[str, Any], *,
                 max_answer_chars: int = MAX_ANSWER_CHARS) -> Scored | tuple[str, str]:
    """A final ``Scored`` when no verification is needed, else the (pred, gold) to verify."""
    if not isinstance(gold, str) or not gold.strip():
        return Scored(0.0, ERROR)
    pred = last_boxed(response)
    if pred is None or not pred.strip():
        return Scored(0.0, NO_ANSWER)
    if len(pred) > max_answer_chars:
        return Scored(0.0, TOO_LONG)
    return (pred, gold)


def score_math(response: str, gold: str, metadata: dict[str, Any], **options) -> Scored:
    prepared = prepare_math(response, gold, metadata, **options)
    if isinstance(prepared, Scored):
        return prepared
    return verify_math(*prepared)


def warmup() -> None:
    """Load sympy/latex2sympy in a fresh worker so the first real job is not charged for it."""
    verify_math("\\frac{1}{2}", "0.5")
