"""Answer extraction from model responses: the last \\boxed{}, <answer> tags, a final letter, a last number.

Pure string functions, linear in the response length, no regex backtracking on hostile input
(every pattern here is either hand-scanned or anchored on a bounded alternation). They return
None when no answer is present; the caller decides what that scores.
"""
from __future__ import annotations

import re
from fractions import Fraction

_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces balanced.

    ``\\boxed 5`` (no braces, a single token) is accepted as MATH solutions occasionally use it.
    An unclosed last box returns None rather than falling back to an earlier one: a truncated
    response has no final answer.
    """
    start = -1
    cmd_len = 0
    for cmd in _BOXED_COMMANDS:
        i = text.rfind(cmd)
        if i > start:
            start, cmd_len = i, len(cmd)
    if start < 0:
        return None
    i = start + cmd_len
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # "\boxed 5" form: the token up to whitespace or "$".
        j = i
        while j < n and not text[j].isspace() and text[j] != "$":
            j += 1
        token = text[i:j]
        return token or None
    depth = 0
    for m in _BRACE_OR_ESCAPE.finditer(text, i):
        tok = m.group(0)
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : m.start()]
        # an escaped character (\{, \}, \\) never changes the depth
    return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, stripped; None when there is none.

    Found with rfind, not a lazy regex: ``(.*?)`` is quadratic on a response of many unclosed tags.
    """
    lower = text.lower()
    end = lower.rfind("</answer>")
    if end < 0:
        return None
    start = lower.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


# "Answer: C", "answer is (C)", "\boxed{C}", "**C**" ... ; the last standalone A-D letter wins.
# The cue is case-insensitive, the letter is not: "the answer is a function" names no choice.
_LETTER_CUES = re.compile(r"(?i:answer\s*(?:is|:)?\s*[:\-]?\s*\(?\s*|\\boxed\{\s*(?:\\text\{)?\s*)([A-J])\b")
_STANDALONE_LETTER = re.compile(r"(?<![A-Za-z0-9])\(?([A-D])\)?(?![A-Za-z0-9])")


def last_choice_letter(text: str, num_choices: int = 4) -> str | None:
    """The final multiple-choice letter in ``text`` (upper case), or None.

    An explicit cue ("answer: X", "answer is (X)", "\\boxed{X}") wins over a bare letter; among
    bare letters the last standalone capital A.. wins, so "A" inside words never counts.
    """
    valid = "ABCDEFGHIJ"[:num_choices]
    boxed = last_boxed(text)
    if boxed is not None:
        inner = boxed.replace("\\text{", "").replace("}", "").strip().strip("().").upper()
        if len(inner) == 1 and inner in valid:
            return inner
    cued = [m.group(1) for m in _LETTER_CUES.finditer(text)]
    cued = [c for c in cued if c in valid]
    if cued:
        return cued[-1]
    bare = [m.group(1) for m in _STANDALONE_LETTER.finditer(text) if m.group(1) in valid]
    return bare[-1] if bare else None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (thousands commas removed), or None.

    Integers, decimals and simple fractions ``a/b``; a trailing period is not part of it.
    """
    last = None
    for m in _NUMBER.finditer(text):
        last = m.group(0)
    if last is None:
        return None
    last = last.replace(",", "")
    return last or None


def to_fraction(number: str, max_chars: int = 64) -> Fraction | None:
    """Parse an extracted number (``-12``, ``3.50``, ``7/2``, ``1,000``) exactly; None if not a number.

    Bounded length so a 10^6-digit "number" cannot cost quadratic int parsing.
    """
    s = number.strip().replace(",", "").replace("$", "").rstrip(".")
    if not s or len(s) > max_chars:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
