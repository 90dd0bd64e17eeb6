"""Tools and thinking read from requests (jobs/tool_calls.py), and written back in each API's shape,
checked with the official SDKs' own types."""

from __future__ import annotations

import json

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse
from openai.types.chat import ChatCompletion

from bulkinfer.jobs.formats.anthropic_results import anthropic_result
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import Choice, OutputRow, ToolCall
from bulkinfer.jobs.formats.rows import Row, RowBuilder
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tool_calls import (
    ToolProblem,
    anthropic_thinking,
    anthropic_tool_request,
    openai_template_kwargs,
    openai_tool_request,
    parse_tool_call_formats,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_openai_tools_and_each_tool_choice() -> None:
    auto = openai_tool_request({"tools": TOOLS})
    assert auto is not None and auto.choice == "auto" and auto.parallel
    assert [f.name for f in auto.callable] == ["get_weather", "get_time"]
    assert auto.functions[1].parameters is None and auto.openai_tools()[1]["function"]["parameters"] == {
        "type": "object"}
    choice = {"type": "function", "function": {"name": "get_time"}}
    named = openai_tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False})
    assert named.choice == "function" and named.must_call and not named.parallel
    assert [f.name for f in named.callable] == ["get_time"]
    assert openai_tool_request({"tools": TOOLS, "tool_choice": "none"}).callable == ()
    assert openai_tool_request({"tools": TOOLS, "tool_choice": "required"}).must_call
    assert openai_tool_request({"tool_choice": "auto"}) is None and openai_tool_request({"tools": []}) is None


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": "required"}, "body.tool_choice 'required' needs body.tools"),
    ({"tools": {"a": 1}}, "body.tools must be a list of tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "body.tools[0] is 'code_interpreter': only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "body.tools[0].function.name must be 1-64 letters, digits, _ or -, got 'bad name'"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "body.tools: the function name 'get_weather' appears twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "body.tools[0].function.parameters must be a JSON schema (an object)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "body.tool_choice.function.name 'nope' is not one of the tools (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "always"}, "body.tool_choice must be 'auto', 'none', 'required' or"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "body.parallel_tool_calls must be true or false"),
])
def test_openai_tool_mistakes_name_the_field(body: dict, message: str) -> None:
    with pytest.raises(ToolProblem) as raised:
        openai_tool_request(body)
    assert str(raised.value).startswith(message)


def test_anthropic_tools_map_onto_the_same_choices() -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER},
             {"name": "f", "type": "custom", "input_schema": {}}]
    assert anthropic_tool_request({"tools": tools}).choice == "auto"
    required = anthropic_tool_request({"tools": tools, "tool_choice": {"type": "any",
                                                                       "disable_parallel_tool_use": True}})
    assert required.choice == "required" and not required.parallel
    forced = anthropic_tool_request({"tools": tools, "tool_choice": {"type": "tool", "name": "f"}})
    assert forced.choice == "function" and forced.forced == "f"
    assert anthropic_tool_request({"tools": tools, "tool_choice": {"type": "none"}}).callable == ()


def test_template_switches_and_thinking_budgets() -> None:
    assert openai_template_kwargs({"reasoning_effort": "low",
                                   "chat_template_kwargs": {"enable_thinking": False}}) == {
        "enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(ToolProblem, match="chat_template_kwargs.add_generation_prompt is not supported"):
        openai_template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False}})
    with pytest.raises(ToolProblem, match="reasoning_effort must be one of minimal, low, medium, high"):
        openai_template_kwargs({"reasoning_effort": "max"})
    enabled = anthropic_thinking({"max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 40}})
    assert (enabled.template_kwargs, enabled.shown, enabled.budget) == ({"enable_thinking": True}, True, 40)
    assert not anthropic_thinking({"max_tokens": 100}).shown  # unasked: off, and not returned


def test_the_deployment_names_a_known_format_per_model() -> None:
    assert parse_tool_call_formats('{"smollm2": "hermes"}') == {"smollm2": "hermes"}
    with pytest.raises(ValueError, match="model 'm' names 'xml'; formats: hermes, llama3_json, mistral"):
        parse_tool_call_formats('{"m": "xml"}')


def test_a_jobs_tools_reach_every_row_which_then_runs_as_chat() -> None:
    spec = JobSpec(model="m", input_uri="s3://b/in.parquet", prompt_column="q", tools=TOOLS,
                   tool_choice="required", enable_thinking=False, thinking_token_budget=64)
    row = RowBuilder(spec).build(0, {"q": "Weather in Oslo?"})
    assert isinstance(row, Row) and row.chat_required and row.tools.choice == "required"
    assert row.template_kwargs == {"enable_thinking": False} and row.thinking_budget == 64
    with pytest.raises(ValueError, match="tool_choice.function.name 'x' is not one of the tools"):
        JobSpec(model="m", input_uri="s3://b/in.parquet", prompt_column="q", tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(ValueError, match="tools: an embed job calls no functions"):
        JobSpec(model="m", input_uri="s3://b/in.parquet", prompt_column="q", task="embed", tools=TOOLS)


ROW = Row(0, "req-1", None, [{"role": "user", "content": "Weather?"}], JobSampling(), None)
CALLS = (ToolCall("call_abc", "get_weather", {"city": "Oslo"}), ToolCall("call_def", "get_time", {}))


def completed(choice: Choice, reasoning_tokens: int = 0) -> OutputRow:
    row = OutputRow.with_choices(ROW, [choice], prompt_tokens=20, cached_tokens=4, completion_tokens=30)
    return OutputRow(**{**{name: getattr(row, name) for name in row.__slots__},
                        "reasoning_tokens": reasoning_tokens})


def test_calls_and_thinking_in_the_openai_shape_parse_with_the_sdk() -> None:
    row = completed(Choice(0, "", "tool_calls", reasoning="Oslo is in Norway.", tool_calls=CALLS), 12)
    record = openai_batch_record(row, job_id="j", model="m", created=1)
    completion = ChatCompletion.model_validate(record["response"]["body"])
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("call_abc", "get_weather", {"city": "Oslo"}), ("call_def", "get_time", {})]
    assert message.model_extra["reasoning_content"] == "Oslo is in Norway."
    assert completion.usage.completion_tokens_details.reasoning_tokens == 12


def test_calls_and_thinking_in_the_anthropic_shape_parse_with_the_sdk() -> None:
    row = completed(Choice(0, "Checking.", "tool_calls", reasoning="Hmm.", tool_calls=CALLS[:1]))
    record = openai_batch_record(row, job_id="j", model="m", created=1)
    result = MessageBatchIndividualResponse.model_validate(anthropic_result(record, "m")).result
    assert result.type == "succeeded" and result.message.stop_reason == "tool_use"
    thinking, text, call = result.message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Hmm.") and thinking.signature
    assert (text.type, text.text) == ("text", "Checking.")
    assert (call.type, call.id, call.name, call.input) == ("tool_use", "toolu_abc", "get_weather",
                                                           {"city": "Oslo"})
    only_call = completed(Choice(0, "", "tool_calls", tool_calls=CALLS[:1]))
    record = openai_batch_record(only_call, job_id="j", model="m", created=1)
    parsed = MessageBatchIndividualResponse.model_validate(anthropic_result(record, "m"))
    content = parsed.result.message.content
    assert [block.type for block in content] == ["tool_use"]  # no empty text block beside a call
