"""A calculator tool: exact arithmetic on Python expressions, evaluated from the ``ast``, never
``eval``.

Grammar: integer and decimal literals, parentheses, unary ``+``/``-`` and the binary operators
``+ - * / // % **`` with Python's meaning (``/`` is true division: ``7/2`` is ``3.5``; integers
are exact at any size within the limit). Names, calls, attributes, ``^`` and everything else are
refused with a message that says what is allowed.

Limits, so that no expression can hang the process or exhaust its memory:

- the expression has at most ``MAX_EXPRESSION_CHARS`` characters (Python's parser refuses more
  than 200 nested parentheses);
- every integer, literal or intermediate, has at most ``MAX_BITS`` bits (about 3,000 digits). An
  integer power is refused *before* it is computed when its result would exceed that
  (``(bits(|base|) - 1) * exponent > MAX_BITS``), so ``9**9**9`` fails at once. With operands of at
  most ``MAX_BITS`` bits, every other operation costs microseconds;
- floats must stay finite; a complex result (``(-8) ** 0.5``) is refused.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable

from megatron_rl.agent.tools import Tool, ToolError

MAX_EXPRESSION_CHARS = 2000
MAX_BITS = 10_000

Number = int | float

_BINARY: dict[type, tuple[str, Callable[[Number, Number], Number]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_OPERATOR_NAMES = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|",
                   ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}
_ALLOWED = "numbers, parentheses and the operators + - * / // % **"


class CalculatorError(ToolError):
    """The expression is not allowed, breaks a limit, or has no finite real value."""


def _check(value: Number) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number; only real arithmetic is supported")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"a number exceeds the limit of {MAX_BITS} bits (about {int(MAX_BITS * math.log10(2))} digits)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > MAX_BITS:
            raise CalculatorError(f"{base} ** {exponent} exceeds the limit of {MAX_BITS} bits")
    return base ** exponent


def _apply(node: ast.BinOp, left: Number, right: Number) -> Number:
    symbol, fn = _BINARY[type(node.op)]
    try:
        return _check(_power(left, right) if symbol == "**" else fn(left, right))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError(f"the result of {symbol} is too large for a floating-point number") from None


def _refuse(node: ast.AST) -> CalculatorError:
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        name = _OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)
        return CalculatorError(f"the operator {name} is not supported; only {_ALLOWED} are allowed")
    if isinstance(node, ast.Name):
        return CalculatorError(f"names such as {node.id!r} are not allowed; only {_ALLOWED} are")
    if isinstance(node, ast.Constant):
        return CalculatorError(f"{node.value!r} is not a number; only {_ALLOWED} are allowed")
    return CalculatorError(f"{type(node).__name__} is not allowed; only {_ALLOWED} are")


def _evaluate(tree: ast.Expression) -> Number:
    """Post-order evaluation with an explicit stack: a long chain such as ``1+1+...+1`` is a deep
    tree, and no Python recursion limit should bound its length (the character limit does)."""
    stack: list[tuple[ast.AST, bool]] = [(tree.body, False)]
    values: list[Number] = []
    while stack:
        node, operands_done = stack.pop()
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            values.append(_check(node.value))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            if not operands_done:
                stack += [(node, True), (node.operand, False)]
            elif isinstance(node.op, ast.USub):
                values.append(-values.pop())
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            if not operands_done:
                stack += [(node, True), (node.right, False), (node.left, False)]
            else:
                right = values.pop()
                values.append(_apply(node, values.pop(), right))
        else:
            raise _refuse(node)
    assert len(values) == 1, values
    return values[0]


def calculate(expression: str) -> Number:
    """The value of an arithmetic expression (see the module docstring for what is allowed)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte, or an over-long int literal
        raise CalculatorError(f"invalid expression: {getattr(exc, 'msg', None) or exc}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression nests too deeply") from None
    return _evaluate(tree)


def _format(value: Number) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def calculator_tool(name: str = "calculator") -> Tool:
    def run(expression: str) -> str:
        try:
            return _format(calculate(expression))
        except CalculatorError as exc:
            raise CalculatorError(f"Error: {exc}") from None

    return Tool(
        name=name,
        description=("Evaluate an arithmetic expression exactly and return its value. Supports "
                     "integers of any size, decimals, parentheses and + - * / // % ** (Python "
                     "syntax: ** is power, / is true division)."),
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) ** 2 // 7"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=run,
    )
