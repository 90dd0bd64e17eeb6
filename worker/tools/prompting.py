"""Tools for a chat template that cannot render them (SmolLM2's, for one), in the format the
deployment gave the model: the functions as a system message in that format's own words, earlier
calls as the assistant's text in its syntax, and tool results as user turns (as vLLM does with a
`--chat-template` written for the parser). Templates that read `tools` get them as they are.
"""

from __future__ import annotations

import json
from typing import Any

from bulkinfer.worker.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat

INSTRUCTIONS = {
    HERMES.name: (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
        "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}}\n</tool_call>"),
    LLAMA3_JSON.name: (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\nRespond in the format {{\"name\": function name, "
        "\"parameters\": dictionary of argument name and its value}}. Do not use variables.\n\n{tools}"),
    MISTRAL.name: (
        "You can call these functions:\n{tools}\n\nTo call functions, answer with [TOOL_CALLS] and a JSON "
        "list of calls: [TOOL_CALLS][{{\"name\": <function-name>, \"arguments\": <args-json-object>}}]"),
}


def messages_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                        tool_format: ToolFormat) -> list[dict[str, Any]]:
    """`messages` for a template without tools: the functions in the (first) system message, calls
    and results as text."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    instructions = INSTRUCTIONS[tool_format.name].format(tools=listed)
    rendered = [_as_text(message, tool_format) for message in messages]
    if rendered and rendered[0].get("role") == "system":
        first = rendered[0]
        content = f"{first.get('content') or ''}\n\n{instructions}".lstrip()
        return [{**first, "content": content}, *rendered[1:]]
    return [{"role": "system", "content": instructions}, *rendered]


def _as_text(message: dict[str, Any], tool_format: ToolFormat) -> dict[str, Any]:
    role = message.get("role")
    if role == "tool":
        content = message.get("content") or ""
        if tool_format is HERMES:
            content = f"<tool_response>\n{content}\n</tool_response>"
        return {"role": "user", "content": content}
    calls = message.get("tool_calls")
    if role != "assistant" or not calls:
        return message
    written = call_text([(call["function"]["name"], call["function"]["arguments"]) for call in calls],
                        tool_format)
    text = message.get("content") or ""
    kept = {key: value for key, value in message.items() if key != "tool_calls"}
    return {**kept, "content": f"{text}\n{written}".strip() if text else written}


def call_text(calls: list[tuple[str, Any]], tool_format: ToolFormat) -> str:
    """Calls written as the format forces them (arguments: an object, or its JSON text)."""
    objects = [(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
               for name, arguments in calls]
    pieces = [tool_format.name_prefix + name + tool_format.arguments_prefix + arguments + tool_format.call_end
              for name, arguments in objects]
    text = tool_format.separator.join(pieces)
    return f"{tool_format.list_begin}{text}{tool_format.list_end}" if tool_format.list_begin else text
