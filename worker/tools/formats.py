"""How a model writes tool calls: the syntax of one format, the grammar pieces that force it and the
parser that reads it back (one table, so what is forced is exactly what is parsed).

- `hermes` (Hermes, Qwen 2.5/3, SmolLM3): `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`,
  calls one per block, a newline apart;
- `llama3_json` (Llama 3.1-3.3): one `{"name": …, "parameters": {…}}` object (`<|python_tag|>` may
  precede it); one call per answer, as its template allows;
- `mistral` (Mistral v3 tokenizers): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`.

A model's format comes from its chat template's own markers, or from the deployment
(`tool_call_formats`, as vLLM's `--tool-call-parser`), for templates that have none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

JsonFormat = dict[str, Any]


class ToolCallsUnreadable(ValueError):
    """The output started a call it did not finish (cut at max_tokens) or wrote one that does not parse."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that starts the calls (free text before it in `auto`)
    call_open: str  # before a call's JSON object, as parsed ("" where the trigger is the object's start)
    call_close: str  # after it
    name_prefix: str  # a call's text up to its function's name, as forced
    arguments_prefix: str  # between the name and the arguments object
    call_end: str  # after the arguments object
    separator: str  # between two calls
    list_begin: str = ""  # around all the calls (Mistral's JSON list)
    list_end: str = ""
    parallel: bool = True  # the format can hold more than one call
    arguments_key: str = "arguments"
    markers: tuple[str, ...] = ()  # left out of the answer's text around the calls

    # ---- grammar -------------------------------------------------------------------------------

    def call_tag(self, name: str, parameters: dict[str, Any] | None) -> JsonFormat:
        schema: dict[str, Any] | bool = parameters if parameters is not None else {"type": "object"}
        return {"type": "tag", "begin": f'{self.name_prefix}{name}{self.arguments_prefix}',
                # one whitespace at most between tokens: a weak model cannot pad an argument forever
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                "end": self.call_end}

    def calls(self, tags: list[JsonFormat], parallel: bool) -> JsonFormat:
        """One call or more (one only without `parallel`), and nothing else."""
        several = parallel and self.parallel
        body: JsonFormat = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                            "at_least_one": True, "stop_after_first": not several}
        if self.list_begin:
            return {"type": "tag", "begin": self.list_begin, "content": body, "end": self.list_end}
        return body

    def text_or_calls(self, tags: list[JsonFormat], parallel: bool) -> JsonFormat:
        """Free text, and once the trigger is written, calls held to their functions."""
        if self.list_begin:  # one list of calls, opened by the trigger: `calls` is that list's tag
            listed = self.calls(tags, parallel)
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [listed],
                    "stop_after_first": True}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                "stop_after_first": not (parallel and self.parallel)}

    def text_only(self) -> JsonFormat:
        """Free text that never starts a call (`tool_choice: none`)."""
        return {"type": "any_text", "excludes": [self.trigger]}

    # ---- parsing -------------------------------------------------------------------------------

    def split(self, text: str, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """(the text around the calls, the calls); raises `ToolCallsUnreadable`. Lenient about
        whitespace, as text the grammar did not hold (an `auto` answer) may vary it. `cut`: the
        output ended at max_tokens, and the calls finished before an unfinished last one stand
        (the caller reports finish_reason `length`); with none finished, it raises."""
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        if self.list_begin:
            return self._split_list(text, start)
        calls: list[ParsedCall] = []
        outside = [text[:start]]
        position = start
        while position >= 0:
            try:
                value, cursor = self._call_at(text, position)
            except ToolCallsUnreadable:
                if cut and calls:  # the unfinished call is left out; the text before it stays
                    break
                raise
            calls.append(self._call(value))
            position = text.find(self.trigger, cursor)
            outside.append(text[cursor:position] if position >= 0 else text[cursor:])
        content = "".join(outside)
        for marker in self.markers:
            content = content.replace(marker, "")
        return content.strip(), calls

    def _call_at(self, text: str, position: int) -> tuple[Any, int]:
        """The JSON object of the call starting at `position`, and where its closing marker ends."""
        value, cursor = _json_at(text, position + len(self.call_open), self.name)
        if self.call_close:
            cursor = _skip_space(text, cursor)
            if not text.startswith(self.call_close, cursor):
                raise ToolCallsUnreadable(f"a {self.name} tool call does not end with {self.call_close!r}")
            cursor += len(self.call_close)
        return value, cursor

    def _split_list(self, text: str, start: int) -> tuple[str, list[ParsedCall]]:
        values, end = _json_at(text, start + len(self.trigger), self.name)
        if not isinstance(values, list):
            raise ToolCallsUnreadable(f"{self.trigger} is not followed by a JSON list of calls")
        return (text[:start] + text[end:]).strip(), [self._call(value) for value in values]

    def _call(self, value: Any) -> ParsedCall:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ToolCallsUnreadable(f"a {self.name} tool call is not an object with a name")
        arguments = value.get(self.arguments_key, value.get("arguments", value.get("parameters")))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallsUnreadable(f"the arguments of {value['name']!r} are not JSON") from None
        if not isinstance(arguments, dict):
            raise ToolCallsUnreadable(f"the arguments of {value['name']!r} are not an object")
        return ParsedCall(value["name"], arguments)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _json_at(text: str, position: int, format_name: str) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text, _skip_space(text, position))
    except json.JSONDecodeError:
        raise ToolCallsUnreadable(f"a {format_name} tool call is cut off or its JSON does not "
                                  "parse") from None


HERMES = ToolFormat("hermes", trigger="<tool_call>", call_open="<tool_call>", call_close="</tool_call>",
                    name_prefix='<tool_call>\n{"name": "', arguments_prefix='", "arguments": ',
                    call_end="}\n</tool_call>", separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", trigger='{"name": ', call_open="", call_close="",
                         name_prefix='{"name": "', arguments_prefix='", "parameters": ', call_end="}",
                         separator="", parallel=False, arguments_key="parameters",
                         markers=("<|python_tag|>",))
MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", call_open="", call_close="", name_prefix='{"name": "',
                     arguments_prefix='", "arguments": ', call_end="}", separator=", ",
                     list_begin="[TOOL_CALLS][", list_end="]")
FORMATS = {tool_format.name: tool_format for tool_format in (HERMES, LLAMA3_JSON, MISTRAL)}
# A template's own markers → its format, checked in this order.
TEMPLATE_MARKERS = (("[TOOL_CALLS]", MISTRAL), ("<tool_call>", HERMES), ("<|python_tag|>", LLAMA3_JSON))
TOOLS_VARIABLE = re.compile(r"\btools\b")


def template_tool_format(template: str | None) -> ToolFormat | None:
    """The format a chat template writes calls in, by its markers; None: it has none."""
    if not template or not TOOLS_VARIABLE.search(template):
        return None
    return next((tool_format for marker, tool_format in TEMPLATE_MARKERS if marker in template), None)


def template_renders_tools(template: str | None) -> bool:
    """Whether the template reads `tools` (else the worker writes the functions into the prompt)."""
    return bool(template) and bool(TOOLS_VARIABLE.search(template or ""))


def tool_format_named(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"tool call format {name!r} is not one of {', '.join(sorted(FORMATS))}")
    return FORMATS[name]
