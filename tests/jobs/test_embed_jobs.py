"""Embed jobs in the job domain: the spec's rules, embed rows from every input, and the outputs
(Parquet's fixed-size float32 column, JSONL float lists, OpenAI's embeddings body read back by the
official `openai` types)."""

from __future__ import annotations

import base64
import io
import json
import math
from array import array

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai import omit
from openai.lib._parsing._embeddings import parse_embedding_response
from openai.types import CreateEmbeddingResponse
from pydantic import ValidationError

from bulkinfer.jobs.embedding import EmbedRequest, base64_vector, shorten
from bulkinfer.jobs.formats.openai_batch import SUPPORTED_URLS, iter_openai_batch_rows
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.parts import write_output_part
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.spec import JobSpec, JobTask, validation_messages

EMBED = {"input_uri": "/in/rows.parquet", "model": "minilm", "task": "embed", "prompt_column": "text"}


def refused(**changes) -> str:
    with pytest.raises(ValidationError) as error:
        JobSpec.model_validate({**EMBED, **changes})
    return "; ".join(validation_messages(error.value))


# ---- the spec ---------------------------------------------------------------------------------

def test_a_job_generates_unless_it_says_embed_and_old_hashes_stay() -> None:
    plain = JobSpec.model_validate({**EMBED, "task": "generate"})
    assert JobSpec.model_validate({key: value for key, value in EMBED.items() if key != "task"}).task == \
        JobTask.GENERATE
    # A field at its default is left out of the hash: specs stored before `task` hash the same.
    assert "task" not in plain.model_dump(exclude_defaults=True)
    embed = JobSpec.model_validate({**EMBED, "dimensions": 128, "truncate": True})
    assert embed.is_embed and embed.dimensions == 128 and embed.truncate
    assert (embed.pooling, embed.normalize) == (None, None)  # the model's own, and out of the hash
    assert not {"pooling", "normalize"} & set(embed.model_dump(exclude_defaults=True))
    chosen = JobSpec.model_validate({**EMBED, "pooling": "last", "normalize": False})
    assert (chosen.pooling, chosen.normalize) == ("last", False)


@pytest.mark.parametrize("changes, expected", [
    ({"messages_column": "chat", "prompt_column": None},
     "messages_column: an embed job embeds text: use prompt_column or template; omit it"),
    ({"response_format": {"type": "json_object"}}, "response_format: an embed job writes vectors"),
    ({"response_format_column": "rf"}, "response_format_column: an embed job writes vectors"),
    ({"sampling_column": "s"}, "sampling_column: an embed job samples nothing"),
    ({"sampling": {"temperature": 0.5, "max_tokens": 3}},
     "sampling: an embed job samples nothing; omit sampling (max_tokens, temperature given)"),
    ({"dimensions": 0}, "dimensions: Input should be greater than or equal to 1"),
    ({"task": "classify"}, "task: Input should be 'generate' or 'embed'"),
    ({"task": "generate", "dimensions": 64}, "dimensions: only an embed job (task: embed)"),
    ({"task": "generate", "truncate": True}, "truncate: only an embed job (task: embed)"),
    ({"task": "generate", "pooling": "mean"}, "pooling: only an embed job (task: embed) pools token vectors"),
    ({"task": "generate", "normalize": False}, "normalize: only an embed job (task: embed) has vectors"),
    ({"task": "generate", "normalize": True}, "normalize: only an embed job (task: embed) has vectors"),
    ({"pooling": "max"}, "pooling: Input should be 'mean', 'cls' or 'last'"),
    ({"task": "generate", "max_length": 64}, "max_length: only an embed job (task: embed) limits its inputs"),
    ({"max_length": 0}, "max_length: Input should be greater than or equal to 1"),
])
def test_what_an_embed_job_cannot_have_is_refused_by_name(changes, expected) -> None:
    data = {**EMBED, **changes}
    with pytest.raises(ValidationError) as error:
        JobSpec.model_validate({key: value for key, value in data.items() if value is not None})
    assert expected in "; ".join(validation_messages(error.value))


@pytest.mark.parametrize("changes", [
    {"sampling": {"temperature": 0.5}}, {"response_format": {"type": "json_object"}},
    {"task": "generate", "dimensions": 64}, {"task": "generate", "truncate": True},
    {"task": None, "truncate": True}, {"task": "generate", "pooling": "last"},
    {"task": None, "normalize": False}, {"pooling": "max"},
])
def test_the_published_schema_states_the_task_rules(changes) -> None:
    data = {key: value for key, value in {**EMBED, **changes}.items() if value is not None}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, JobSpec.model_json_schema())
    # …and what the API sends back for an embed job (every sampling field null) is valid under it.
    stored = JobSpec.model_validate(EMBED).model_dump(mode="json")
    jsonschema.validate(stored, JobSpec.model_json_schema())


def test_embedding_columns_are_reserved_for_passthrough() -> None:
    assert "would collide" in refused(passthrough_columns=["embedding"])


# ---- vectors ---------------------------------------------------------------------------------

def test_shorten_keeps_the_first_values_at_unit_length() -> None:
    vector = [0.6, 0.8, 0.0, 0.0]
    assert list(shorten(vector, None)) == pytest.approx(vector)
    short = shorten([3.0, 4.0, 12.0], 2)
    assert list(short) == pytest.approx([0.6, 0.8]) and short.typecode == "f"
    with pytest.raises(ValueError, match="dimensions 5 is more than the model's 3"):
        shorten([1.0, 0.0, 0.0], 5)
    assert list(shorten([3.0, 4.0, 12.0], 2, renormalize=False)) == [3.0, 4.0]  # a normalize: false job


def test_base64_is_little_endian_float32() -> None:
    vector = array("f", [1.0, -0.5, 0.25])
    assert np.frombuffer(base64.b64decode(base64_vector(vector)), dtype="<f4").tolist() == [1.0, -0.5, 0.25]


# ---- rows --------------------------------------------------------------------------------------

def test_a_parquet_or_jsonl_row_of_an_embed_job_embeds_its_prompt_after_the_instructions() -> None:
    spec = JobSpec.model_validate({**EMBED, "instructions": "query:", "dimensions": 64, "truncate": True,
                                   "passthrough_columns": ["doc"]})
    row = RowBuilder(spec).build(3, {"text": "a cat", "doc": 7})
    assert isinstance(row, Row) and row.is_embed and not row.is_chat
    assert row.embed == EmbedRequest(("query:\n\na cat",), 64, "float", True)
    assert row.passthrough == {"doc": 7}
    templated = RowBuilder(JobSpec.model_validate({**EMBED, "prompt_column": None, "template": "T: {title}"}))
    assert templated.build(0, {"title": "x"}).embed.inputs == ("T: x",)
    missing = RowBuilder(spec).build(4, {"doc": 1})
    assert isinstance(missing, RowError) and missing.code == RowErrorCode.MISSING_COLUMN
    pooled = JobSpec.model_validate({**EMBED, "pooling": "cls", "normalize": False})
    assert RowBuilder(pooled).build(0, {"text": "a"}).embed == EmbedRequest(("a",), None, "float", False,
                                                                           "cls", False)


OPENAI_EMBED = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model="minilm", task="embed",
                       dimensions=32)


def line(custom_id: str, url: str = "/v1/embeddings", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "text-embedding-3-small", **body}}


def read_lines(store, lines: list[dict], spec: JobSpec = OPENAI_EMBED) -> list[Row | RowError]:
    data = b"\n".join(json.dumps(item).encode() for item in lines) + b"\n"
    store.put_bytes("batch.jsonl", data)
    return list(iter_openai_batch_rows(store, "batch.jsonl", 0, len(data), spec))


def test_embeddings_lines_become_embed_rows_of_every_input_shape(local_store) -> None:
    assert "/v1/embeddings" in SUPPORTED_URLS
    one, texts, ids, id_lists, own = read_lines(local_store, [
        line("one", input="hello"),
        line("texts", input=["a", "b"], encoding_format="base64"),
        line("ids", input=[101, 7592, 102]),
        line("id-lists", input=[[101, 102], [5, 6, 7]], user="u"),
        line("own", input="x", dimensions=8, encoding_format="float"),
    ])
    assert one.embed == EmbedRequest(("hello",), 32, "float", False) and one.prompt == "hello"
    assert texts.embed.inputs == ("a", "b") and texts.embed.encoding_format == "base64"
    assert ids.embed.inputs == ((101, 7592, 102),) and ids.prompt is None
    assert id_lists.embed.inputs == ((101, 102), (5, 6, 7))
    assert own.embed.dimensions == 8
    pooled = OPENAI_EMBED.model_copy(update={"pooling": "mean", "normalize": False})
    [row] = read_lines(local_store, [line("one", input="hello")], pooled)
    assert (row.embed.pooling, row.embed.normalize) == ("mean", False)  # the job's, on every line


@pytest.mark.parametrize("body, expected", [
    ({"input": ""}, "body.input is empty; there is nothing to embed"),
    ({"input": []}, "body.input must be a string, a non-empty list"),
    ({"input": ["a", 3]}, "body.input[1] must be a non-empty string or a non-empty list of token ids"),
    ({"input": [[1, -2]]}, "body.input must be a non-empty string or a non-empty list of token ids"),
    ({"input": "a", "encoding_format": "int8"}, "body.encoding_format must be one of float, base64"),
    ({"input": "a", "dimensions": 0}, "body.dimensions must be a whole number ≥ 1, got 0"),
    ({"input": "a", "temperature": 0.5}, "body.temperature is not supported in an /v1/embeddings body"),
])
def test_a_bad_embeddings_body_is_that_rows_error(local_store, body, expected) -> None:
    bad, good = read_lines(local_store, [line("bad", **body), line("good", input="fine")])
    assert isinstance(bad, RowError) and bad.code == RowErrorCode.INVALID_ROW and expected in bad.message
    assert isinstance(good, Row)


def test_one_job_runs_one_task_a_line_of_the_other_is_its_rows_error(local_store) -> None:
    chat = line("chat", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    embed_job = read_lines(local_store, [chat, line("e", input="x")])
    assert isinstance(embed_job[0], RowError) and embed_job[0].code == RowErrorCode.UNSUPPORTED_URL
    assert "this job embeds (task embed): only /v1/embeddings lines run here" in embed_job[0].message
    assert isinstance(embed_job[1], Row)
    generate = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model="m")
    generate_job = read_lines(local_store, [line("e", input="x"), chat], generate)
    assert isinstance(generate_job[0], RowError) and "needs an embed job" in generate_job[0].message
    assert isinstance(generate_job[1], Row) and generate_job[1].is_chat


# ---- outputs -----------------------------------------------------------------------------------

def vector(*values: float) -> array:
    return array("f", values)


def embed_outputs(spec: JobSpec) -> list[OutputRow]:
    builder = RowBuilder(spec)
    rows = [builder.build(index, {"text": f"t{index}", "doc": f"d{index}"}) for index in range(3)]
    failed = OutputRow.engine_failed(rows[1], RowErrorCode.PROMPT_TOO_LONG, "too long")
    return [OutputRow.embedded(rows[2], [vector(0.0, 1.0, 0.0)], prompt_tokens=4), failed,
            OutputRow.embedded(rows[0], [vector(0.6, 0.8, 0.0)], prompt_tokens=5)]


def is_float32_vectors(column_type: pa.DataType, size: int) -> bool:
    return (pa.types.is_fixed_size_list(column_type) and column_type.list_size == size
            and column_type.value_type == pa.float32())


def embed_spec(output_format: str, **fields) -> JobSpec:
    return JobSpec.model_validate({**EMBED, "input_format": "parquet", "output_format": output_format,
                                   "passthrough_columns": ["doc"], **fields})


def test_parquet_embedding_column_is_fixed_size_float32_and_reads_into_numpy(local_store) -> None:
    spec = embed_spec("parquet")
    write_output_part(local_store, "part.parquet", embed_outputs(spec), spec, job_id="j")
    table = pq.read_table(io.BytesIO(local_store.get_bytes("part.parquet")))
    assert table.column_names == ["id", "embedding", "prompt_tokens", "error_code", "error", "doc"]
    assert is_float32_vectors(table.schema.field("embedding").type, 3)
    column = table.column("embedding").combine_chunks()
    assert column.is_null().to_pylist() == [False, True, False]
    matrix = column.flatten().to_numpy().reshape(-1, 3)  # nulls hold no values: the two vectors
    assert matrix.dtype == np.float32
    np.testing.assert_allclose(matrix, [[0.6, 0.8, 0.0], [0.0, 1.0, 0.0]], rtol=1e-7)
    assert table.column("prompt_tokens").to_pylist() == [5, None, 4]
    assert table.column("error_code").to_pylist() == [None, "prompt_too_long", None]
    frame = table.to_pandas()
    assert np.stack(frame["embedding"].dropna().to_numpy()).shape == (2, 3)


def test_a_parquet_part_of_failed_rows_only_keeps_the_jobs_column_type(local_store) -> None:
    spec = embed_spec("parquet")
    failed = [row for row in embed_outputs(spec) if row.failed]
    write_output_part(local_store, "part.parquet", failed, spec, job_id="j", embedding_dimension=3)
    schema = pq.read_schema(io.BytesIO(local_store.get_bytes("part.parquet")))
    assert is_float32_vectors(schema.field("embedding").type, 3)


def test_jsonl_embedding_is_a_float_list(local_store) -> None:
    spec = embed_spec("jsonl")
    write_output_part(local_store, "part.jsonl", embed_outputs(spec), spec, job_id="j")
    lines = [json.loads(item) for item in local_store.get_bytes("part.jsonl").splitlines()]
    assert lines[0] == {"id": "0", "embedding": pytest.approx([0.6, 0.8, 0.0]),
                        "usage": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 0},
                        "error": None, "doc": "d0"}
    assert lines[1]["embedding"] is None and lines[1]["error"]["code"] == "prompt_too_long"


def test_openai_bodies_parse_as_the_sdks_embedding_response_in_float_and_base64(local_store) -> None:
    texts, encoded = read_lines(local_store, [line("f", input=["a", "b"]),
                                              line("b", input="c", encoding_format="base64")])
    first = OutputRow.embedded(texts, [vector(0.6, 0.8), vector(1.0, 0.0)], prompt_tokens=6)
    record = openai_batch_record(first, job_id="j", model="minilm", created=1)
    assert record["custom_id"] == "f" and record["error"] is None
    body = CreateEmbeddingResponse.model_validate(record["response"]["body"])
    assert body.object == "list" and body.model == "minilm"
    assert [item.index for item in body.data] == [0, 1] and body.data[0].object == "embedding"
    assert body.data[0].embedding == pytest.approx([0.6, 0.8])
    assert (body.usage.prompt_tokens, body.usage.total_tokens) == (6, 6)
    second = OutputRow.embedded(encoded, [vector(0.25, -0.5)], prompt_tokens=3)
    raw = openai_batch_record(second, job_id="j", model="minilm", created=1)["response"]["body"]
    # As the SDK reads a base64 response: built leniently, then decoded by its own post-parser.
    parsed = parse_embedding_response(CreateEmbeddingResponse.construct(**raw), encoding_format=omit)
    assert parsed.data[0].embedding == [0.25, -0.5]
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist() == [0.25, -0.5]
    failed = OutputRow.engine_failed(encoded, RowErrorCode.PROMPT_TOO_LONG, "input 0 has 300 tokens")
    assert openai_batch_record(failed, job_id="j", model="m", created=1)["error"]["code"] == "prompt_too_long"


def test_an_openai_embed_job_written_to_parquet_keeps_each_lines_vectors(local_store) -> None:
    rows = read_lines(local_store, [line("f", input=["a", "b"]), line("g", input="c", dimensions=1)])
    spec = OPENAI_EMBED.model_copy(update={"output_format": "parquet"})
    outputs = [OutputRow.embedded(rows[0], [vector(0.6, 0.8), vector(1.0, 0.0)], prompt_tokens=6),
               OutputRow.embedded(rows[1], [vector(1.0)], prompt_tokens=2)]
    write_output_part(local_store, "part.parquet", outputs, spec, job_id="j")
    table = pq.read_table(io.BytesIO(local_store.get_bytes("part.parquet")))
    values = table.column("embeddings").to_pylist()
    assert [[len(item) for item in row] for row in values] == [[2, 2], [1]]
    assert math.isclose(values[0][0][1], 0.8, rel_tol=1e-6)
