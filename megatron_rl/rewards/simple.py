"""Rewards that need no sandbox: a final number (GSM8K, arithmetic) and a final letter (MMLU).

Both are linear-time string scans plus an exact ``Fraction`` compare, safe in the trainer.
"""
from __future__ import annotations

from typing import Any

from megatron_rl.rewards.extract import last_choice_letter, last_number, to_fraction
from megatron_rl.rewards.types import ERROR, NO_ANSWER, TOO_LONG, Scored

MAX_NUMBER_CHARS = 64


def score_last_number(response: str, gold: str, metadata: dict[str, Any]) -> Scored:
    """1.0 when the last number in the response equals the gold number exactly (1,000 == 1000.0)."""
    gold_value = to_fraction(str(gold))
    if gold_value is None:
        return Scored(0.0, ERROR)
    pred = last_number(response)
    if pred is None:
        return Scored(0.0, NO_ANSWER)
    if len(pred) > MAX_NUMBER_CHARS:
        return Scored(0.0, TOO_LONG)
    value = to_fraction(pred, max_chars=MAX_NUMBER_CHARS)
    return Scored(1.0 if value is not None and value == gold_value else 0.0)


def score_choice_letter(response: str, gold: str, metadata: dict[str, Any]) -> Scored:
    """1.0 when the response's final choice letter equals the gold letter (A-D by default)."""
    num_choices = len(metadata.get("choices") or ()) or 4
    gold_letter = str(gold).strip().upper()
    if len(gold_letter) != 1 or not ("A" <= gold_letter <= "J"):
        return Scored(0.0, ERROR)
    pred = last_choice_letter(response, num_choices=num_choices)
    if pred is None:
        return Scored(0.0, NO_ANSWER)
    return Scored(1.0 if pred == gold_letter else 0.0)
