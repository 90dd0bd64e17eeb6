"""What a row asks of tools and thinking, read from its request (torch-free: the API and the readers).

`ToolRequest` is one form for both wire formats:

- OpenAI chat: `tools` (`{"type": "function", "function": {name, description, parameters, strict}}`),
  `tool_choice` (`"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`)
  and `parallel_tool_calls` (default true);
- Anthropic Messages: `tools` (`{name, description, input_schema}`; server tools such as web search
  are refused by name) and `tool_choice` (`auto`, `any` → required, `tool` → that function, `none`;
  `disable_parallel_tool_use`).

The worker renders the functions through the model's chat template and constrains the output so a
call always parses and its arguments hold to the function's `parameters` (worker/tools/).
Thinking: `reasoning_effort`, `chat_template_kwargs` (vLLM's: `enable_thinking` and the like) and
Anthropic's `thinking` reach the chat template as keyword arguments (`template_kwargs`); vLLM's
`thinking_token_budget` and Anthropic's `budget_tokens` bound the thinking (the grammar closes it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bulkinfer.jobs.response_format import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, schema_depth

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule (Anthropic's is the same, {1,128})
MAX_TOOLS = 128  # OpenAI's limit on functions per request
CHOICES = ("auto", "none", "required", "function")
# How models write calls (worker/tools/formats.py), as a deployment names them for a model.
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# Template keyword arguments a row may set (vLLM's chat_template_kwargs): those the templates of
# thinking models read. Others are refused by name rather than silently ignored.
TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})


class ToolProblem(ValueError):
    """A request's tools or tool choice cannot run; the message names the field."""


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # a JSON schema for the arguments; None: any JSON object

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI tool shape chat templates take (`tools=` of `apply_chat_template`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object"}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A row's functions and how it may call them: `choice` auto (text or calls), none (text only),
    required (one call or more, nothing else) or function (a call of `forced`, nothing else);
    `parallel`: more than one call in the answer."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    forced: str | None = None
    parallel: bool = True

    @property
    def callable(self) -> tuple[Function, ...]:
        """The functions the answer may call."""
        if self.choice == "none":
            return ()
        if self.choice == "function":
            return tuple(function for function in self.functions if function.name == self.forced)
        return self.functions

    @property
    def must_call(self) -> bool:
        return self.choice in ("required", "function")

    def openai_tools(self) -> list[dict[str, Any]]:
        return [function.as_openai() for function in self.functions]


def openai_tool_request(body: Mapping[str, Any], where: str = "body") -> ToolRequest | None:
    """An OpenAI chat body's `tools`, `tool_choice` and `parallel_tool_calls` (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _flag(body.get("parallel_tool_calls"), f"{where}.parallel_tool_calls", default=True)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolProblem(f"{where}.tool_choice {_shown(choice)} needs {where}.tools")
        return None
    request = ToolRequest(_functions(tools, where, _openai_function), parallel=parallel)
    return _with_openai_choice(request, choice, f"{where}.tool_choice")


def _functions(tools: Any, where: str, read: Callable[[Any, str], Function]) -> tuple[Function, ...]:
    """Each of a request's tools read by `read` (one API's shape), checked as a set."""
    if not isinstance(tools, list):
        raise ToolProblem(f"{where}.tools must be a list of tools")
    functions = [read(tool, f"{where}.tools[{position}]") for position, tool in enumerate(tools)]
    return tuple(_unique(functions, f"{where}.tools"))


def _openai_function(tool: Any, here: str) -> Function:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise ToolProblem(f"{here} is {_shown(kind)}: only function tools "
                          '({"type": "function", "function": {...}}) run here')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ToolProblem(f"{here}.function must be an object with a name")
    return _function(function.get("name"), function.get("description"), function.get("parameters"),
                     f"{here}.function")


def _with_openai_choice(request: ToolRequest, choice: Any, where: str) -> ToolRequest:
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(request.functions, choice or "auto", None, request.parallel)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        return _forced(request, name, f"{where}.function.name")
    raise ToolProblem(f"{where} must be 'auto', 'none', 'required' or "
                      f'{{"type": "function", "function": {{"name": ...}}}}, got {_shown(choice)}')


def anthropic_tool_request(params: Mapping[str, Any], where: str = "params") -> ToolRequest | None:
    """An Anthropic request's `tools` and `tool_choice` (None: no tools)."""
    tools, choice = params.get("tools"), params.get("tool_choice")
    if tools is None or tools == []:
        harmless = isinstance(choice, Mapping) and choice.get("type") in ("auto", "none")
        if choice is not None and not harmless:
            raise ToolProblem(f"{where}.tool_choice needs {where}.tools")
        return None
    request = ToolRequest(_functions(tools, where, _anthropic_function))
    if choice is None:
        return request
    if not isinstance(choice, Mapping):
        raise ToolProblem(f"{where}.tool_choice must be an object with a type")
    parallel = not _flag(choice.get("disable_parallel_tool_use"),
                         f"{where}.tool_choice.disable_parallel_tool_use", default=False)
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}
    if kind in mapped:
        return ToolRequest(request.functions, mapped[kind], None, parallel)
    if kind == "tool":
        forced = _forced(request, choice.get("name"), f"{where}.tool_choice.name")
        return ToolRequest(forced.functions, forced.choice, forced.forced, parallel)
    raise ToolProblem(f"{where}.tool_choice.type must be auto, any, tool or none, got {_shown(kind)}")


def _anthropic_function(tool: Any, here: str) -> Function:
    if not isinstance(tool, Mapping):
        raise ToolProblem(f"{here} must be an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ToolProblem(f"{here} is the server tool {_shown(kind)}, which this server does not run; "
                          "give client tools ({name, description, input_schema})")
    if "input_schema" not in tool:
        raise ToolProblem(f"{here}.input_schema is required")
    return _function(tool.get("name"), tool.get("description"), tool.get("input_schema"), here,
                     schema_field="input_schema")


def _forced(request: ToolRequest, name: Any, where: str) -> ToolRequest:
    names = [function.name for function in request.functions]
    if name not in names:
        raise ToolProblem(f"{where} {_shown(name)} is not one of the tools ({', '.join(names)})")
    return ToolRequest(request.functions, "function", name, request.parallel)


def _function(name: Any, description: Any, parameters: Any, where: str,
              schema_field: str = "parameters") -> Function:
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise ToolProblem(f"{where}.name must be 1-64 letters, digits, _ or -, got {_shown(name)}")
    if description is not None and not isinstance(description, str):
        raise ToolProblem(f"{where}.description must be text")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise ToolProblem(f"{where}.{schema_field} must be a JSON schema (an object)")
        size = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_SCHEMA_BYTES:
            raise ToolProblem(f"{where}.{schema_field} is {size:,} bytes; at most {MAX_SCHEMA_BYTES:,} "
                              "are allowed")
        if schema_depth(parameters) > MAX_SCHEMA_DEPTH:
            raise ToolProblem(f"{where}.{schema_field} nests more than {MAX_SCHEMA_DEPTH} levels deep")
        parameters = dict(parameters)
    return Function(name, description, parameters)


def _unique(functions: list[Function], where: str) -> list[Function]:
    if not functions:
        raise ToolProblem(f"{where} is empty")
    if len(functions) > MAX_TOOLS:
        raise ToolProblem(f"{where} lists {len(functions)} functions; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for function in functions:
        if function.name in seen:
            raise ToolProblem(f"{where}: the function name {function.name!r} appears twice")
        seen.add(function.name)
    return functions


def _flag(value: Any, where: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ToolProblem(f"{where} must be true or false, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return repr(value)[:120]


def thinking_budget(value: Any, where: str) -> int | None:
    """A thinking budget in tokens (vLLM's `thinking_token_budget`, Anthropic's `budget_tokens`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ToolProblem(f"{where} must be a positive integer (tokens), got {_shown(value)}")
    return value


def openai_template_kwargs(body: Mapping[str, Any], where: str = "body") -> dict[str, Any]:
    """`reasoning_effort` and vLLM's `chat_template_kwargs` as the chat template's keyword arguments."""
    kwargs: dict[str, Any] = {}
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise ToolProblem(f"{where}.chat_template_kwargs must be an object")
        unknown = sorted(set(extra) - TEMPLATE_KWARGS)
        if unknown:
            raise ToolProblem(f"{where}.chat_template_kwargs.{unknown[0]} is not supported here "
                              f"(supported: {', '.join(sorted(TEMPLATE_KWARGS))})")
        for name in ("enable_thinking", "thinking"):
            if name in extra:
                kwargs[name] = _flag(extra[name], f"{where}.chat_template_kwargs.{name}", default=True)
        if "reasoning_effort" in extra:
            kwargs["reasoning_effort"] = _effort(extra["reasoning_effort"], f"{where}.chat_template_kwargs")
    if body.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = _effort(body["reasoning_effort"], where)
    return kwargs


def parse_tool_call_formats(text: str | None) -> dict[str, str]:
    """The `tool_call_formats` setting: JSON {model: format}; raises ValueError naming the problem."""
    if not text:
        return {}
    try:
        formats = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"tool_call_formats: not JSON ({error.msg})") from None
    if not isinstance(formats, dict):
        raise ValueError('tool_call_formats must be a JSON object {"<model>": "<format>"}')
    for model, name in formats.items():
        if name not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_formats: model {model!r} names {name!r}; formats: "
                             f"{', '.join(TOOL_CALL_FORMATS)}")
    return formats


def _effort(value: Any, where: str) -> str:
    if value not in REASONING_EFFORTS:
        raise ToolProblem(f"{where}.reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                          f"got {_shown(value)}")
    return value


@dataclass(frozen=True, slots=True)
class Thinking:
    """An Anthropic request's `thinking`: the template's switch, whether thinking blocks come back,
    and the most tokens the thinking may take."""

    template_kwargs: dict[str, Any]
    shown: bool
    budget: int | None = None


def anthropic_thinking(params: Mapping[str, Any], where: str = "params") -> Thinking:
    """An Anthropic request's `thinking`: `{"type": "enabled", "budget_tokens": n}` turns the
    template's thinking on, bounds it to n tokens and returns it; absent or `{"type": "disabled"}`
    turns it off (a model that thinks anyway has its thinking left out of the answer, as Anthropic
    returns none unasked)."""
    thinking = params.get("thinking")
    off = Thinking({"enable_thinking": False}, shown=False)
    if thinking is None:
        return off
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind == "disabled":
        return off
    if kind != "enabled":
        raise ToolProblem(f"{where}.thinking.type must be 'enabled' or 'disabled', got {_shown(kind)}")
    budget = thinking_budget(thinking.get("budget_tokens"), f"{where}.thinking.budget_tokens")
    if budget is None:
        raise ToolProblem(f"{where}.thinking.budget_tokens is required")
    max_tokens = params.get("max_tokens")
    if isinstance(max_tokens, int) and budget >= max_tokens:
        raise ToolProblem(f"{where}.thinking.budget_tokens ({budget}) must be below max_tokens "
                          f"({max_tokens}): max_tokens bounds the thinking and the answer together")
    return Thinking({"enable_thinking": True}, shown=True, budget=budget)
