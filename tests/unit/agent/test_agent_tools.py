"""The tool registry, argument validation and execution: every call ends in a response and an
outcome; failures are messages, never tracebacks; long outputs are cut with a marker."""
import threading
import time

import pytest

from megatron_rl.agent import Tool, ToolCall, ToolError, ToolExecutor, ToolRegistry, ToolResult, execute_tool_call
from megatron_rl.agent.tools import (BAD_ARGUMENTS, OK, OUTCOMES, OUTPUT_TRUNCATED, TIMEOUT, TOOL_ERROR,
                                     UNKNOWN_TOOL, truncate_text, validate_arguments)


def _tool(name="echo", fn=lambda **kw: str(kw), properties=None, required=(), extra=False):
    parameters = {"type": "object", "properties": properties or {"text": {"type": "string"}},
                  "required": list(required), "additionalProperties": extra}
    return Tool(name, f"the {name} tool", parameters, fn)


def test_schema_and_registry():
    tool = _tool(required=["text"])
    assert tool.schema() == {"type": "function", "function": {
        "name": "echo", "description": "the echo tool", "parameters": tool.parameters}}
    registry = ToolRegistry([tool, _tool("other")])
    assert registry.names() == ["echo", "other"] and "echo" in registry and len(registry) == 2
    assert registry.get("echo") is tool and registry.get("missing") is None
    assert [s["function"]["name"] for s in registry.schemas()] == ["echo", "other"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(_tool())
    with pytest.raises(ValueError, match="must match"):
        _tool("has space")
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", "d", {"type": "string"}, str)


@pytest.mark.parametrize("schema, value, error", [
    ({"type": "object", "required": ["a"]}, {}, "missing required argument 'a'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1.5}, "a must be of type integer, got number"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": True}, "got boolean"),
    ({"type": "object", "properties": {"a": {"type": "number"}}}, {"a": "1"}, "got string"),
    ({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}, {"a": 3}, "string or null"),
    ({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}, {"a": "z"}, "one of ['x', 'y']"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}},
     {"a": ["x", 2]}, "a[1] must be of type string"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "boolean"}},
                                             "required": ["b"]}}}, {"a": {}}, "a: missing required argument 'b'"),
    ({"type": "object", "properties": {}, "additionalProperties": False}, {"z": 1}, "unexpected argument 'z'"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"z": "1"}, "z must be of type integer"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, {"a": "abcd"}, "at most 3"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, {"a": -1}, "must be >= 0"),
])
def test_validation_names_the_offending_argument(schema, value, error):
    message = validate_arguments(schema, value)
    assert message is not None and error in message, message


def test_validation_accepts_what_the_schema_allows():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "number"}, "b": {"type": "array", "items": {"type": "integer"}},
        "c": {"type": ["string", "null"], "enum": ["x", None]}}}
    assert validate_arguments(schema, {"a": 1, "b": [1, 2], "c": None, "other": {}}) is None
    assert validate_arguments(schema, {"a": 2.5, "c": "x"}) is None


def test_each_failure_is_a_response_with_its_outcome():
    def raises(**kw):
        raise KeyError("secret_path/of/the/host")

    def tool_error(**kw):
        raise ToolError("Error: the service said no")

    def times_out(**kw):
        raise TimeoutError("gave up after 3 s")

    registry = ToolRegistry([_tool("raises", raises), _tool("refuses", tool_error), _tool("slow", times_out),
                             _tool("classifies", lambda **kw: ToolResult("partial", TIMEOUT)),
                             _tool("echo", required=["text"])])
    run = lambda name, args: execute_tool_call(registry, ToolCall(name, args))  # noqa: E731
    assert run("echo", {"text": "hi"}) == ToolResult("{'text': 'hi'}", OK)
    assert run("nope", {}).outcome == UNKNOWN_TOOL
    assert run("echo", {"text": 1}).outcome == BAD_ARGUMENTS
    result = run("raises", {})
    assert result == ToolResult("Error: KeyError: 'secret_path/of/the/host'", TOOL_ERROR)
    assert run("refuses", {}) == ToolResult("Error: the service said no", TOOL_ERROR)
    assert run("slow", {}) == ToolResult("Error: the tool timed out: gave up after 3 s", TIMEOUT)
    assert run("classifies", {}) == ToolResult("partial", TIMEOUT)
    deep: dict = {}
    for _ in range(5000):
        deep = {"text": deep}
    assert run("echo", deep).outcome == BAD_ARGUMENTS


def test_long_outputs_are_cut_keeping_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(10000))
    registry = ToolRegistry([_tool("big", lambda **kw: text)])
    result = execute_tool_call(registry, ToolCall("big", {}), max_output_chars=1000)
    assert result.outcome == OUTPUT_TRUNCATED and len(result.text) <= 1000
    assert result.text.startswith("line 0\nline 1\n") and result.text.endswith("line 9999\n")
    head, rest = result.text.split("\n...[")
    marker, tail = rest.split(" characters truncated]...\n")
    assert text.startswith(head) and text.endswith(tail) and len(head) + int(marker) + len(tail) == len(text)
    assert truncate_text("short", 10) == ("short", False)
    assert OUTCOMES == ("ok", "unparseable_call", "unknown_tool", "bad_arguments", "tool_error", "timeout",
                        "output_truncated")


def test_executor_runs_calls_concurrently_in_order():
    running, peak, lock = [0], [0], threading.Lock()

    def slow(text: str) -> str:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return text.upper()

    registry = ToolRegistry([_tool("slow", slow, required=["text"])])
    with ToolExecutor(registry, num_workers=4) as executor:
        start = time.perf_counter()
        results = executor.run([ToolCall("slow", {"text": c}) for c in "abcd"] + [ToolCall("missing", {})])
        elapsed = time.perf_counter() - start
    assert [r.text for r in results[:4]] == ["A", "B", "C", "D"] and results[4].outcome == UNKNOWN_TOOL
    assert peak[0] == 4 and elapsed < 1.0, (peak, elapsed)
    with pytest.raises(ValueError, match="num_workers"):
        ToolExecutor(registry, num_workers=0)
