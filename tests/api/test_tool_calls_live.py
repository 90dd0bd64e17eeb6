"""Tool calls and thinking on a live deployment (Redis, moto S3, a real worker, the API over HTTP), with
the official `openai` and `anthropic` SDKs and our own: `tiny` (random weights, a template without
tools) and the real SmolLM2 are given the Hermes format by the deployment (`tool_call_formats`);
`thinker` is a Qwen3-shaped
checkpoint whose template thinks and renders tools itself (tests/support/thinking_checkpoint.py).
Forced calls come back on every row with arguments that validate; `auto` rows are text or valid
calls; thinking comes apart, and the answer's JSON schema holds after it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.api.live_stack import ENGINE_OPTIONS, LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server
from tests.support.thinking_checkpoint import thinking_checkpoint

pytestmark = pytest.mark.timeout(400)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer"], "additionalProperties": False}
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, checkpoint_factory, real_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tiny = checkpoint_factory()
    thinker = thinking_checkpoint(checkpoint_factory(arch="qwen3"), tmp_path_factory.mktemp("q3") / "thinker")
    models = {"tiny": str(tiny), "thinker": str(thinker), "smollm2": str(real_model)}
    settings = {"tool_call_formats": {"tiny": "hermes", "smollm2": "hermes"},
                "model_aliases": {"gpt-4o-mini": "tiny", "claude-haiku-4-5": "thinker"}}
    # The functions' descriptions make prompts of ~400 tokens: room for them and an answer.
    engine = {**ENGINE_OPTIONS, "max_model_len": 1024}
    with live_stack(redis_server, s3_server, tiny, tmp_path_factory.mktemp("model-cache"), models=models,
                    worker_served=("tiny", "thinker", "smollm2"), settings_fields=settings,
                    engine_options=engine) as live:
        yield live


def chat_line(custom_id: str, model: str = "gpt-4o-mini", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Request {custom_id}?"}],
                     "max_tokens": 80, "temperature": 0, **body}}


def assert_valid_call(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


def openai_outputs(stack: LiveStack, lines: list[dict]) -> dict[str, dict]:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    batch = sdk.batches.create(input_file_id=sdk.files.create(file=("tools.jsonl", data), purpose="batch").id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + TIMEOUT_S
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    assert batch.status == "completed", batch.errors
    errors = sdk.files.content(batch.error_file_id).read() if batch.error_file_id else b""
    assert batch.output_file_id is not None, errors[:2000]
    records = [json.loads(line) for line in sdk.files.content(batch.output_file_id).read().splitlines()]
    return {record["custom_id"]: record for record in records}


def test_openai_batch_lines_with_tools_come_back_as_valid_calls(stack: LiveStack) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    lines = ([chat_line(f"required-{n}", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
              for n in range(4)]
             + [chat_line(f"named-{n}", tools=TOOLS, tool_choice=named) for n in range(3)]
             + [chat_line(f"auto-{n}", tools=TOOLS) for n in range(3)])
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    thinking = [chat_line(f"thinks-{n}", model="thinker", thinking_token_budget=16, response_format=answer)
                for n in range(2)]
    thinking.append(chat_line("required-thinking", model="thinker", tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, thinking_token_budget=8))
    records = {**openai_outputs(stack, lines), **openai_outputs(stack, thinking)}  # a batch runs one model
    assert len(records) == len(lines) + len(thinking)
    for custom_id, record in records.items():
        assert record["error"] is None, (custom_id, record["error"])
        completion = ChatCompletion.model_validate(record["response"]["body"])
        choice = completion.choices[0]
        calls = choice.message.tool_calls or []
        if custom_id.startswith(("required", "named")):
            assert choice.finish_reason == "tool_calls" and len(calls) == 1, custom_id
            assert calls[0].type == "function" and calls[0].id.startswith("call_")
            assert_valid_call(calls[0].function.name, json.loads(calls[0].function.arguments))
            assert not custom_id.startswith("named") or calls[0].function.name == "get_time"
            thought = choice.message.model_extra.get("reasoning_content") is not None
            assert thought == ("thinking" in custom_id)
        elif custom_id.startswith("auto"):  # text, or calls held to their schemas
            for call in calls:
                assert_valid_call(call.function.name, json.loads(call.function.arguments))
            assert calls or "<tool_call>" not in (choice.message.content or "")
        else:
            jsonschema.validate(json.loads(choice.message.content), ANSWER)  # the schema, after the thinking
            assert choice.message.model_extra["reasoning_content"] is not None
            assert completion.usage.completion_tokens_details.reasoning_tokens > 0


def test_anthropic_requests_with_tools_and_thinking_parse_with_the_sdk(stack: LiveStack) -> None:
    sdk = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    tools = [{"name": name, "description": f"{name} tool", "input_schema": schema}
             for name, schema in SCHEMAS.items()]

    def request(custom_id: str, model: str = "tiny", **params: object) -> dict:
        return {"custom_id": custom_id, "params": {
            "model": model, "max_tokens": 160, "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {custom_id}?"}], **params}}

    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Oslo", "unit": "celsius"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4C"},
                   {"type": "text", "text": "And the time?"}]}]
    def results_of(requests: list[dict]) -> dict:
        batch = sdk.messages.batches.create(requests=requests)  # a batch runs one model
        deadline = time.monotonic() + TIMEOUT_S
        while sdk.messages.batches.retrieve(batch.id).processing_status != "ended":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        return {item.custom_id: item.result for item in sdk.messages.batches.results(batch.id)}

    results = {**results_of([
        request("any", tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}),
        request("tool", tools=tools, tool_choice={"type": "tool", "name": "get_weather"})]),
        **results_of([request("follow-up", model="thinker", tools=tools, messages=history,
                              tool_choice={"type": "tool", "name": "get_time"},
                              thinking={"type": "enabled", "budget_tokens": 12})])}
    assert len(results) == 3
    for custom_id, result in results.items():
        assert result.type == "succeeded", (custom_id, result)
        message = result.message
        assert message.stop_reason == "tool_use", (custom_id, message)
        calls = [block for block in message.content if block.type == "tool_use"]
        assert len(calls) == 1 and calls[0].id.startswith("toolu_")
        assert_valid_call(calls[0].name, calls[0].input)
    assert results["tool"].message.content[-1].name == "get_weather"
    follow_up = results["follow-up"].message.content
    assert follow_up[0].type == "thinking" and follow_up[-1].name == "get_time"


def test_a_job_with_tools_writes_each_rows_calls(stack: LiveStack) -> None:
    rows = [{"id": f"r{n}", "q": f"Weather in city {n}?"} for n in range(3)]
    job = stack.client.jobs.create({"model": "tiny", "id_column": "id", "prompt_column": "q", "tools": TOOLS,
                                    "tool_choice": "required", "parallel_tool_calls": False,
                                    "sampling": {"temperature": 0, "max_tokens": 80}}, input=rows)
    done = stack.client.jobs.wait(job, poll_interval=0.2, timeout=TIMEOUT_S)
    assert done.state == "succeeded", done.error
    outputs = list(stack.client.jobs.results(done))
    assert [row["id"] for row in outputs] == ["r0", "r1", "r2"]
    for row in outputs:
        assert row["error"] is None and row["finish_reason"] == "tool_calls"
        [call] = row["tool_calls"]
        assert call["id"].startswith("call_")
        assert_valid_call(call["name"], call["arguments"])


QUESTIONS = ["What's the weather in Paris?", "Is it cold in Oslo right now?", "Weather in Tokyo, please.",
             "How hot is Cairo today?", "Do I need an umbrella in London?", "Temperature in Lima?"]


def test_smollm2_given_the_hermes_format_calls_on_every_forced_row(stack: LiveStack) -> None:
    """The real model, whose template has no tools: every forced row is a call whose arguments
    validate, and its greedy calls name the cities asked about."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    lines = [{"custom_id": f"q{number}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "messages": [{"role": "user", "content": question}],
                       "tools": TOOLS, "tool_choice": "required" if number % 2 else named,
                       "parallel_tool_calls": False, "max_tokens": 64, "temperature": 0}}
             for number, question in enumerate(QUESTIONS)]
    records = openai_outputs(stack, lines)
    named_city = []
    for number, question in enumerate(QUESTIONS):
        record = records[f"q{number}"]
        assert record["error"] is None, record["error"]
        choice = ChatCompletion.model_validate(record["response"]["body"]).choices[0]
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert choice.finish_reason == "tool_calls"
        assert_valid_call(call.function.name, arguments)
        if call.function.name == "get_weather":
            named_city.append(arguments["city"].lower() in question.lower())
    assert sum(named_city) >= 4, records
