"""Tools for agentic (multi-turn, tool-using) RL: a registry of tools in the OpenAI function
convention, parsers for the tool calls of Qwen and Llama chat formats, a safe calculator and a
Python interpreter that runs each call in a bubblewrap sandbox.

    from megatron_rl.agent import (ToolExecutor, ToolRegistry, calculator_tool, parse_tool_calls,
                                   python_tool)
    registry = ToolRegistry([calculator_tool(), python_tool()])
    prompt = tokenizer.apply_chat_template(messages, tools=registry.schemas(), ...)
    with ToolExecutor(registry) as executor:
        results = executor.run(parse_tool_calls(completion, "qwen"))  # ToolResult(text, outcome)
"""
from megatron_rl.agent.calculator import calculate, calculator_tool
from megatron_rl.agent.parsing import TOOL_CALL_FORMATS, parse_tool_calls
from megatron_rl.agent.sandbox import (PythonSandbox, SandboxLimits, SandboxResult,
                                       SandboxUnavailable, python_tool)
from megatron_rl.agent.tools import (OUTCOMES, Tool, ToolCall, ToolError, ToolExecutor, ToolRegistry,
                                     ToolResult, UnparseableCall, execute_tool_call)

__all__ = ["OUTCOMES", "TOOL_CALL_FORMATS", "PythonSandbox", "SandboxLimits", "SandboxResult",
           "SandboxUnavailable", "Tool", "ToolCall", "ToolError", "ToolExecutor", "ToolRegistry",
           "ToolResult", "UnparseableCall", "calculate", "calculator_tool", "execute_tool_call",
           "parse_tool_calls", "python_tool"]
