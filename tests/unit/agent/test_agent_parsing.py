"""Tool calls parsed from model output (Qwen/Hermes tags, Llama 3.1 JSON) and executed: good
calls, several calls, unparseable text, unknown tools and wrong arguments, each with its outcome."""
import json

import pytest

from megatron_rl.agent import (ToolCall, ToolRegistry, UnparseableCall, calculator_tool,
                               execute_tool_call, parse_tool_calls)
from megatron_rl.agent.tools import BAD_ARGUMENTS, OK, UNKNOWN_TOOL, UNPARSEABLE_CALL

# The assistant tool-call and tools-list rendering of Qwen2.5's chat template, restated: each call
# on its own lines as '<tool_call>\n{"name": "<name>", "arguments": <arguments | tojson>}\n</tool_call>'.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for tc in m.tool_calls %}{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tc.name }}{{- '\", \"arguments\": ' }}"
    "{{- tc.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)


def test_calls_rendered_by_a_qwen_chat_template_parse_back():
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    calls = [ToolCall("calculator", {"expression": "2 ** 10"}),
             ToolCall("python", {"code": "print('héllo \"quoted\"')\nfor i in range(3):\n    print(i)"})]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Let me compute.",
                 "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                for c in calls]}]
    registry = ToolRegistry([calculator_tool()])
    rendered = render([messages], tools=registry.schemas(), chat_template=QWEN_STYLE_TEMPLATE)[0][0]
    # the registry's schemas go through the template's tools list unchanged
    tools_block = rendered.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in tools_block.splitlines()] == registry.schemas()
    assistant = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert assistant.startswith("Let me compute.\n<tool_call>\n{\"name\": \"calculator\"")
    assert parse_tool_calls(assistant, "qwen") == calls


def test_qwen_several_calls_with_text_around_and_an_unclosed_last_call():
    text = ('I will call two tools.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            'and then\n<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>\n'
            '<tool_call>\n{"name": "c", "parameters": {}}')  # stopped at the </tool_call> stop string
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]
    assert parse_tool_calls("The answer is 42.") == []


@pytest.mark.parametrize("body, message", [
    ('{"name": "a", "arguments": {"x": 1}', "invalid JSON"),
    ("calculator(2+2)", "invalid JSON"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": 3}', 'no "name"'),
    ('["a", {}]', "expected a JSON object"),
    ('{"name": "a", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "a", "arguments": "not json"}', "not a JSON object"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_qwen_unparseable_calls_keep_their_place_with_a_message(body, message):
    text = f'<tool_call>\n{{"name": "ok", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n{body}\n</tool_call>'
    good, bad = parse_tool_calls(text, "qwen")
    assert good == ToolCall("ok", {})
    assert isinstance(bad, UnparseableCall) and message in bad.message, bad
    assert bad.text.startswith("<tool_call>") and len(bad.message) < 600


def test_llama3_json_calls():
    assert parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1+1"}}', "llama3") == \
        [ToolCall("calculator", {"expression": "1+1"})]
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}<|eom_id|>'
    assert parse_tool_calls(text, "llama3") == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse_tool_calls("The sum is 2.", "llama3") == []
    assert parse_tool_calls('  {"name": "a", "parameters": {}}\n\nDone.', "llama3") == [ToolCall("a", {})]
    (bad,) = parse_tool_calls('{"name": "a", "parameters": {"x": }', "llama3")
    assert isinstance(bad, UnparseableCall) and "invalid JSON" in bad.message


def test_unknown_format_names_the_valid_ones():
    with pytest.raises(ValueError, match="qwen, llama3"):
        parse_tool_calls("", "hermes2")


def test_parsed_calls_execute_with_an_outcome_each():
    registry = ToolRegistry([calculator_tool()])
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": 42}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1", "precision": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator" "arguments": {}}\n</tool_call>')
    results = [execute_tool_call(registry, call) for call in parse_tool_calls(text)]
    assert [r.outcome for r in results] == [OK, UNKNOWN_TOOL, BAD_ARGUMENTS, BAD_ARGUMENTS, BAD_ARGUMENTS,
                                            UNPARSEABLE_CALL]
    assert results[0].text == "42"
    assert results[1].text == "Error: unknown tool 'search'. Available tools: calculator."
    assert "expression must be of type string, got integer" in results[2].text
    assert "missing required argument 'expression'" in results[3].text
    assert "unexpected argument 'precision'" in results[4].text
    assert results[5].text.startswith("Error: the tool call could not be parsed: invalid JSON")
