"""Rows with tools and thinking, through a hosted engine as a shard runs them (EngineRun), on random
weights: a forced call always parses and its arguments validate; `auto` rows are text or valid calls;
a Qwen3-shaped thinking model has its thinking apart on every row, bounded by its budget, with the
answer's JSON schema holding after it; a model without a tool format refuses tools by row. (SmolLM2
given Hermes: tests/api/test_tool_calls_live.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from bulkinfer.jobs.formats.anthropic_messages import AnthropicMessagesRowBuilder
from bulkinfer.jobs.formats.lines import Line
from bulkinfer.jobs.formats.openai_batch import OpenAIBatchRowBuilder
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.hosts.engine_rows import EngineRun
from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts
from tests.support.hosted import ready
from tests.support.thinking_checkpoint import thinking_checkpoint

pytestmark = pytest.mark.timeout(600)

OPTIONS = {"dtype": "float32", "max_model_len": 1024}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hosts(checkpoint_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelHosts]:
    thinker = thinking_checkpoint(checkpoint_factory(arch="qwen3"), tmp_path_factory.mktemp("q3") / "thinker")
    registry = ModelRegistry({"tiny": str(checkpoint_factory()), "thinker": str(thinker),
                              "plain": str(checkpoint_factory())})
    hosts = ModelHosts(registry, OPTIONS, tool_call_formats={"tiny": "hermes"})
    yield hosts
    hosts.stop()


def chat_rows(model: str, bodies: list[dict], prefix: str = "r") -> list[Row | RowError]:
    builder = OpenAIBatchRowBuilder(JobSpec(model=model, input_uri="s3://b/in.jsonl"))
    return [builder.build(Line(number, number + 1, b""), {
        "custom_id": f"{prefix}{number}", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"Question {number}?"}], "temperature": 0,
                 "max_tokens": 96, **body}}) for number, body in enumerate(bodies)]


def run(hosted: HostedModel, rows: list[Row | RowError]) -> list:
    engine_run = EngineRun(hosted, rows, deduplicate=False)
    engine_run.wait(300)
    return engine_run.outputs()


def assert_valid_calls(row, count: int | None = None) -> None:
    assert not row.failed, (row.row_id, row.error_message, row.text)
    assert row.finish_reason == "tool_calls" and row.tool_calls, row
    if count is not None:
        assert len(row.tool_calls) == count
    for call in row.tool_calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
        assert call.id.startswith("call_")


def test_forced_calls_always_parse_and_validate(hosts: ModelHosts) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    bodies = ([{"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}] * 4
              + [{"tools": TOOLS, "tool_choice": named}] * 3 + [{"tools": TOOLS, "tool_choice": "auto"}] * 3)
    outputs = run(ready(hosts, "tiny"), chat_rows("tiny", bodies))
    for row in outputs[:4]:
        assert_valid_calls(row, count=1)
    for row in outputs[4:7]:
        assert_valid_calls(row, count=1)
        assert row.tool_calls[0].name == "get_time"
    for row in outputs[7:]:  # auto: a text answer, or calls held to their schemas
        assert not row.failed, row.error_message
        if row.tool_calls:
            assert_valid_calls(row)
        else:
            assert row.finish_reason in ("stop", "length") and "<tool_call>" not in row.text


def test_tool_choice_none_answers_in_text_without_calls(hosts: ModelHosts) -> None:
    outputs = run(ready(hosts, "tiny"), chat_rows("tiny", [{"tools": TOOLS, "tool_choice": "none"}] * 2))
    assert all(not row.failed and not row.tool_calls and "<tool_call>" not in row.text for row in outputs)


def test_a_model_without_a_tool_format_refuses_tools_row_by_row(hosts: ModelHosts) -> None:
    with_tools, without = run(ready(hosts, "plain"), chat_rows("plain", [{"tools": TOOLS}, {}]))
    assert with_tools.error_code == "invalid_row" and "tool_call_formats" in with_tools.error_message
    assert not without.failed


def test_thinking_comes_apart_and_the_schema_holds_after_it(hosts: ModelHosts) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    bodies = [{"response_format": schema_format, "thinking_token_budget": 12 + 3 * n} for n in range(4)]
    hosted = ready(hosts, "thinker")
    outputs = run(hosted, chat_rows("thinker", bodies))
    # The thinking's tokens: the markers' (several each to the test tokenizer: the closing one may split
    # differently after the thinking's last text, a token or two more) and at most the budget.
    markers = sum(len(hosted.renderer.encode_text(marker)) for marker in ("<think>", "</think>"))
    for number, row in enumerate(outputs):
        assert not row.failed, (row.error_message, row.text)
        jsonschema.validate(json.loads(row.text), ANSWER)
        assert row.json_value == json.loads(row.text)
        assert row.reasoning is not None and "<think>" not in row.text and "</think>" not in row.text
        assert markers < row.reasoning_tokens <= markers + 2 + 12 + 3 * number
        assert row.reasoning_tokens < row.completion_tokens


def test_thinking_then_a_forced_call(hosts: ModelHosts) -> None:
    bodies = [{"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
               "thinking_token_budget": 10}] * 3
    for row in run(ready(hosts, "thinker"), chat_rows("thinker", bodies)):
        assert_valid_calls(row, count=1)
        assert row.reasoning is not None and "<tool_call>" not in (row.reasoning or "")


def test_thinking_switched_off_in_the_template_gives_no_reasoning(hosts: ModelHosts) -> None:
    body = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 24}
    (row,) = run(ready(hosts, "thinker"), chat_rows("thinker", [body]))
    assert not row.failed and row.reasoning is None and row.reasoning_tokens == 0


def test_anthropic_thinking_is_returned_only_when_asked(hosts: ModelHosts) -> None:
    builder = AnthropicMessagesRowBuilder(JobSpec(model="thinker", input_uri="s3://b/in.jsonl"), None)
    asked = builder.row(0, "asked", {"model": "thinker", "max_tokens": 40, "temperature": 0,
                                     "thinking": {"type": "enabled", "budget_tokens": 8},
                                     "messages": [{"role": "user", "content": "Hi?"}]}, None)
    unasked = builder.row(1, "unasked", {"model": "thinker", "max_tokens": 40, "temperature": 0,
                                         "messages": [{"role": "user", "content": "Hi?"}]}, None)
    shown, hidden = run(ready(hosts, "thinker"), [asked, unasked])
    assert shown.reasoning is not None and shown.reasoning_tokens > 0
    assert hidden.reasoning is None  # enable_thinking off: Qwen3's template closes an empty block


def test_identical_rows_share_a_run_but_each_has_its_own_call_ids(hosts: ModelHosts) -> None:
    """Greedy rows with the same prompt run once (deduplication), in the same window or a later one;
    each copy's calls get the copy's own ids."""
    hosted = ready(hosts, "tiny")
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": "Same question?"}]}
    first_rows, later_rows = chat_rows("tiny", [body, body]), chat_rows("tiny", [body], prefix="later")
    known: dict[bytes, int] = {}
    first = EngineRun(hosted, first_rows, known=known)
    first.wait(300)
    first_outputs = first.outputs()
    later = EngineRun(hosted, later_rows, known=known, offset=len(first_rows))
    later.wait(300)
    [copy] = later.outputs(earlier=first_outputs)
    rows = [*first_outputs, copy]
    assert [row.deduplicated for row in rows] == [False, True, True]
    assert len({row.tool_calls[0].id for row in rows}) == 3
    assert len({json.dumps(row.tool_calls[0].arguments) for row in rows}) == 1
