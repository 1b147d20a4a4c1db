"""Countdown checker: the project's own, safe replacement for reasoning-gym's sympy-based scorer.

reasoning-gym's ``CountdownDataset.score_answer`` hands the answer to sympy ``parse_expr`` (an
``eval``): a crafted answer can run code and ``9**9**9**9`` hangs. Here the answer goes through a
hand-written recursive-descent parser over a whitelisted grammar, evaluated exactly with
``Fraction``::

    equation := expr [ "=" integer ]          # an optional "= target" suffix is tolerated
    expr     := term  (("+" | "-") term)*
    term     := atom  (("*" | "/") atom)*
    atom     := integer | "(" expr ")" | "-" atom

Only + - * / on the given numbers (``x``/``×`` and ``÷`` are read as * and /). A unary minus is
accepted (reasoning-gym's own solutions write ``-50 + ...``; it makes nothing solvable that
``... - 50`` does not); no exponent, no decimals, so values stay bounded by the input length. Limits: the
answer is at most ``MAX_ANSWER_CHARS`` characters, parentheses nest at most ``MAX_DEPTH``
deep, a literal has at most ``MAX_DIGITS`` digits.

Rules (the Countdown game as in TinyZero and the paper): each given number may be used **at
most once** (a multiset check: a number given twice may be used twice), and not all of them
need to be used; ``require_all=True`` asks for every number exactly once, as reasoning-gym's
own scorer does. A number that was not given, a reused number, division by zero or a value
other than the target scores 0. A correct equation scores 1.0; with ``format_reward > 0`` a
well-formed but wrong equation inside ``<answer>`` tags scores ``format_reward`` (default 0).
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any

from megatron_rl.rewards.extract import last_answer_tag
from megatron_rl.rewards.types import ERROR, NO_ANSWER, TOO_LONG, Scored

MAX_ANSWER_CHARS = 256
MAX_DEPTH = 32
MAX_DIGITS = 12

_TRANSLATE = str.maketrans({"×": "*", "x": "*", "X": "*", "÷": "/", "−": "-", "\u2217": "*"})


class CountdownSyntaxError(ValueError):
    """The answer is not an equation of the whitelisted grammar (or breaks a limit)."""


class _Parser:
    def __init__(self, text: str):
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.numbers: list[int] = []

    @staticmethod
    def _tokenize(text: str) -> list[str]:
        tokens = []
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if c.isspace():
                i += 1
            elif c in "+-*/()=":
                tokens.append(c)
                i += 1
            elif "0" <= c <= "9":
                j = i
                while j < n and "0" <= text[j] <= "9":
                    j += 1
                if j - i > MAX_DIGITS:
                    raise CountdownSyntaxError(f"number literal longer than {MAX_DIGITS} digits")
                tokens.append(text[i:j])
                i = j
            else:
                raise CountdownSyntaxError(f"character {c!r} is not allowed")
        return tokens

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        tok = self._peek()
        if tok is None:
            raise CountdownSyntaxError("unexpected end of expression")
        self.pos += 1
        return tok

    def equation(self) -> tuple[Fraction, int | None]:
        value = self.expr(0)
        rhs = None
        if self._peek() == "=":
            self._take()
            tok = self._take()
            if not tok.isdigit():
                raise CountdownSyntaxError("'=' must be followed by an integer")
            rhs = int(tok)
        if self._peek() is not None:
            raise CountdownSyntaxError(f"unexpected token {self._peek()!r}")
        return value, rhs

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.atom(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            rhs = self.atom(depth)
            if op == "*":
                value = value * rhs
            else:
                if rhs == 0:
                    raise CountdownSyntaxError("division by zero")
                value = value / rhs
        return value

    def atom(self, depth: int) -> Fraction:
        tok = self._take()
        if tok == "-":
            if depth + 1 > MAX_DEPTH:
                raise CountdownSyntaxError(f"expression nested deeper than {MAX_DEPTH}")
            return -self.atom(depth + 1)
        if tok == "(":
            if depth + 1 > MAX_DEPTH:
                raise CountdownSyntaxError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr(depth + 1)
            if self._take() != ")":
                raise CountdownSyntaxError("missing ')'")
            return value
        if tok.isdigit():
            self.numbers.append(int(tok))
            return Fraction(int(tok))
        raise CountdownSyntaxError(f"unexpected token {tok!r}")


def evaluate_equation(answer: str) -> tuple[Fraction, list[int], int | None]:
    """Parse and evaluate ``answer`` exactly: (value, number literals used, "= N" right side or None).

    Raises CountdownSyntaxError for anything outside the grammar or its limits.
    """
    if len(answer) > MAX_ANSWER_CHARS:
        raise CountdownSyntaxError(f"answer longer than {MAX_ANSWER_CHARS} characters")
    parser = _Parser(answer.translate(_TRANSLATE))
    if not parser.tokens:
        raise CountdownSyntaxError("empty expression")
    value, rhs = parser.equation()
    return value, parser.numbers, rhs


def check_countdown(answer: str, numbers: list[int], target: int, require_all: bool = False) -> bool:
    """True when ``answer`` is a valid equation over ``numbers`` whose value is exactly ``target``."""
    try:
        value, used, rhs = evaluate_equation(answer)
    except CountdownSyntaxError:
        return False
    if rhs is not None and rhs != target:
        return False
    given, taken = Counter(numbers), Counter(used)
    if require_all:
        if taken != given:
            return False
    elif any(taken[k] > given[k] for k in taken):
        return False
    return value == target


def score_countdown(
    response: str,
    gold: str,
    metadata: dict[str, Any],
    *,
    format_reward: float = 0.0,
    require_all: bool = False,
) -> Scored:
    """Reward of a response to a Countdown prompt. ``gold`` is the target; numbers in metadata."""
    try:
        numbers = [int(x) for x in metadata["numbers"]]
        target = int(metadata.get("target", gold))
    except (KeyError, TypeError, ValueError):
        return Scored(0.0, ERROR)
    answer = last_answer_tag(response)
    if answer is None:
        return Scored(0.0, NO_ANSWER)
    if len(answer) > MAX_ANSWER_CHARS:
        return Scored(0.0, TOO_LONG)
    if check_countdown(answer, numbers, target, require_all=require_all):
        return Scored(1.0)
    if format_reward:
        try:
            evaluate_equation(answer)
            return Scored(float(format_reward))
        except CountdownSyntaxError:
            pass
    return Scored(0.0)
