"""Anthropic Messages requests as `/v1/messages` lines of an OpenAI-batch file: each becomes a chat
row, or that request's error naming what we cannot serve (never the job's failure)."""

from __future__ import annotations

import json

import pytest

from bulkinfer.jobs.formats.openai_batch import iter_openai_batch_rows
from bulkinfer.jobs.formats.rows import INSTRUCTIONS_SEPARATOR, Row, RowError, RowErrorCode
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model="tiny",
               sampling={"temperature": 0.0, "max_tokens": 32})
USER = {"role": "user", "content": "Hello"}


def line(custom_id: str, url: str = "/v1/messages", **params) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "tiny", "max_tokens": 8, "messages": [USER], **params}}


def read(store, lines: list[dict], spec: JobSpec = SPEC) -> list[Row | RowError]:
    data = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    store.put_bytes("batch.jsonl", data)
    return list(iter_openai_batch_rows(store, "batch.jsonl", 0, len(data), spec))


def test_a_messages_request_becomes_a_chat_row_with_its_system_prompt_and_sampling(local_store) -> None:
    [row] = read(local_store, [line("a", system="Be brief.", temperature=0.5, top_p=0.9, top_k=20,
                                    stop_sequences=["\n\nHuman:", "END"], max_tokens=64,
                                    metadata={"user_id": "u-1"}, service_tier="auto", stream=False,
                                    messages=[{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"},
                                              {"role": "user", "content": "and 3+3?"}])])
    assert isinstance(row, Row) and row.row_id == "a" and row.is_chat and row.prompt is None
    assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    assert row.sampling.as_dict() == {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "max_tokens": 64,
                                      "stop": ["\n\nHuman:", "END"]}


def test_text_blocks_are_joined_as_the_chat_renderer_joins_text_parts(local_store) -> None:
    blocks = [{"type": "text", "text": "First."}, {"type": "text", "text": "Second.",
                                                    "cache_control": {"type": "ephemeral"}}]
    [row] = read(local_store, [line("a", system=blocks, messages=[{"role": "user", "content": blocks}])])
    assert row.messages == [{"role": "system", "content": "First.\nSecond."},
                            {"role": "user", "content": "First.\nSecond."}]


def test_the_jobs_sampling_and_instructions_apply_as_to_every_other_row(local_store) -> None:
    spec = SPEC.model_copy(update={"instructions": "Answer in French."})
    plain, with_system = read(local_store, [line("a"), line("b", system="Be brief.")], spec)
    assert plain.messages == [{"role": "system", "content": "Answer in French."}, USER]
    assert with_system.messages[0] == {"role": "system",
                                       "content": "Answer in French." + INSTRUCTIONS_SEPARATOR + "Be brief."}
    # The job's sampling, with the line's max_tokens over it.
    assert plain.sampling.as_dict() == {"temperature": 0.0, "max_tokens": 8}


@pytest.mark.parametrize(("params", "code", "message"), [
    ({"model": None}, RowErrorCode.INVALID_ROW, "params.model is required"),
    ({"max_tokens": None}, RowErrorCode.INVALID_SAMPLING, "params.max_tokens is required"),
    ({"max_tokens": 0}, RowErrorCode.INVALID_SAMPLING, "params.max_tokens must be an integer of at least 1"),
    ({"max_tokens": True}, RowErrorCode.INVALID_SAMPLING,
     "params.max_tokens must be an integer of at least 1"),
    ({"temperature": 3}, RowErrorCode.INVALID_SAMPLING,
     "params: temperature: Input should be less than or equal to 2"),
    ({"stop_sequences": "END"}, RowErrorCode.INVALID_SAMPLING,
     "params.stop_sequences must be a list of non-empty strings"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, RowErrorCode.INVALID_ROW,
     "params.tools[0] is the server tool 'web_search_20250305', which this server does not run; give client "
     "tools ({name, description, input_schema})"),
    ({"tools": [{"name": "get_weather"}]}, RowErrorCode.INVALID_ROW,
     "params.tools[0].input_schema is required"),
    ({"tool_choice": {"type": "any"}}, RowErrorCode.INVALID_ROW, "params.tool_choice needs params.tools"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}},
     RowErrorCode.INVALID_ROW, "params.tool_choice.name 'g' is not one of the tools (f)"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, RowErrorCode.INVALID_ROW,
     "params.thinking.budget_tokens (1024) must be below max_tokens (8): max_tokens bounds the thinking and "
     "the answer together"),
    ({"thinking": {"type": "sometimes"}}, RowErrorCode.INVALID_ROW,
     "params.thinking.type must be 'enabled' or 'disabled', got 'sometimes'"),
    ({"stream": True}, RowErrorCode.INVALID_ROW, "params.stream: a batch request cannot stream"),
    ({"frobnicate": 1}, RowErrorCode.INVALID_ROW, "params.frobnicate is not supported here"),
    ({"messages": []}, RowErrorCode.INVALID_ROW, "params.messages must be a non-empty list of messages"),
    ({"messages": [{"role": "system", "content": "x"}, USER]}, RowErrorCode.INVALID_ROW,
     "params.messages[0].role must be 'user' or 'assistant' (the system prompt goes in params.system)"),
    ({"messages": [{"role": "user"}]}, RowErrorCode.INVALID_ROW, "params.messages[0] has no content"),
    ({"messages": [USER, {"role": "assistant", "content": "The answer is ("}]}, RowErrorCode.INVALID_ROW,
     "params.messages ends with an assistant message (a prefill to continue), which is not supported here; "
     "end with a user message"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "file", "file_id": "file_011"}}]}]},
     RowErrorCode.INVALID_ROW,
     "params.messages[0].content[1].source.type 'file' is not supported here: give the image as base64 data "
     "or a url"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0] is a block of type 'document': only text, image and tool_result blocks "
     "are supported in a user turn"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0] is a block of type 'tool_use': only text, image and tool_result blocks "
     "are supported in a user turn"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                   USER]},
     RowErrorCode.INVALID_ROW,
     "params.messages[1].content[0] is a block of type 'tool_result': only text and tool_use blocks are "
     "supported in an assistant turn"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                           "input": "x"}]}, USER]},
     RowErrorCode.INVALID_ROW, "params.messages[1].content[0].input must be an object"),
    ({"messages": [{"role": "user", "content": ["bare"]}]}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0] is not a content block: only text, image and tool_result blocks are "
     "supported in a user turn"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0].text must be a string"),
    ({"system": {"text": "x"}}, RowErrorCode.INVALID_ROW,
     "params.system must be a string or a list of text blocks"),
    ({"system": [{"type": "image"}]}, RowErrorCode.INVALID_ROW,
     "params.system[0] is a block of type 'image': only text blocks are supported here"),
])
def test_what_cannot_be_served_is_that_requests_error_naming_it(local_store, params: dict, code: RowErrorCode,
                                                                message: str) -> None:
    good, bad, after = read(local_store, [line("ok"), line("bad", **params), line("after")])
    assert isinstance(good, Row) and isinstance(after, Row)  # the rest of the batch runs
    assert isinstance(bad, RowError) and bad.row_id == "bad" and bad.line == 2
    assert (bad.code, bad.message) == (code, message)


def test_an_unknown_url_names_the_messages_url_among_those_served(local_store) -> None:
    [error] = read(local_store, [line("a", url="/v1/moderations")])
    assert error.code == RowErrorCode.UNSUPPORTED_URL
    assert error.message == ("url '/v1/moderations' is not supported; use /v1/chat/completions, "
                             "/v1/completions, /v1/messages, /v1/embeddings")


def test_messages_lines_mix_with_chat_and_completion_lines_in_one_file(local_store) -> None:
    openai_chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "gpt-4o-mini", "messages": [USER]}}
    messages, chat = read(local_store, [line("m"), openai_chat])
    assert messages.messages == chat.messages == [USER]
    assert messages.sampling.max_tokens == 8 and chat.sampling.max_tokens == 32


def test_a_dry_run_counts_messages_lines_as_the_chat_rows_they_become(tiny_checkpoint, tmp_path) -> None:
    """The estimate reads `/v1/messages` lines as a worker does: their prompt tokens are those of the
    equivalent chat request, a refused one is counted failing, and one identical to a chat line
    (same messages, greedy) is the duplicate the worker runs once."""
    from transformers import AutoTokenizer

    from bulkinfer.jobs.object_store.local import LocalObjectStore
    from bulkinfer.jobs.planning.estimate import estimate_job
    from bulkinfer.jobs.planning.sharding import plan_shards
    from bulkinfer.jobs.tokenizer_files import load_tokenizer, publish_tokenizer

    store = LocalObjectStore(tmp_path)
    publish_tokenizer(store, "pre", "tiny", AutoTokenizer.from_pretrained(tiny_checkpoint), "worker-1")
    tokenizer = load_tokenizer(store, "pre", "tiny")
    asked = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [line("m1", system="Be brief.", messages=asked, max_tokens=7),
             line("m2", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5),
             line("refused", tools=[{"name": "f"}]),
             {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Name a colour."}],
                       "max_tokens": 5}}]
    store.put_bytes("batch.jsonl", b"".join(json.dumps(item).encode() + b"\n" for item in lines))
    plan = plan_shards(store, "batch.jsonl", SPEC)

    estimate = estimate_job(store, "batch.jsonl", SPEC, plan, tokenizer, measured=[], live_workers=0)

    expected = tokenizer.chat_tokens([{"role": "system", "content": "Be brief."}, *asked])
    colour = tokenizer.chat_tokens([{"role": "user", "content": "Name a colour."}])
    assert (estimate.rows, estimate.rows_failing, estimate.rows_deduplicated) == (4, 1, 1)
    assert estimate.prompt_tokens == len(expected) + len(colour)
    assert estimate.max_output_tokens == 7 + 5
