"""Building rows from records: templates, instructions, chat messages, per-row overrides."""

from __future__ import annotations

import pytest

from bulkinfer.jobs.formats.rows import INSTRUCTIONS_SEPARATOR, Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.template import MissingColumn, PromptTemplate


def builder(**fields) -> RowBuilder:
    return RowBuilder(JobSpec.model_validate({"input_uri": "/in/rows.jsonl", "input_format": "jsonl",
                                              "model": "m"} | fields))


def test_template_fills_columns_and_keeps_escaped_braces() -> None:
    template = PromptTemplate.parse("Title: {title}\nBody: {body}\nAnswer as {{json}}; repeat {title}")
    assert template.columns == ["title", "body"]
    assert template.fill({"title": "T", "body": 3}) == "Title: T\nBody: 3\nAnswer as {json}; repeat T"
    with pytest.raises(MissingColumn, match="template column 'body' is missing from the row"):
        template.fill({"title": "T"})
    with pytest.raises(MissingColumn, match="template column 'body' is null in the row"):
        template.fill({"title": "T", "body": None})


def test_a_missing_template_column_is_a_row_error_not_a_crash() -> None:
    rows = builder(template="Summarize: {text}", id_column="doc")
    error = rows.build(3, {"doc": "d-3", "txt": "typo in the column name"}, line=4)
    assert isinstance(error, RowError)
    assert (error.index, error.row_id, error.code, error.line) == (3, "d-3", RowErrorCode.MISSING_COLUMN, 4)
    assert error.message == "template column 'text' is missing from the row"
    ok = rows.build(4, {"doc": "d-4", "text": "hello"})
    assert isinstance(ok, Row) and ok.prompt == "Summarize: hello" and ok.row_id == "d-4"


def test_instructions_come_first_in_every_prompt() -> None:
    row = builder(prompt_column="q", instructions="You are terse.").build(0, {"q": "Why?"})
    assert row.prompt == "You are terse." + INSTRUCTIONS_SEPARATOR + "Why?"
    assert row.messages is None and not row.is_chat


def test_for_chat_rows_instructions_become_the_system_message() -> None:
    rows = builder(messages_column="chat", instructions="Be kind.")
    plain = rows.build(0, {"chat": [{"role": "user", "content": "hi"}]})
    assert plain.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    with_system = rows.build(1, {"chat": '[{"role": "system", "content": "Use French."},'
                                         '{"role": "user", "content": "hi"}]'})  # JSON text works too
    assert with_system.messages[0] == {"role": "system", "content": "Be kind." + INSTRUCTIONS_SEPARATOR
                                       + "Use French."}
    assert len(with_system.messages) == 2 and with_system.prompt is None and with_system.is_chat
    bad = rows.build(2, {"chat": [{"content": "no role"}]})
    assert isinstance(bad, RowError) and bad.code == RowErrorCode.INVALID_ROW
    assert "messages_column 'chat'[0] needs a role" in bad.message


def test_row_ids_default_to_the_index_and_come_from_id_column_when_named() -> None:
    assert builder(prompt_column="q").build(7, {"q": "x"}).row_id == "7"
    assert builder(prompt_column="q", id_column="id").build(7, {"q": "x", "id": 123}).row_id == "123"
    missing = builder(prompt_column="q", id_column="id").build(7, {"q": "x", "id": None})
    assert isinstance(missing, RowError) and missing.message == "id_column 'id' is null in this row"


def test_a_non_text_prompt_is_a_row_error() -> None:
    error = builder(prompt_column="q").build(0, {"q": ["a", "list"]})
    assert isinstance(error, RowError) and "prompt_column 'q' must be text, got list" in error.message


def test_per_row_sampling_overrides_merge_over_the_job_defaults() -> None:
    rows = builder(prompt_column="q", sampling={"temperature": 0.2, "max_tokens": 10},
                   sampling_column="params")
    row = rows.build(0, {"q": "x", "params": {"max_tokens": 99, "top_p": None}})
    assert row.sampling.as_dict() == {"temperature": 0.2, "max_tokens": 99}
    assert rows.build(1, {"q": "x"}).sampling.as_dict() == {"temperature": 0.2, "max_tokens": 10}
    bad = rows.build(2, {"q": "x", "params": '{"temperature": 9}'})
    assert isinstance(bad, RowError) and bad.code == RowErrorCode.INVALID_SAMPLING
    assert bad.message == "sampling_column 'params': temperature: Input should be less than or equal to 2"
    unknown = rows.build(3, {"q": "x", "params": {"beam_width": 4}})
    assert isinstance(unknown, RowError) and "beam_width: Extra inputs are not permitted" in unknown.message


def test_response_format_comes_from_the_job_or_the_row() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    rows = builder(prompt_column="q", response_format={"type": "json_object"}, response_format_column="fmt")
    assert rows.build(0, {"q": "x"}).response_format == {"type": "json_object"}
    assert rows.build(1, {"q": "x", "fmt": schema}).response_format == schema
    assert rows.build(3, {"q": "x", "fmt": {"type": "text"}}).response_format is None  # overrides the job's
    bad = rows.build(2, {"q": "x", "fmt": {"type": "json_schema"}})
    assert isinstance(bad, RowError) and bad.code == RowErrorCode.INVALID_RESPONSE_FORMAT
    assert "response_format_column 'fmt': json_schema.json_schema: Field required" in bad.message


def test_passthrough_columns_travel_with_rows_and_errors() -> None:
    rows = builder(prompt_column="q", passthrough_columns=["source", "absent"])
    assert rows.build(0, {"q": "x", "source": "web"}).passthrough == {"source": "web", "absent": None}
    assert rows.build(1, {"source": "web"}).passthrough == {"source": "web", "absent": None}


def test_arbitrary_json_values_never_crash_the_row_builders() -> None:
    """Whatever a user's file holds, building a row yields a Row or a RowError, never an exception."""
    import random

    from bulkinfer.jobs.formats.lines import Line
    from bulkinfer.jobs.formats.openai_batch import OpenAIBatchRowBuilder

    rng = random.Random(5)
    keys = ["role", "content", "type", "json_schema", "temperature", "name", "schema", "stop", "text"]
    scalars = [None, True, 3, -1.5, "text", '{"temperature": 9}', "[]", float("nan"), {}, []]

    def value(depth: int = 0):
        pick = rng.randint(0, 9 if depth < 3 else 7)
        if pick == 8:
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 3))}
        if pick == 9:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return scalars[pick]

    mapped = {"sampling_column": "s", "response_format_column": "r", "input_format": "jsonl"}
    builders = [builder(messages_column="c", id_column="i", instructions="I", **mapped),
                builder(template="{c} {s}", **mapped), builder(prompt_column="c", **mapped)]
    batch = OpenAIBatchRowBuilder(JobSpec(input_uri="/b.jsonl", input_format="openai_batch", model="m",
                                          instructions="I"))
    body_keys = ["messages", "prompt", "temperature", "stop", "response_format", "logprobs", "top_logprobs",
                 "max_completion_tokens", "n", "seed", "system", "max_tokens", "stop_sequences", "model",
                 "stream", "top_k"]
    for _ in range(3000):
        record = {key: value() for key in rng.sample(["c", "s", "r", "i"], rng.randint(0, 4))}
        for row_builder in builders:
            assert isinstance(row_builder.build(0, record), Row | RowError)
        body = {key: value() for key in rng.sample(body_keys, rng.randint(0, 5))}
        if rng.random() < 0.5:  # the job's model: a /v1/messages line gets past the model check
            body["model"] = "m"
        urls = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings"]
        line = {"custom_id": rng.choice(["a", None, 3]), "body": rng.choice([body, body, None, []]),
                "url": rng.choice(urls)}
        assert isinstance(batch.build(Line(0, 1, b""), line), Row | RowError)


def test_instructions_merge_into_a_system_message_of_text_parts_and_go_before_a_developer_message() -> None:
    rows = builder(messages_column="chat", instructions="Be kind.")
    parts = [{"type": "text", "text": "Use French."}]
    user = {"role": "user", "content": "hi"}
    merged = rows.build(0, {"chat": [{"role": "system", "content": parts}, user]})
    assert merged.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be kind."}, *parts]}
    developer = rows.build(1, {"chat": [{"role": "developer", "content": "d"}, user]})
    assert [m["role"] for m in developer.messages] == ["system", "developer", "user"]
    assert developer.messages[0] == {"role": "system", "content": "Be kind."}
