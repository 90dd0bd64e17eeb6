"""The output records of a job of `/v1/messages` lines, translated to Anthropic's batch results and
parsed with the official `anthropic` package's own type, as a user's code reads them."""

from __future__ import annotations

import json

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse

from bulkinfer.jobs.formats.anthropic_results import (
    anthropic_result,
    canceled_result,
    error_type,
    expired_result,
)
from bulkinfer.jobs.formats.openai_batch import iter_openai_batch_rows
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import Choice, OutputRow, expired_row
from bulkinfer.jobs.formats.rows import Row, RowErrorCode
from bulkinfer.jobs.spec import JobSpec

MODEL = "tiny"
SPEC = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model=MODEL)


def messages_line(custom_id: str, **params) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/messages",
            "body": {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                     **params}}


@pytest.fixture
def row(local_store) -> Row:
    data = json.dumps(messages_line("req-1", stop_sequences=["END"])).encode() + b"\n"
    local_store.put_bytes("batch.jsonl", data)
    [row] = iter_openai_batch_rows(local_store, "batch.jsonl", 0, len(data), SPEC)
    return row


def translated(output: OutputRow) -> tuple[dict, MessageBatchIndividualResponse]:
    record = openai_batch_record(output, job_id="job-1", model=MODEL, created=1_700_000_000)
    result = anthropic_result(json.loads(json.dumps(record)), MODEL)  # as read back from the output part
    return result, MessageBatchIndividualResponse.model_validate(result)


def completed(row: Row, choice: Choice) -> OutputRow:
    return OutputRow.with_choices(row, [choice], prompt_tokens=12, cached_tokens=8, completion_tokens=3)


def test_a_completed_request_is_a_succeeded_message(row: Row) -> None:
    result, parsed = translated(completed(row, Choice(0, "Hello there", "stop")))

    assert parsed.custom_id == "req-1" and parsed.result.type == "succeeded"
    message = parsed.result.message
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert len(message.content) == 1 and message.content[0].type == "text"
    assert message.content[0].text == "Hello there"
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    # Anthropic's input_tokens leave out what the cache served: input + cache reads = the prompt.
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.cache_creation_input_tokens, message.usage.output_tokens) == (4, 8, 0, 3)
    assert message.id.startswith("msg_")
    assert translated(completed(row, Choice(0, "Hello there", "stop")))[0] == result  # a rerun: same id
    other_row = Row(1, "req-2", None, row.messages, row.sampling, None)
    other = OutputRow.with_choices(other_row, [Choice(0, "x", "stop")], prompt_tokens=1, cached_tokens=0,
                                   completion_tokens=1)
    assert translated(other)[1].result.message.id != message.id


@pytest.mark.parametrize(("choice", "stop_reason", "stop_sequence"), [
    (Choice(0, "one two", "stop", stop_reason="END"), "stop_sequence", "END"),
    (Choice(0, "one two", "stop", stop_reason=2), "end_turn", None),  # a stop token: the turn ended
    (Choice(0, "one two", "stop"), "end_turn", None),  # EOS
    (Choice(0, "one two", "length"), "max_tokens", None),
])
def test_the_stop_reason_says_how_the_message_ended(row: Row, choice: Choice, stop_reason: str,
                                                    stop_sequence: str | None) -> None:
    _, parsed = translated(completed(row, choice))
    message = parsed.result.message
    assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
    assert message.content[0].text == "one two"


def test_an_empty_answer_is_still_one_text_block(row: Row) -> None:
    _, parsed = translated(completed(row, Choice(0, "", "stop")))
    assert [(block.type, block.text) for block in parsed.result.message.content] == [("text", "")]


@pytest.mark.parametrize(("code", "kind"), [
    (RowErrorCode.INVALID_ROW, "invalid_request_error"),
    (RowErrorCode.INVALID_SAMPLING, "invalid_request_error"),
    (RowErrorCode.PROMPT_TOO_LONG, "invalid_request_error"),
    (RowErrorCode.DUPLICATE_CUSTOM_ID, "invalid_request_error"),
    (RowErrorCode.ENGINE_ERROR, "api_error"),
    (RowErrorCode.WORKER_CRASHED, "api_error"),
])
def test_a_failed_request_is_errored_with_the_anthropic_error_type_of_its_code(row: Row, code: RowErrorCode,
                                                                              kind: str) -> None:
    _, parsed = translated(OutputRow.engine_failed(row, code, f"it failed: {code.value}"))
    assert parsed.custom_id == "req-1" and parsed.result.type == "errored"
    assert parsed.result.error.type == "error"
    error = parsed.result.error.error
    assert (error.type, error.message) == (kind, f"it failed: {code.value}")


def test_a_refused_parameter_is_an_invalid_request_naming_it(local_store) -> None:
    data = json.dumps(messages_line("tools", tools=[{"name": "get_weather"}])).encode() + b"\n"
    local_store.put_bytes("batch.jsonl", data)
    [error] = iter_openai_batch_rows(local_store, "batch.jsonl", 0, len(data), SPEC)
    _, parsed = translated(OutputRow.from_error(error))
    assert parsed.result.type == "errored" and parsed.result.error.error.type == "invalid_request_error"
    assert parsed.result.error.error.message == "params.tools[0].input_schema is required"


def test_an_unknown_code_is_ours_and_a_missing_message_says_the_code() -> None:
    assert error_type("something_new") == "api_error" and error_type(None) == "api_error"
    record = {"id": "batch_req_1", "custom_id": "x", "response": None, "error": {"code": "something_new"}}
    parsed = MessageBatchIndividualResponse.model_validate(anthropic_result(record, MODEL))
    assert parsed.result.error.error.message == "the request failed (something_new)"


def test_a_request_the_deadline_caught_is_expired_one_a_cancel_kept_from_running_canceled(row: Row) -> None:
    result, parsed = translated(expired_row(row))
    assert result == {"custom_id": "req-1", "result": {"type": "expired"}} and parsed.result.type == "expired"
    for line, kind in ((canceled_result("req-9"), "canceled"), (expired_result("req-8"), "expired")):
        parsed = MessageBatchIndividualResponse.model_validate(line)
        assert (parsed.custom_id, parsed.result.type) == (line["custom_id"], kind)
