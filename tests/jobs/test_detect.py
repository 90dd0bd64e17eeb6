"""Input format detection and spec resolution."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.detect import detect_input_format, resolve_spec
from bulkinfer.jobs.spec import InputFormat, JobSpec

OPENAI_LINE = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}


def parquet_payload() -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"q": ["a"]}), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("key, payload, expected", [
    ("rows.parquet", None, InputFormat.PARQUET),
    ("rows.bin", None, InputFormat.PARQUET),  # by magic bytes
    ("rows.jsonl", b'{"q": "a"}\n', InputFormat.JSONL),
    ("rows.jsonl", b"\n\n" + json.dumps(OPENAI_LINE).encode() + b"\n", InputFormat.OPENAI_BATCH),
    ("batch_input", json.dumps(OPENAI_LINE).encode(), InputFormat.OPENAI_BATCH),
    ("rows.txt", b'{"q": "a"}', InputFormat.JSONL),
    ("rows.jsonl", b"not json at all\n", InputFormat.JSONL),  # the name decides; rows will say why
    ("rows.csv", b"q,a\n1,2\n", InputFormat.CSV),
    ("in/ROWS.CSV", b'{"q": "a"}\n', InputFormat.CSV),  # by name, whatever the bytes look like
    ("rows.tsv", b"q\ta\n", InputFormat.TSV),
    ("rows.tab", b"q\ta\n", InputFormat.TSV),
])
def test_detect_input_format(store, key, payload, expected) -> None:
    store.put_bytes(key, parquet_payload() if payload is None else payload)
    assert detect_input_format(store, key) == expected


def test_an_unrecognisable_input_is_an_input_error_naming_the_file_not_its_key(store) -> None:
    key = "deploy/jobs/job-1/input/rows.bin"  # where an upload is kept: the service's key, not the user's
    store.put_bytes(key, b"q,a\n1,2\n")
    with pytest.raises(InputError) as error:
        detect_input_format(store, key)
    assert str(error.value).startswith("cannot tell the format of rows.bin: name it .parquet, .jsonl, .csv")
    assert "jobs/" not in str(error.value)


def test_resolve_spec_fills_formats_and_rechecks_the_mapping(local_store) -> None:
    local_store.put_bytes("batch.jsonl", json.dumps(OPENAI_LINE).encode() + b"\n")
    spec = JobSpec(input_uri="/batch.jsonl", model="m")
    resolved = resolve_spec(spec, local_store, "batch.jsonl")
    assert (resolved.input_format, resolved.output_format) == (InputFormat.OPENAI_BATCH,) * 2
    with pytest.raises(ValidationError, match="OpenAI batch lines carry their own request body"):
        resolve_spec(JobSpec(input_uri="/batch.jsonl", model="m", prompt_column="q"), local_store,
                     "batch.jsonl")
    with pytest.raises(ValidationError, match="jsonl input needs exactly one of"):
        local_store.put_bytes("rows.jsonl", b'{"q": 1}\n')
        resolve_spec(JobSpec(input_uri="/rows.jsonl", model="m"), local_store, "rows.jsonl")
