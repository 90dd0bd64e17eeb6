"""Rows that broke readers and failed whole jobs: each is now that row's error, and the rest run."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from bulkinfer.jobs.formats.detect import detect_input_format
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.planning.job_dedup import mark_copies
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5000  # past Python's 4,300-digit int conversion limit
JSONL = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", id_column="id",
                template="{q}", sampling={"temperature": 0.0}, shard_size=2)


def read_all(store, key: str, spec: JobSpec) -> list[Row | RowError]:
    plan = mark_copies(store, key, spec, plan_shards(store, key, spec))
    return [item for shard in plan for item in read_shard_rows(store, key, spec, shard)]


def test_a_line_nested_100000_deep_and_a_5000_digit_number_are_row_errors(local_store) -> None:
    lines = [f'{{"id": "deep", "q": {DEEP}}}', '{"id": "a", "q": "x"}',
             f'{{"id": "big", "q": "x", "n": {HUGE_INT}}}', '{"id": "b", "q": "y"}',
             f'{{"id": "nested", "q": "x", "n": {"[" * 150 + "]" * 150}}}']
    local_store.put_bytes("rows.jsonl", "\n".join(lines).encode())

    assert detect_input_format(local_store, "rows.jsonl") == "jsonl"  # the deep line is the first
    items = read_all(local_store, "rows.jsonl", JSONL)

    assert [item.row_id for item in items if isinstance(item, Row)] == ["a", "b"]
    offsets = [sum(len(line) + 1 for line in lines[:n]) for n in range(len(lines))]
    errors = {item.index: item for item in items if isinstance(item, RowError)}
    assert sorted(errors) == [offsets[0], offsets[2], offsets[4]]
    assert {error.code for error in errors.values()} == {RowErrorCode.INVALID_JSON}
    assert "nested more than 100 levels" in errors[offsets[0]].message
    assert "a number too long to read" in errors[offsets[2]].message
    assert "nested more than 100 levels" in errors[offsets[4]].message


def test_an_openai_batch_file_with_a_deep_line_plans_and_reads(local_store) -> None:
    good = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}
    lines = [json.dumps(good), '{"custom_id": "deep", "body": ' + DEEP + "}",
             json.dumps({**good, "custom_id": "b"})]
    local_store.put_bytes("batch.jsonl", "\n".join(lines).encode())
    spec = JobSpec(input_uri="s3://b/batch.jsonl", input_format="openai_batch", model="m", shard_size=1)

    items = read_all(local_store, "batch.jsonl", spec)

    deep_line = str(len(lines[0]) + 1)  # a line that is not an object is named by its byte offset
    assert [(item.row_id, isinstance(item, Row)) for item in items] == [("a", True), (deep_line, False),
                                                                        ("b", True)]
    assert items[1].code == RowErrorCode.INVALID_JSON


def test_a_parquet_string_cell_that_is_not_utf8_fails_only_its_row(local_store) -> None:
    raw = [b"first", b"bad \xff\xfe text", b"third", b"fourth"]
    table = pa.table({"id": ["r0", "r1", "r2", "r3"], "q": pa.array(raw, pa.binary()).view(pa.string())})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=2)
    local_store.put_bytes("rows.parquet", buffer.getvalue())
    spec = JobSpec(input_uri="s3://b/rows.parquet", input_format="parquet", model="m", id_column="id",
                   prompt_column="q", sampling={"temperature": 0.0}, shard_size=2)

    items = read_all(local_store, "rows.parquet", spec)

    assert [item.prompt for item in items if isinstance(item, Row)] == ["first", "third", "fourth"]
    [error] = [item for item in items if isinstance(item, RowError)]
    assert (error.index, error.code) == (1, RowErrorCode.INVALID_ROW)
    assert "column 'q' holds text that is not UTF-8" in error.message


def test_submit_reads_a_head_with_a_deep_line_without_a_server_error(local_store) -> None:
    from bulkinfer.api.submission import check_columns

    lines = [f'{{"q": {DEEP}}}', '{"q": "x"}']
    local_store.put_bytes("rows.jsonl", "\n".join(lines).encode())
    check_columns(JSONL.model_copy(update={"id_column": None}), local_store, "rows.jsonl", "s3://b/rows.jsonl")
