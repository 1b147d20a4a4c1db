"""Tool calls in a policy's output text, in the formats chat templates teach.

``qwen`` (Qwen2.5, Qwen3; the Hermes format): each call is a JSON object inside tags, any number
of them, with free text around them::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2**10"}}
    </tool_call>

Qwen2.5's and Qwen3's chat templates render an assistant message's ``tool_calls`` exactly so (a
newline after the opening tag and before the closing one). A last ``<tool_call>`` without its
closing tag (generation stopped at ``</tool_call>`` as a stop string) is parsed to the end of text.

``llama3`` (Llama 3.1/3.2 JSON tool calling): the whole message is the call, optionally after
``<|python_tag|>``; several calls may follow each other, separated by ``;`` or whitespace::

    {"name": "calculator", "parameters": {"expression": "2**10"}}

A message that does not start with ``{`` holds no call (it is the final answer); text after the
last call is ignored.

Both formats accept ``arguments`` or ``parameters`` as the arguments key, and arguments given as a
string that holds a JSON object (OpenAI's wire form). ``parse_tool_calls`` returns, in order, one
``ToolCall`` per well-formed call and one ``UnparseableCall`` (with a message for the policy) per
span that was meant as a call but is not one; an empty list means the turn made no call.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from megatron_rl.agent.tools import ToolCall, UnparseableCall

ParsedCall = ToolCall | UnparseableCall

_QWEN_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LLAMA_PYTHON_TAG = "<|python_tag|>"
_MAX_QUOTED_CHARS = 200  # of the offending text quoted back in an UnparseableCall


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_QUOTED_CHARS else text[:_MAX_QUOTED_CHARS] + "..."


def _call_from_object(obj: Any, span: str, example: str) -> ParsedCall:
    """A ``ToolCall`` from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return UnparseableCall(span, f"expected a JSON object like {example}, got {_shorten(json.dumps(obj))}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return UnparseableCall(span, f"the call has no \"name\" string; expected {example}")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return UnparseableCall(span, f"the arguments of {name!r} are a string that is not a JSON object")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return UnparseableCall(span, f"the arguments of {name!r} must be a JSON object, got {_shorten(json.dumps(arguments))}")
    return ToolCall(name, arguments)


def _json_error(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "the JSON is nested too deeply"
    return f"invalid JSON ({exc})"


def parse_qwen_tool_calls(text: str) -> list[ParsedCall]:
    """Calls in ``<tool_call>...</tool_call>`` blocks (Qwen2.5 / Qwen3 / Hermes)."""
    example = '<tool_call>\n{"name": <tool name>, "arguments": {...}}\n</tool_call>'
    calls: list[ParsedCall] = []
    for match in _QWEN_CALL_RE.finditer(text):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as exc:
            calls.append(UnparseableCall(match.group(0), f"{_json_error(exc)} in {_shorten(body)!r}; expected {example}"))
            continue
        calls.append(_call_from_object(obj, match.group(0), example))
    return calls


def parse_llama3_tool_calls(text: str) -> list[ParsedCall]:
    """Calls as bare JSON objects making up the message (Llama 3.1 / 3.2 JSON tool calling)."""
    example = '{"name": <tool name>, "parameters": {...}}'
    body = text.strip()
    if body.startswith(_LLAMA_PYTHON_TAG):
        body = body[len(_LLAMA_PYTHON_TAG):].lstrip()
    calls: list[ParsedCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body) and body[pos] == "{":
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:
            calls.append(UnparseableCall(body[pos:], f"{_json_error(exc)} in {_shorten(body[pos:])!r}; expected {example}"))
            break
        calls.append(_call_from_object(obj, body[pos:end], example))
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls


TOOL_CALL_FORMATS: dict[str, Callable[[str], list[ParsedCall]]] = {
    "qwen": parse_qwen_tool_calls,
    "llama3": parse_llama3_tool_calls,
}


def parse_tool_calls(text: str, fmt: str = "qwen") -> list[ParsedCall]:
    """The calls in ``text`` in format ``fmt`` (one of ``TOOL_CALL_FORMATS``), in order."""
    try:
        parser = TOOL_CALL_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; valid: {', '.join(TOOL_CALL_FORMATS)}") from None
    return parser(text)
