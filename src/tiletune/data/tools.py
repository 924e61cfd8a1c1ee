"""How tool descriptions and function calls are written into the prompt, per model family.

A `tools` value is the JSON list of function schemas from the dataset; a function-call message is
JSON `{"name": ..., "arguments": {...}}` (or a list of them, for parallel calls). Each format renders
them the way its model family was trained to read them (LLaMA-Factory's `tool_format` names).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from tiletune.errors import UserError

DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    '(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n'
    "```\n"
)

LLAMA3_TOOL_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tool_text}"
)

QWEN_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)

TOOL_FORMATS = ("default", "llama3", "mistral", "qwen")


def _as_function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"] if tool.get("type") == "function" else tool


def _wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _default_tools(tools: list[dict[str, Any]]) -> str:
    tool_text = ""
    for tool in map(_as_function, tools):
        params = tool.get("parameters", {})
        param_text = ""
        for name, param in params.get("properties", {}).items():
            required = ", required" if name in params.get("required", []) else ""
            enum = ", should be one of [{}]".format(", ".join(param["enum"])) if param.get("enum") else ""
            items = f", where each item should be {param['items'].get('type', '')}" if param.get("items") else ""
            param_text += f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}{enum}{items}\n"
        tool_text += f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\nTool Args:\n{param_text}\n"
    names = ", ".join(tool["name"] for tool in map(_as_function, tools))
    return DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=names)


def tool_prompt_date(tool_format: str) -> str | None:
    """Today's date as the family's tool prompt writes it, or None where the prompt has no date (Llama 3's has)."""
    return datetime.now().strftime("%d %b %Y") if tool_format == "llama3" else None


def _llama3_tools(tools: list[dict[str, Any]]) -> str:
    tool_text = "".join(json.dumps(_wrapped(t), indent=4, ensure_ascii=False) + "\n\n" for t in tools)
    return LLAMA3_TOOL_PROMPT.format(date=tool_prompt_date("llama3"), tool_text=tool_text)


def _qwen_tools(tools: list[dict[str, Any]]) -> str:
    tool_text = "".join("\n" + json.dumps(_wrapped(t), ensure_ascii=False) for t in tools)
    return QWEN_TOOL_PROMPT.format(tool_text=tool_text)


def _mistral_tools(tools: list[dict[str, Any]]) -> str:
    return "[AVAILABLE_TOOLS] " + json.dumps([_wrapped(t) for t in tools], ensure_ascii=False) + "[/AVAILABLE_TOOLS]"


def format_tools(tool_format: str, tools_json: str) -> str:
    """The system-prompt text describing `tools_json` (a JSON list of function schemas), or ''."""
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as err:
        raise UserError(f"tool description is not valid JSON ({err.msg}): {tools_json[:80]!r}") from None
    if not tools:
        return ""
    formats = {"default": _default_tools, "llama3": _llama3_tools, "mistral": _mistral_tools, "qwen": _qwen_tools}
    return formats[tool_format](tools)


def format_function_call(tool_format: str, content: str) -> str:
    """A function-call message's content, as the model family writes a call."""
    try:
        calls = json.loads(content)
        calls = calls if isinstance(calls, list) else [calls]
        pairs = [(call["name"], call["arguments"]) for call in calls]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"function-call message is not JSON with 'name' and 'arguments': {content[:80]!r}") from None
    if tool_format == "llama3":
        objects = [{"name": name, "parameters": args} for name, args in pairs]
        return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)
    if tool_format == "mistral":  # always a list, even for one call
        return json.dumps([{"name": name, "arguments": args} for name, args in pairs], ensure_ascii=False)
    if tool_format == "qwen":
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
            for name, args in pairs
        )
    return "\n".join(f"Action: {name}\nAction Input: {json.dumps(args, ensure_ascii=False)}" for name, args in pairs)
