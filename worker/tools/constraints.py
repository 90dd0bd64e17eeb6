"""A row's output grammar when it offers tools or thinks before a constrained answer: an xgrammar
structural tag for the engine's `structural_tag` (engine/structured_output).

- `required` / a named function: calls only (one for a named function or without
  `parallel_tool_calls`), each one's arguments held to its function's `parameters`;
- `auto`: free text, and once the format's trigger is written, calls held the same way (with a
  `response_format`: that JSON, or calls);
- `none`: free text that never starts a call (or the `response_format`'s JSON);
- a thinking model: any thinking first (at most the row's thinking budget), then the answer as above
  (never the thinking held to it).

None where nothing needs a structural tag: no tools and no thinking (a `response_format` alone
stays the engine's `json_schema`), or thinking before an unconstrained answer.
"""

from __future__ import annotations

from typing import Any

from bulkinfer.jobs.tool_calls import ToolRequest
from bulkinfer.worker.tools.formats import ToolFormat
from bulkinfer.worker.tools.reasoning import ThinkingState, thinking_prefix

JsonFormat = dict[str, Any]


def output_structural_tag(tools: ToolRequest | None, tool_format: ToolFormat | None, thinking: ThinkingState,
                          json_schema: dict[str, Any] | bool | None,
                          thinking_budget: int | None = None) -> dict[str, Any] | None:
    """The row's structural tag (see the module docstring); `json_schema`: the engine's form of its
    response_format (a schema, True for any object, None for text); `thinking_budget`: the most
    tokens the thinking may take (a structural tag even before a free-text answer)."""
    schema = None if json_schema is None else {"type": "json_schema", "max_whitespace_cnt": 1,
                                               "json_schema": json_schema if isinstance(json_schema, dict)
                                               else {"type": "object"}}
    answer = schema
    if tools is not None and tool_format is not None:
        answer = _tools_answer(tools, tool_format, schema)
    prefix = thinking_prefix(thinking, thinking_budget)
    if answer is None and prefix is not None and thinking_budget is not None:
        answer = {"type": "any_text"}
    if answer is None or (prefix is None and answer is schema):
        return None
    elements = [element for element in (prefix, answer) if element is not None]
    structure = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return {"type": "structural_tag", "format": structure}


def _tools_answer(tools: ToolRequest, tool_format: ToolFormat, schema: JsonFormat | None) -> JsonFormat:
    if tools.choice == "none":
        return schema or tool_format.text_only()
    tags = [tool_format.call_tag(function.name, function.parameters) for function in tools.callable]
    if tools.must_call:
        return tool_format.calls(tags, parallel=tools.parallel and tools.choice == "required")
    if schema is not None:
        return {"type": "or", "elements": [schema, tool_format.calls(tags, tools.parallel)]}
    return tool_format.text_or_calls(tags, tools.parallel)
