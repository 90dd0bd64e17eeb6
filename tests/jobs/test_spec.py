"""JobSpec validation: every error names the field and the problem; the hash is stable."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from bulkinfer.jobs.spec import InputFormat, JobSpec, format_from_name, validation_messages

BASE = {"input_uri": "s3://bucket/in/rows.jsonl", "model": "tiny-llama", "prompt_column": "question"}


def problems(**changes) -> list[str]:
    data = {**BASE, **changes}
    data = {key: value for key, value in data.items() if value is not None}
    with pytest.raises(ValidationError) as error:
        JobSpec.model_validate(data)
    return validation_messages(error.value)


def test_a_minimal_spec_gets_documented_defaults() -> None:
    spec = JobSpec.model_validate(BASE)
    assert spec.shard_size == 1000 and spec.priority == 5 and spec.metadata == {}
    assert spec.input_format is None and spec.effective_output_format is None
    assert spec.input_columns() == ["question"]


@pytest.mark.parametrize("changes, expected", [
    ({"sampling": {"temperature": 2.5}}, "sampling.temperature: Input should be less than or equal to 2"),
    ({"sampling": {"top_p": 0}}, "sampling.top_p: Input should be greater than 0"),
    ({"sampling": {"max_tokens": -1}}, "sampling.max_tokens: Input should be greater than or equal to 0"),
    ({"sampling": {"prompt_logprobs": 21}},
     "sampling.prompt_logprobs: Input should be less than or equal to 20"),
    ({"sampling": {"stop": ["a", ""]}}, "sampling.stop: stop strings must not be empty"),
    ({"sampling": {"temprature": 1}}, "sampling.temprature: Extra inputs are not permitted"),
    ({"shard_size": 0}, "shard_size: Input should be greater than or equal to 1"),
    ({"priority": 10}, "priority: Input should be less than or equal to 9"),
    ({"input_uri": "gs://bucket/rows.jsonl"}, "input_uri: unsupported URI scheme"),
    ({"input_uri": "rows.jsonl"}, "input_uri: local paths must be absolute"),
    ({"input_uri": "s3://bucket/folder/"}, "input_uri: input_uri must name one object"),
    ({"output_uri": "ftp://host/out"}, "output_uri: unsupported URI scheme"),
    ({"model": ""}, "model: String should have at least 1 character"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata: at most 16 key/value pairs, got 17"),
    ({"metadata": {"k" * 65: "v"}}, "metadata: key 'kkkk"),
    ({"metadata": {"team": "x" * 513}}, "metadata: value of 'team' is longer than 512 characters"),
    ({"metadata": {"team": 7}}, "metadata.team: Input should be a valid string"),
    ({"template": "Q: {question}"}, "give exactly one of prompt_column, messages_column or template, "
                                    "not prompt_column and template"),
    ({"prompt_column": None, "template": "no placeholder"}, "template: template has no {column} placeholder"),
    ({"prompt_column": None, "template": "{q!r}"}, "template: placeholder {q...} has a conversion"),
    ({"prompt_column": None, "template": "{q"}, "template: unbalanced braces"),
    ({"prompt_column": None, "input_format": "jsonl"}, "jsonl input needs exactly one of prompt_column"),
    ({"input_format": "openai_batch"}, "prompt_column: OpenAI batch lines carry their own request body"),
    ({"input_format": "xlsx"},
     "input_format: Input should be 'parquet', 'jsonl', 'openai_batch', 'csv' or 'tsv'"),
    ({"csv_encoding": "utf-16"}, "csv_encoding: 'utf-16' is not an encoding CSV rows can be read in"),
    ({"csv_encoding": "klingon"}, "csv_encoding: unknown text encoding 'klingon'"),
    ({"input_format": "jsonl", "csv_encoding": "cp1252"}, "csv_encoding: only CSV or TSV input has a text"),
    ({"passthrough_columns": ["text", "source"]}, "passthrough_columns: text would collide"),
    ({"passthrough_columns": ["prompt_logprobs"]}, "passthrough_columns: prompt_logprobs would collide"),
    ({"passthrough_columns": ["a", "a"]}, "passthrough_columns: columns are listed more than once"),
    ({"output_format": "openai_batch", "passthrough_columns": ["a"]},
     "passthrough_columns: OpenAI batch output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
     "response_format.json_schema.json_schema.name: String should match pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.json_schema.schema: Field required"),
    ({"response_format": {"type": "xml"}}, "response_format: Input tag 'xml'"),
    ({"idempotency_key": ""}, "idempotency_key: String should have at least 1 character"),
])
def test_validation_errors_name_the_field_and_the_problem(changes, expected) -> None:
    messages = problems(**changes)
    assert any(message.startswith(expected) for message in messages), messages


def test_an_image_job_may_ask_every_row_the_same_question() -> None:
    spec = JobSpec.model_validate({**BASE, "prompt_column": None, "template": "Caption this photo.",
                                   "image_column": "photo"})
    assert spec.prompt_template is not None and spec.prompt_template.columns == []


def test_sampling_accepts_the_openai_and_vllm_knobs() -> None:
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "max_tokens": 64, "seed": 3,
                "stop": "\n", "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}
    spec = JobSpec.model_validate({**BASE, "sampling": sampling})
    assert spec.sampling.stop == ["\n"]  # one string becomes a list, as OpenAI treats it
    assert spec.sampling.merged({"temperature": 0.0}).temperature == 0.0
    assert spec.sampling.merged({"temperature": 0.0}).top_k == 40


def test_spec_hash_ignores_key_order_defaults_and_the_idempotency_key() -> None:
    explicit = JobSpec.model_validate({**BASE, "shard_size": 1000, "priority": 5, "idempotency_key": "a"})
    reordered = JobSpec.model_validate(dict(reversed(list({**BASE, "idempotency_key": "b"}.items()))))
    assert explicit.spec_hash() == reordered.spec_hash()
    assert explicit.spec_hash() != JobSpec.model_validate({**BASE, "shard_size": 999}).spec_hash()
    assert explicit.spec_hash() != JobSpec.model_validate({**BASE, "sampling": {"seed": 1}}).spec_hash()
    # Pinned: a stored job's hash must still match after an upgrade adds fields with defaults.
    # The hash of the fields that differ from their defaults, as compact sorted JSON.
    pinned = b'{"input_uri":"s3://bucket/in/rows.jsonl","model":"tiny-llama","prompt_column":"question"}'
    assert explicit.spec_hash() == hashlib.sha256(pinned).hexdigest()
    assert JobSpec.model_validate_json(explicit.canonical_json()).spec_hash() == explicit.spec_hash()


def test_the_stored_spec_keeps_a_json_schemas_property_order() -> None:
    """The model writes properties in the schema's order: job.json must not re-sort them."""
    properties = {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}}
    schema = {"type": "object", "required": ["name", "city"], "properties": properties}
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    spec = JobSpec.model_validate({**BASE, "response_format": response_format})
    stored = JobSpec.model_validate_json(spec.canonical_json())
    assert list(stored.response_format.json_schema.json_schema["properties"]) == ["name", "city", "age"]


def test_with_formats_fills_the_output_format_and_revalidates() -> None:
    spec = JobSpec.model_validate(BASE).with_formats(InputFormat.JSONL)
    assert (spec.input_format, spec.output_format) == (InputFormat.JSONL, InputFormat.JSONL)
    kept = JobSpec.model_validate({**BASE, "output_format": "parquet"}).with_formats("jsonl")
    assert kept.output_format == InputFormat.PARQUET
    with pytest.raises(ValidationError, match="OpenAI batch lines carry their own request body"):
        JobSpec.model_validate(BASE).with_formats(InputFormat.OPENAI_BATCH)


def test_input_columns_cover_every_column_a_row_is_read_from() -> None:
    spec = JobSpec.model_validate({
        **BASE, "prompt_column": None, "template": "{title}: {body} ({title})", "id_column": "doc_id",
        "sampling_column": "params", "response_format_column": "schema", "passthrough_columns": ["source"]})
    assert spec.input_columns() == ["doc_id", "params", "schema", "title", "body", "source"]
    assert spec.required_columns() == ["doc_id", "title", "body"]
    pictured = JobSpec.model_validate({**BASE, "image_column": "photo"})
    assert pictured.required_columns() == [BASE["prompt_column"], "photo"]  # a misspelling: caught at submit


@pytest.mark.parametrize("name, expected", [
    ("in/rows.parquet", InputFormat.PARQUET), ("ROWS.PQ", InputFormat.PARQUET),
    ("rows.jsonl", InputFormat.JSONL), ("rows.ndjson", InputFormat.JSONL), ("rows.csv", InputFormat.CSV),
    ("Export.TSV", InputFormat.TSV), ("rows.tab", InputFormat.TSV), ("rows.csv.gz", None), ("rows", None),
])
def test_format_from_name(name, expected) -> None:
    assert format_from_name(name) == expected


def test_the_schema_states_which_passthrough_names_the_outputs_already_use() -> None:
    # Clients (and the API fuzzer) read the rule from the schema instead of learning it from a 422.
    items = JobSpec.model_json_schema()["properties"]["passthrough_columns"]["items"]
    assert {"text", "usage", "error"} <= set(items["not"]["enum"]) and items["type"] == "string"
