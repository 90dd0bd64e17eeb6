"""Output and error parts: every row in input order, checksummed, written once."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow.parquet as pq
import pytest

from bulkinfer.jobs.formats.csv_parts import part_rows
from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs, TokenLogprob
from bulkinfer.jobs.formats.parts import write_error_part, write_output_part
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.object_store import AlreadyExists
from bulkinfer.jobs.spec import JobSpec


def spec(output_format: str, **fields) -> JobSpec:
    return JobSpec.model_validate({"input_uri": "/in/rows.jsonl", "input_format": "jsonl", "model": "m",
                                   "prompt_column": "q", "output_format": output_format, **fields})


def outcomes(job: JobSpec) -> list[OutputRow]:
    """Rows 0-3 out of order, as an engine returns them: two done, one unparsable, one failed."""
    builder = RowBuilder(job)
    rows = {index: builder.build(index, {"q": f"question {index}", "src": f"s{index}"}) for index in range(4)}
    rejected = builder.build(2, {"src": "s2"})
    assert isinstance(rejected, RowError)
    return [done(rows[3], '{"a": 3}', cached=4), OutputRow.from_error(rejected), done(rows[0], '{"a": 0}'),
            done(rows[1], '{"a": ', finish_reason="length", cached=4)]


def done(row: Row, text: str, finish_reason: str = "stop", cached: int = 0) -> OutputRow:
    return OutputRow.completed(row, text, finish_reason, prompt_tokens=5, cached_tokens=cached,
                               completion_tokens=len(text) // 2)


def test_jsonl_part_holds_every_row_in_input_order(store) -> None:
    job = spec("jsonl", response_format={"type": "json_object"}, passthrough_columns=["src"])
    part = write_output_part(store, "out/part-00000.jsonl", outcomes(job), job, job_id="j")
    data = store.get_bytes("out/part-00000.jsonl")
    assert (part.rows, part.bytes, part.sha256) == (4, len(data), hashlib.sha256(data).hexdigest())
    assert part.uri == store.uri("out/part-00000.jsonl")
    lines = [json.loads(line) for line in data.splitlines()]
    assert [line["id"] for line in lines] == ["0", "1", "2", "3"]
    assert lines[0] == {"id": "0", "text": '{"a": 0}', "json": {"a": 0}, "finish_reason": "stop",
                        "usage": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 4},
                        "error": None, "src": "s0"}
    assert lines[1]["json"] is None and lines[1]["error"]["code"] == "invalid_output_json"
    assert lines[1]["text"] == '{"a": '  # the raw text is kept for a failed parse
    assert lines[2]["usage"] is None and lines[2]["error"] == {
        "code": "missing_column", "message": "prompt_column 'q' is missing in this row"}
    assert lines[2]["src"] == "s2"


def test_parquet_part_has_flat_typed_columns(store) -> None:
    job = spec("parquet", response_format={"type": "json_object"}, passthrough_columns=["src"])
    part = write_output_part(store, "out/part-00000.parquet", outcomes(job), job, job_id="j")
    data = store.get_bytes("out/part-00000.parquet")
    assert part.sha256 == hashlib.sha256(data).hexdigest() and part.bytes == len(data)
    table = pq.read_table(io.BytesIO(data))
    # `reasoning` and `reasoning_tokens`: the rows may run as chat, where a thinking model thinks.
    assert table.column_names == ["id", "text", "json", "reasoning", "finish_reason", "prompt_tokens",
                                  "cached_tokens", "completion_tokens", "reasoning_tokens", "error_code",
                                  "error", "src"]
    assert str(table.schema.field("prompt_tokens").type) == "int64"
    columns = table.to_pydict()
    assert columns["id"] == ["0", "1", "2", "3"]
    assert columns["json"] == ['{"a": 0}', None, None, '{"a": 3}']
    assert columns["error_code"] == [None, "invalid_output_json", "missing_column", None]
    assert columns["cached_tokens"] == [0, 4, None, 4]


def test_a_job_without_response_format_has_no_json_column(store) -> None:
    job = spec("jsonl")
    row = RowBuilder(job).build(0, {"q": "x"})
    assert isinstance(row, Row)
    write_output_part(store, "p.jsonl", [done(row, "{}")], job, job_id="j")
    assert "json" not in json.loads(store.get_bytes("p.jsonl"))


def test_error_part_lists_only_failed_rows_with_reasons(store) -> None:
    job = spec("jsonl", response_format={"type": "json_object"})
    part = write_error_part(store, "errors/part-00000.jsonl", outcomes(job))
    lines = [json.loads(line) for line in store.get_bytes("errors/part-00000.jsonl").splitlines()]
    assert part.rows == 2
    assert [(line["id"], line["index"], line["error"]["code"]) for line in lines] == [
        ("1", 1, "invalid_output_json"), ("2", 2, "missing_column")]


def test_engine_failures_are_reported_like_reader_errors(store) -> None:
    job = spec("jsonl")
    row = RowBuilder(job).build(0, {"q": "x" * 10})
    failed = OutputRow.engine_failed(row, RowErrorCode.PROMPT_TOO_LONG, "prompt has 9000 tokens; limit 8192")
    write_error_part(store, "e.jsonl", [failed])
    assert json.loads(store.get_bytes("e.jsonl"))["error"] == {
        "code": "prompt_too_long", "message": "prompt has 9000 tokens; limit 8192"}


def test_parts_are_write_once(store) -> None:
    job = spec("jsonl")
    write_output_part(store, "p.jsonl", [], job, job_id="j")
    with pytest.raises(AlreadyExists):
        write_output_part(store, "p.jsonl", outcomes(job), job, job_id="j")
    assert store.get_bytes("p.jsonl") == b""


def test_passthrough_values_of_mixed_types_become_json_text_in_parquet(store) -> None:
    job = spec("parquet", passthrough_columns=["src"])
    builder = RowBuilder(job)
    rows = [builder.build(index, {"q": "x", "src": source}) for index, source in enumerate([1, "two", None])]
    outputs = [done(row, "ok") for row in rows]
    write_output_part(store, "p.parquet", outputs, job, job_id="j")
    table = pq.read_table(io.BytesIO(store.get_bytes("p.parquet")))
    assert table.column("src").to_pylist() == ["1", '"two"', None]


def token(text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token_id=ord(text[0]), token=text, logprob=logprob, bytes=list(text.encode()))


LOGPROBS = [PositionLogprobs(token("{", -0.1), [token("{", -0.1), token("[", -2.5)]),
            PositionLogprobs(token("}", -0.2), [token("}", -0.2), token(" ", -1.9)])]


def sampled(job: JobSpec, texts: list[str], logprobs: list | None = LOGPROBS) -> OutputRow:
    row = RowBuilder(job).build(0, {"q": "x"})
    choices = [Choice(index, text, "stop", logprobs) for index, text in enumerate(texts)]
    return OutputRow.with_choices(row, choices, prompt_tokens=5, cached_tokens=0, completion_tokens=4)


def test_jsonl_rows_with_n_samples_list_choices_and_logprobs_when_asked(store) -> None:
    job = spec("jsonl", response_format={"type": "json_object"})
    write_output_part(store, "p.jsonl", [sampled(job, ["{}", '{"b": 1}'])], job, job_id="j")
    line = json.loads(store.get_bytes("p.jsonl"))
    assert list(line) == ["id", "text", "json", "finish_reason", "logprobs", "choices", "usage", "error"]
    assert (line["text"], line["json"]) == ("{}", {})
    brace = {"token": "{", "token_id": 123, "logprob": -0.1, "bytes": [123]}
    bracket = {"token": "[", "token_id": 91, "logprob": -2.5, "bytes": [91]}
    assert line["logprobs"][0] == {**brace, "top_logprobs": [brace, bracket]}
    assert [(c["index"], c["text"], c["json"]) for c in line["choices"]] == [
        (0, "{}", {}), (1, '{"b": 1}', {"b": 1})]
    assert line["choices"][1]["logprobs"] == line["logprobs"]
    # One sample, no logprobs asked: the single-sample shape, unchanged.
    write_output_part(store, "q.jsonl", [sampled(job, ["{}"], logprobs=None)], job, job_id="j")
    single = json.loads(store.get_bytes("q.jsonl"))
    assert list(single) == ["id", "text", "json", "finish_reason", "usage", "error"]


def test_a_sample_that_is_not_json_fails_the_row_naming_the_choice(store) -> None:
    job = spec("jsonl", response_format={"type": "json_object"})
    output = sampled(job, ["{}", "{oops"])
    assert output.error_code == "invalid_output_json" and output.error_message.startswith("choice 1: ")
    assert [choice.json_value for choice in output.choices] == [{}, None]


def test_json_outputs_are_parsed_strictly_as_users_will(store) -> None:
    # A raw control character inside a string is not JSON for a strict parser: the row says so.
    job = spec("jsonl", response_format={"type": "json_object"})
    output = sampled(job, ['{"a": "line\nbreak"}'])
    assert output.error_code == "invalid_output_json" and "control character" in output.error_message


def test_parquet_logprobs_and_choices_columns_are_typed_and_fixed_per_job(store) -> None:
    job = spec("parquet", sampling={"n": 2, "logprobs": 2})
    rows = [sampled(job, ["a", "b"]), OutputRow.from_error(RowBuilder(job).build(1, {}))]
    write_output_part(store, "p.parquet", rows, job, job_id="j")
    table = pq.read_table(io.BytesIO(store.get_bytes("p.parquet")))
    assert table.column_names == ["id", "text", "reasoning", "finish_reason", "logprobs", "choices",
                                  "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
                                  "error_code", "error"]
    logprobs, choices = table.column("logprobs").to_pylist(), table.column("choices").to_pylist()
    assert logprobs[0][1]["token"] == "}" and logprobs[0][1]["bytes"] == b"}"
    assert logprobs[0][1]["top_logprobs"][1] == {"token": " ", "token_id": 32, "logprob": -1.9, "bytes": b" "}
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices[0]] == [
        (0, "a", "stop"), (1, "b", "stop")]
    assert logprobs[1] is None and choices[1] is None  # the failed row
    # A job that cannot ask for either has neither column.
    plain = spec("parquet")
    write_output_part(store, "q.parquet", [sampled(plain, ["a"], logprobs=None)], plain, job_id="j")
    assert "choices" not in pq.read_table(io.BytesIO(store.get_bytes("q.parquet"))).column_names


def test_csv_part_has_the_parquet_columns_and_reads_back_as_the_parquet_part_does(store) -> None:
    job = spec("csv", response_format={"type": "json_object"}, passthrough_columns=["src"])
    rows = outcomes(job)
    rows[0] = done(RowBuilder(job).build(3, {"q": "x", "src": 'a "quoted", text\nwith lines'}), "")
    write_output_part(store, "out/part-00000.csv", rows, job, job_id="j")
    as_parquet = job.model_copy(update={"output_format": "parquet"})
    write_output_part(store, "out/part-00000.parquet", rows, as_parquet, job_id="j")
    data = store.get_bytes("out/part-00000.csv")
    expected = pq.read_table(io.BytesIO(store.get_bytes("out/part-00000.parquet")))
    assert data.startswith(b'"id","text","json","reasoning","finish_reason","prompt_tokens","cached_tokens",')
    read_back = [row for rows in part_rows(io.BytesIO(data), "csv") for row in rows]
    assert read_back == expected.to_pylist()
    assert read_back[3]["text"] == "" and read_back[2]["text"] is None  # an empty output, a failed row
    assert read_back[3]["src"] == 'a "quoted", text\nwith lines'


def test_csv_cells_hold_nested_values_as_the_json_a_jsonl_line_has(store) -> None:
    job = spec("tsv", sampling={"n": 2, "logprobs": 2})
    rows = [sampled(job, ["a", "b"]), OutputRow.from_error(RowBuilder(job).build(1, {}))]
    write_output_part(store, "p.tsv", rows, job, job_id="j")
    write_output_part(store, "p.jsonl", rows, job.model_copy(update={"output_format": "jsonl"}), job_id="j")
    line = json.loads(store.get_bytes("p.jsonl").splitlines()[0])
    data = store.get_bytes("p.tsv")
    header = data.split(b"\n")[0].split(b"\t")
    assert header[:6] == [b'"id"', b'"text"', b'"reasoning"', b'"finish_reason"', b'"logprobs"', b'"choices"']
    [first, failed] = [row for rows in part_rows(io.BytesIO(data), "tsv") for row in rows]
    assert first["logprobs"] == line["logprobs"]  # token bytes as numbers, as in JSONL
    assert [(c["index"], c["text"]) for c in first["choices"]] == [(0, "a"), (1, "b")]
    assert failed["logprobs"] is None and failed["error_code"] == "missing_column"
