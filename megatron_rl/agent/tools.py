"""Tools a policy can call: schemas in the OpenAI function convention, a registry by name, and one
function that executes a parsed call and always answers with a tool response and an outcome.

A tool is a name, a description, a JSON-schema ``parameters`` object and a Python callable that
takes the parsed arguments as keywords and returns text::

    registry = ToolRegistry([calculator_tool()])
    tokenizer.apply_chat_template(messages, tools=registry.schemas(), ...)
    result = execute_tool_call(registry, ToolCall("calculator", {"expression": "2**100"}))
    result.text, result.outcome        # "1267650600228229401496703205376", "ok"

``execute_tool_call`` never raises for the call's sake. Its ``outcome`` (one of ``OUTCOMES``) is
for metrics:

- ``ok``: the tool ran and answered.
- ``unparseable_call``: the model's text did not parse as a call (see ``parsing.py``).
- ``unknown_tool``: no tool of that name is registered.
- ``bad_arguments``: the arguments break the tool's schema (a required key missing, a wrong type,
  an unexpected key when ``additionalProperties`` is false, ...).
- ``tool_error``: the tool raised; the response is the exception's message, never a traceback
  (which would show host paths to the policy).
- ``timeout``: the tool ran past its own time limit (it raised ``TimeoutError`` or said so).
- ``output_truncated``: the tool answered with more than ``max_output_chars`` characters; the
  response keeps the head and the tail around a marker saying how much was cut.

Arguments are checked against the schema with a small validator (no ``jsonschema`` dependency) for
the subset tool schemas use: ``type`` (a name or a list of names), ``properties``, ``required``,
``additionalProperties`` (a boolean or a schema), ``items``, ``enum``, ``minLength``/``maxLength``
and ``minimum``/``maximum``. Other keywords are accepted and not checked.

In-process tools cannot be pre-empted: a tool that may run long must bound itself (the Python
interpreter tool runs each call in a sandboxed process with a wall-clock limit, the calculator
bounds its numbers). ``ToolExecutor`` runs many calls at once on daemon threads, so one episode's
slow call does not hold another's.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from megatron_rl.rollout.threads import BackgroundThreads

OK = "ok"
UNPARSEABLE_CALL = "unparseable_call"
UNKNOWN_TOOL = "unknown_tool"
BAD_ARGUMENTS = "bad_arguments"
TOOL_ERROR = "tool_error"
TIMEOUT = "timeout"
OUTPUT_TRUNCATED = "output_truncated"
OUTCOMES = (OK, UNPARSEABLE_CALL, UNKNOWN_TOOL, BAD_ARGUMENTS, TOOL_ERROR, TIMEOUT, OUTPUT_TRUNCATED)

DEFAULT_MAX_OUTPUT_CHARS = 8192

# OpenAI's rule for function names; chat templates also print them unescaped.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(Exception):
    """A tool's own failure; its message is shown to the policy as the tool response."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UnparseableCall:
    """A span of model output that was meant as a tool call but does not parse as one."""

    text: str
    message: str


@dataclass(frozen=True)
class ToolResult:
    """The tool response shown to the policy and its outcome (one of ``OUTCOMES``)."""

    text: str
    outcome: str

    def __post_init__(self):
        assert self.outcome in OUTCOMES, self.outcome


@dataclass(frozen=True)
class Tool:
    """A callable tool. ``fn(**arguments)`` returns the response text, or a ``ToolResult`` when the
    tool classifies its own outcome (the sandbox does: timeout, output cut); it may raise
    ``ToolError`` (message shown as is), ``TimeoutError`` (outcome timeout) or anything else
    (outcome tool_error, ``"Error: <type>: <message>"`` shown)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str | ToolResult]

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {_NAME_RE.pattern}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with "
                             f"type 'object', got {self.parameters!r}")

    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {name, description, parameters}}``, the form a chat
        template's ``tools=`` argument and the OpenAI API take."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": self.parameters}}


class ToolRegistry:
    """Tools by name; ``schemas()`` is the list for a chat template's ``tools=`` argument."""

    def __init__(self, tools: Iterable[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)


# ---- arguments against a JSON schema (the subset tools use) ----------------------------------

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _child(path: str, key: str) -> str:
    return key if path == "arguments" else f"{path}.{key}"


def validate_arguments(schema: dict[str, Any], value: Any, path: str = "arguments") -> str | None:
    """The first way ``value`` breaks ``schema`` as a sentence naming the offending key, or None."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in names):
            return f"{path} must be of type {' or '.join(names)}, got {_json_type(value)}"
    if "enum" in schema and not any(value == e and type(value) is type(e) for e in schema["enum"]):
        return f"{path} must be one of {schema['enum']!r}, got {value!r}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{path} must have at least {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{path} must have at most {schema['maxLength']} characters, got {len(value)}"
    if _JSON_TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path} must be >= {schema['minimum']}, got {value!r}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path} must be <= {schema['maximum']}, got {value!r}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                return f"{path}: missing required argument {key!r}"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                error = validate_arguments(properties[key], item, _child(path, key))
            elif extra is False:
                allowed = ", ".join(properties) or "none"
                return f"{path}: unexpected argument {key!r} (allowed: {allowed})"
            elif isinstance(extra, dict):
                error = validate_arguments(extra, item, _child(path, key))
            else:
                error = None
            if error:
                return error
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if error := validate_arguments(schema["items"], item, f"{path}[{i}]"):
                return error
    return None


# ---- execution --------------------------------------------------------------------------------

def truncate_text(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to at most ``max_chars`` characters, keeping the head and the tail (a program's
    last lines often hold its answer) around a marker with the number of characters cut."""
    if len(text) <= max_chars:
        return text, False
    marker = "\n...[{} characters truncated]...\n"
    room = max(0, max_chars - len(marker.format(len(text))))
    head, tail = room - room // 3, room // 3
    cut = len(text) - head - tail
    return text[:head] + marker.format(cut) + (text[len(text) - tail:] if tail else ""), True


def _argument_error(tool: Tool, arguments: Any) -> str | None:
    try:
        return validate_arguments(tool.parameters, arguments)
    except RecursionError:
        return "arguments nested too deeply"


def execute_tool_call(registry: ToolRegistry, call: ToolCall | UnparseableCall,
                      *, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> ToolResult:
    """Run one parsed call. Always returns a response for the policy and an outcome; never raises
    for the call's sake (an ``Exception`` from the tool is reported, not propagated)."""
    if isinstance(call, UnparseableCall):
        result = ToolResult(f"Error: the tool call could not be parsed: {call.message}", UNPARSEABLE_CALL)
    elif (tool := registry.get(call.name)) is None:
        available = ", ".join(registry.names()) or "none"
        result = ToolResult(f"Error: unknown tool {call.name!r}. Available tools: {available}.", UNKNOWN_TOOL)
    elif (error := _argument_error(tool, call.arguments)) is not None:
        result = ToolResult(f"Error: invalid arguments for tool {call.name!r}: {error}", BAD_ARGUMENTS)
    else:
        try:
            answer = tool.fn(**call.arguments)
            result = answer if isinstance(answer, ToolResult) else ToolResult(str(answer), OK)
        except ToolError as exc:
            result = ToolResult(str(exc), TOOL_ERROR)
        except TimeoutError as exc:
            result = ToolResult(f"Error: the tool timed out{': ' + str(exc) if str(exc) else ''}", TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is a response, not a crash
            result = ToolResult(f"Error: {type(exc).__name__}: {exc}", TOOL_ERROR)
    text, cut = truncate_text(result.text, max_output_chars)
    if cut:
        return ToolResult(text, OUTPUT_TRUNCATED if result.outcome == OK else result.outcome)
    return result


class ToolExecutor:
    """Runs tool calls concurrently on ``num_workers`` daemon threads (each sandboxed call is its
    own process, so this is also the number of sandboxes alive at once).

    ``submit`` returns a ``concurrent.futures.Future`` of a ``ToolResult`` (``asyncio.wrap_future``
    makes it awaitable); ``run`` executes a batch, results in input order. ``close()`` (or the
    context manager) stops the threads after the calls already submitted.
    """

    def __init__(self, registry: ToolRegistry, num_workers: int | None = None,
                 *, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS):
        if num_workers is None:
            num_workers = max(2, min(8, os.cpu_count() or 2))
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_output_chars < 64:
            raise ValueError(f"max_output_chars must be >= 64, got {max_output_chars}")
        self.registry = registry
        self.max_output_chars = max_output_chars
        self._threads = BackgroundThreads(num_workers, name="tools")

    def submit(self, call: ToolCall | UnparseableCall) -> concurrent.futures.Future:
        return self._threads.submit(self._execute, call)

    def run(self, calls: Sequence[ToolCall | UnparseableCall]) -> list[ToolResult]:
        futures = [self.submit(call) for call in calls]
        return [f.result() for f in futures]

    def _execute(self, call: ToolCall | UnparseableCall) -> ToolResult:
        return execute_tool_call(self.registry, call, max_output_chars=self.max_output_chars)

    def close(self) -> None:
        self._threads.shutdown(wait=True)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
