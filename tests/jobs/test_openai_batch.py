"""OpenAI batch JSONL: request lines in, response lines out, in the shapes OpenAI uses."""

from __future__ import annotations

import json

from bulkinfer.jobs.formats.openai_batch import find_duplicate_custom_ids, iter_openai_batch_rows
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record, text_offsets
from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs, TokenLogprob
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import INSTRUCTIONS_SEPARATOR, Row, RowError, RowErrorCode
from bulkinfer.jobs.planning.sharding import ShardPlan, plan_shards
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model="tiny-llama",
               instructions="Answer briefly.", sampling={"temperature": 0.0, "max_tokens": 32})


def request(custom_id, url="/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "gpt-4o-mini", **body}}


def read(store, lines: list) -> list[Row | RowError]:
    data = b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines)
    store.put_bytes("batch.jsonl", data + b"\n")
    return list(iter_openai_batch_rows(store, "batch.jsonl", 0, len(data) + 1, SPEC))


def test_chat_and_completion_requests_become_rows(local_store) -> None:
    chat, completion = read(local_store, [
        request("a", messages=[{"role": "user", "content": "2+2?"}], max_completion_tokens=5, seed=7,
                response_format={"type": "json_object"}, logprobs=True, top_logprobs=2),
        request("b", url="/v1/completions", prompt="Once upon", stop="\n", temperature=0.5),
    ])
    assert chat.row_id == "a" and chat.is_chat
    assert chat.messages == [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "2+2?"}]
    assert chat.sampling.as_dict() == {"temperature": 0.0, "max_tokens": 5, "seed": 7, "logprobs": 2}
    assert chat.response_format == {"type": "json_object"}
    assert completion.row_id == "b" and not completion.is_chat
    assert completion.prompt == "Answer briefly." + INSTRUCTIONS_SEPARATOR + "Once upon"
    assert completion.sampling.as_dict() == {"temperature": 0.5, "max_tokens": 32, "stop": ["\n"]}


def test_lines_without_max_tokens_mean_what_each_api_means(local_store) -> None:
    """Chat lines without max_tokens generate until the answer ends (OpenAI's chat API, vLLM's server);
    completions lines keep that API's documented default of 16 (vLLM's completions route too)."""
    store_spec = SPEC.model_copy(update={"sampling": SPEC.sampling.model_copy(update={"max_tokens": None})})
    data = b"\n".join(json.dumps(line).encode() for line in [
        request("chat", messages=[{"role": "user", "content": "Tell me a story."}]),
        request("completion", url="/v1/completions", prompt="Once upon"),
        request("asked", url="/v1/completions", prompt="Once upon", max_tokens=300),
    ]) + b"\n"
    local_store.put_bytes("batch.jsonl", data)
    chat, completion, asked = iter_openai_batch_rows(local_store, "batch.jsonl", 0, len(data), store_spec)
    assert chat.sampling.max_tokens is None  # the worker bounds it by the context and max_tokens_cap
    assert completion.sampling.max_tokens == 16
    assert asked.sampling.max_tokens == 300


def test_invalid_lines_are_row_errors_in_place(local_store) -> None:
    items = read(local_store, [
        request("a", messages=[{"role": "user", "content": "x"}]),
        request("a", messages=[{"role": "user", "content": "again"}]),
        request("c", url="/v1/moderations", input="x"),
        request("d", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]),
        request("e", messages=[{"role": "user", "content": "x"}], n=17),
        request("f", messages=[{"role": "user", "content": "x"}], temperature=5),
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        b'{"custom_id": "g", "body": ',
        request("h", url="/v1/completions", prompt=[1, 2, 3]),
        request("i", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs="many"),
    ])
    assert isinstance(items[0], Row)
    codes = [(item.row_id, item.code) for item in items[1:]]
    assert codes[:5] == [("a", RowErrorCode.DUPLICATE_CUSTOM_ID), ("c", RowErrorCode.UNSUPPORTED_URL),
                         ("d", RowErrorCode.INVALID_ROW), ("e", RowErrorCode.INVALID_SAMPLING),
                         ("f", RowErrorCode.INVALID_SAMPLING)]
    assert codes[5][1] == RowErrorCode.INVALID_ROW and codes[5][0] == str(items[6].index)
    assert codes[6][1] == RowErrorCode.INVALID_JSON
    assert codes[7] == ("h", RowErrorCode.INVALID_ROW)
    assert codes[8] == ("i", RowErrorCode.INVALID_SAMPLING)
    assert items[9].message.startswith("body: logprobs: Input should be a valid integer")
    assert "url '/v1/moderations' is not supported" in items[2].message
    assert items[3].message == "body.tools[0].function must be an object with a name"
    assert items[4].message == "body: n: Input should be less than or equal to 16"
    assert "appears more than once (line 2 of the shard)" in items[1].message
    assert [item.line for item in items] == list(range(1, 11))


def test_duplicates_across_the_whole_file_are_found_in_one_pass(local_store) -> None:
    lines = [request(custom_id, url="/v1/completions", prompt="p") for custom_id in ["a", "b", "a", "c", "a"]]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    local_store.put_bytes("batch.jsonl", data)
    repeats = find_duplicate_custom_ids(local_store, "batch.jsonl")
    line_length = len(data) // 5
    assert repeats == {"a": [2 * line_length, 4 * line_length]}


def test_a_custom_id_repeated_in_another_shard_fails_every_line_after_its_first(local_store) -> None:
    """The plan scans the whole file; each shard's repeats are row errors naming the first line."""
    ids = ["a", "b", "c", "d", "a", "e", "b", "a", "f"]  # shards of 2 lines: repeats cross shards
    data = b"".join(json.dumps(request(i, url="/v1/completions", prompt="p")).encode() + b"\n" for i in ids)
    local_store.put_bytes("batch.jsonl", data)
    spec = SPEC.model_copy(update={"shard_size": 2})
    plan = plan_shards(local_store, "batch.jsonl", spec)
    assert len(plan) == 5
    items = [item for shard in plan for item in read_shard_rows(local_store, "batch.jsonl", spec, shard)]
    assert [(item.row_id, getattr(item, "code", None)) for item in items] == [
        ("a", None), ("b", None), ("c", None), ("d", None), ("a", RowErrorCode.DUPLICATE_CUSTOM_ID),
        ("e", None), ("b", RowErrorCode.DUPLICATE_CUSTOM_ID), ("a", RowErrorCode.DUPLICATE_CUSTOM_ID),
        ("f", None)]
    assert "appears more than once (first on line 1 of the file)" in items[4].message
    assert "first on line 2 of the file" in items[6].message
    # The plan (saved as plan.json) carries each shard's repeats and reads back the same.
    assert [ShardPlan.model_validate_json(shard.model_dump_json()) for shard in plan] == plan


def test_completed_rows_are_written_as_openai_responses(local_store) -> None:
    chat, completion = read(local_store, [
        request("a", messages=[{"role": "user", "content": "2+2?"}]),
        request("b", url="/v1/completions", prompt="Once upon"),
    ])
    for row, object_type in ((chat, "chat.completion"), (completion, "text_completion")):
        output = OutputRow.completed(row, "four", "stop", prompt_tokens=12, cached_tokens=8,
                                     completion_tokens=2)
        line = openai_batch_record(output, job_id="job1", model="tiny-llama", created=1_700_000_000)
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["id"].startswith("batch_req_") and line["custom_id"] == row.row_id
        assert line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        body = response["body"]
        assert body["object"] == object_type and body["model"] == "tiny-llama"
        assert body["created"] == 1_700_000_000
        assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14,
                                 "prompt_tokens_details": {"cached_tokens": 8}}
        [choice] = body["choices"]
        assert choice["finish_reason"] == "stop" and choice["index"] == 0
        if object_type == "chat.completion":
            assert body["id"].startswith("chatcmpl-")
            assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "four"
        else:
            assert body["id"].startswith("cmpl-") and choice["text"] == "four"
        again = openai_batch_record(output, job_id="job1", model="tiny-llama", created=1_700_000_000)
        assert again == line  # ids derive from job and custom_id: a rerun writes the same line


def test_failed_rows_are_written_with_the_openai_error_shape(local_store) -> None:
    [error] = read(local_store, [request("x", url="/v1/embeddings", input="x")])
    line = openai_batch_record(OutputRow.from_error(error), job_id="job1", model="m", created=0)
    assert line["response"] is None and line["custom_id"] == "x"
    assert line["error"] == {"code": "unsupported_url", "message": error.message}


def test_a_row_whose_json_was_cut_off_keeps_its_text_finish_reason_and_usage(local_store) -> None:
    """OpenAI returns the cut-off content with finish_reason "length"; the row still failed (its JSON
    does not parse), so the line carries both the response and the error."""
    [row] = read(local_store, [request("a", messages=[{"role": "user", "content": "A movie."}],
                                       response_format={"type": "json_object"})])
    output = OutputRow.completed(row, '{"categories": ["drama"], "summ', "length", prompt_tokens=40,
                                 cached_tokens=0, completion_tokens=32)
    assert output.failed and output.error_code == "invalid_output_json"
    line = openai_batch_record(output, job_id="job1", model="m", created=0)
    assert line["error"]["code"] == "invalid_output_json"
    assert "finish_reason=length" in line["error"]["message"]
    body = line["response"]["body"]
    assert body["choices"][0]["message"]["content"] == '{"categories": ["drama"], "summ'
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 32 and body["usage"]["prompt_tokens"] == 40


def test_n_logprobs_and_vllm_knobs_are_sampling_overrides(local_store) -> None:
    chat, chat_flag_only, completion = read(local_store, [
        request("a", messages=[{"role": "user", "content": "x"}], n=2, logprobs=True, top_logprobs=3),
        request("b", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=None),
        request("c", url="/v1/completions", prompt="p", logprobs=2, stop=["."],
                include_stop_str_in_output=True, skip_special_tokens=False, ignore_eos=True,
                presence_penalty=0.5, min_p=0.1),
    ])
    assert chat.sampling.n == 2 and chat.sampling.logprobs == 3
    assert chat_flag_only.sampling.logprobs == 0  # logprobs: true alone = the chosen tokens' only
    assert completion.sampling.as_dict() == {
        "temperature": 0.0, "max_tokens": 32, "logprobs": 2, "stop": ["."],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "ignore_eos": True,
        "presence_penalty": 0.5, "min_p": 0.1}


def position(token: str, logprob: float, top: list[tuple[str, float]]) -> PositionLogprobs:
    def entry(text: str, value: float) -> TokenLogprob:
        return TokenLogprob(token_id=len(text), token=text, logprob=value, bytes=list(text.encode()))

    return PositionLogprobs(entry(token, logprob), [entry(text, value) for text, value in top])


def test_choices_and_logprobs_are_written_in_the_openai_shapes(local_store) -> None:
    chat, completion = read(local_store, [
        request("a", messages=[{"role": "user", "content": "x"}], n=2, logprobs=True, top_logprobs=1),
        request("b", url="/v1/completions", prompt="p", n=2, logprobs=1),
    ])
    first = [position("Hi", -0.1, [("Hi", -0.1)]), position("!", -0.5, [("?", -0.4)])]
    second = [position("Yo", -1.0, [("Hi", -0.1)])]
    choices = [Choice(0, "Hi!", "stop", first), Choice(1, "Yo", "length", second)]
    for row in (chat, completion):
        output = OutputRow.with_choices(row, choices, prompt_tokens=3, cached_tokens=0, completion_tokens=3)
        body = openai_batch_record(output, job_id="j", model="m", created=0)["response"]["body"]
        assert [choice["index"] for choice in body["choices"]] == [0, 1]
        assert [choice["finish_reason"] for choice in body["choices"]] == ["stop", "length"]
        assert body["usage"]["completion_tokens"] == 3
        logprobs = body["choices"][0]["logprobs"]
        if row.is_chat:
            assert body["choices"][1]["message"]["content"] == "Yo"
            assert logprobs == {"refusal": None, "content": [
                {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                 "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]},
                {"token": "!", "logprob": -0.5, "bytes": [33],
                 "top_logprobs": [{"token": "?", "logprob": -0.4, "bytes": [63]}]}]}
        else:
            assert body["choices"][1]["text"] == "Yo"
            # The chosen token is in top_logprobs even when it is not among the top k (OpenAI: k + 1).
            assert logprobs == {"tokens": ["Hi", "!"], "token_logprobs": [-0.1, -0.5],
                                "top_logprobs": [{"Hi": -0.1}, {"?": -0.4, "!": -0.5}], "text_offset": [0, 2]}


def test_single_choice_rows_without_logprobs_keep_logprobs_null(local_store) -> None:
    [row] = read(local_store, [request("a", url="/v1/completions", prompt="p")])
    output = OutputRow.completed(row, "x", "stop", prompt_tokens=1, cached_tokens=0, completion_tokens=1)
    [choice] = openai_batch_record(output, job_id="j", model="m", created=0)["response"]["body"]["choices"]
    assert choice == {"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop", "stop_reason": None}


def test_each_choice_says_which_stop_string_or_token_ended_it_as_vllm_does(local_store) -> None:
    chat, completion = read(local_store, [
        request("a", messages=[{"role": "user", "content": "x"}], n=3, stop=["END"], seed=1),
        request("b", url="/v1/completions", prompt="p", n=3, stop=["END"], seed=1),
    ])
    choices = [Choice(0, "Hi", "stop", stop_reason="END"), Choice(1, "Yo", "stop", stop_reason=2),
               Choice(2, "Hey", "length")]
    for row in (chat, completion):
        output = OutputRow.with_choices(row, choices, prompt_tokens=3, cached_tokens=0, completion_tokens=5)
        body = openai_batch_record(output, job_id="j", model="m", created=0)["response"]["body"]
        assert [(choice["finish_reason"], choice["stop_reason"]) for choice in body["choices"]] == [
            ("stop", "END"), ("stop", 2), ("length", None)]


def test_text_offsets_count_characters_and_a_split_character_starts_where_it_begins() -> None:
    euro = list("€".encode())  # 3 bytes, split over two tokens
    assert text_offsets([list(b"a"), euro[:2], euro[2:], list(b"bc"), list(b"d")]) == [0, 1, 1, 2, 4]
