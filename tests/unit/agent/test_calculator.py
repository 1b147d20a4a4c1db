"""The calculator tool: exact arithmetic from the ast, and hostile expressions refused at once."""
import re
import time

import pytest

from megatron_rl.agent.calculator import MAX_BITS, CalculatorError, calculate, calculator_tool
from megatron_rl.agent.tools import OK, TOOL_ERROR, ToolCall, ToolRegistry, execute_tool_call


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("2 ** 100", 2 ** 100),
    ("2 ** 3 ** 2", 512),  # right-associative, as in Python
    ("-2 ** 2", -4),
    ("7 / 2", 3.5),
    ("7 // 2", 3),
    ("-7 // 2", -4),
    ("-7 % 3", 2),
    ("2 ** -2", 0.25),
    ("0.1 + 0.2", 0.1 + 0.2),
    ("123456789012345678901234567890 * 987654321098765432109876543210",
     123456789012345678901234567890 * 987654321098765432109876543210),
    ("(3 ** 200) % 1000007", pow(3, 200, 1000007)),
    ("+5 - -5", 10),
    ("  1_000 + 1 ", 1001),
    ("-" * 999 + "1", -1),
    ("(" * 150 + "2" + ")" * 150, 2),
    ("+".join(["1"] * 1000), 1000),
])
def test_values(expression, value):
    result = calculate(expression)
    assert result == value and type(result) is type(value)


def test_tool_formats_exact_integers_and_floats():
    registry = ToolRegistry([calculator_tool()])
    big = execute_tool_call(registry, ToolCall("calculator", {"expression": "3 ** 500"}))
    assert big == type(big)(str(3 ** 500), OK)
    assert execute_tool_call(registry, ToolCall("calculator", {"expression": "1/4"})).text == "0.25"
    error = execute_tool_call(registry, ToolCall("calculator", {"expression": "1/0"}))
    assert error.outcome == TOOL_ERROR and error.text == "Error: division by zero"


@pytest.mark.parametrize("expression, message", [
    ("9**9**9", "exceeds the limit"),
    ("9**9**9**9", "exceeds the limit"),
    ("10**100000", "exceeds the limit"),
    ("(2**5000) * (2**5001)", "exceeds the limit"),
    ("2**9999 + 2**9999", "exceeds the limit"),
    ("2.0 ** 100000", "too large"),
    ("1e308 * 10", "not a finite"),
    ("(2**5000) / 3 ** -1", "too large"),
    ("(-8) ** 0.5", "complex"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2 ^ 3", "use ** for powers"),
    ("1 << 10000", "<<"),
    ("__import__('os').system('touch /tmp/pwned')", "Call is not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "names such as 'x'"),
    ("lambda: 0", "Lambda is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("'a' * 10", "not a number"),
    ("True + 1", "not a number"),
    ("1j", "not a number"),
    ("1 +", "invalid expression"),
    ("", "empty"),
    ("1 + 1\0", "invalid expression"),
    ("(" * 250 + "1" + ")" * 250, "nested parentheses"),
    ("1+" * 1500 + "1", "longer than"),
])
def test_hostile_or_invalid_expressions_fail_fast_with_a_message(expression, message):
    start = time.perf_counter()
    with pytest.raises(CalculatorError, match=re.escape(message)):
        calculate(expression)
    assert time.perf_counter() - start < 0.5


def test_limit_is_on_bits_not_on_the_number_of_operations():
    near = calculate("2 ** (%d - 1)" % MAX_BITS)
    assert isinstance(near, int) and near.bit_length() == MAX_BITS
    # a long chain of cheap operations on large operands stays fast
    start = time.perf_counter()
    calculate(" + ".join(["(2**9000 * 3)"] * 100) + " - 1")
    assert time.perf_counter() - start < 0.5
