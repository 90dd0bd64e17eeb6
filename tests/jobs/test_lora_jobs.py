"""LoRA adapters in the job domain: registering them (settings, flags), choosing one per job, per row
and per OpenAI/Anthropic line, and keeping rows of different adapters apart (dedup, usage)."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from bulkinfer.jobs.formats.anthropic_messages import AnthropicMessagesRowBuilder
from bulkinfer.jobs.formats.jsonl_writer import jsonl_output_record
from bulkinfer.jobs.formats.openai_batch import OpenAIBatchRowBuilder
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import Choice, OutputRow
from bulkinfer.jobs.formats.parquet_writer import output_table
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.lora_adapters import AdapterRegistry, UnknownAdapter
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.planning.estimate import estimate_job
from bulkinfer.jobs.planning.job_dedup import row_key
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.settings import ConfigError, Settings
from bulkinfer.jobs.settings_args import add_settings_arguments, settings_from_args
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.manifest import manifest_of

MODELS = {"tiny": "/models/tiny", "small": "/models/small"}
ADAPTERS = json.dumps({"sql": "s3://adapters/sql", "fr": {"location": "/srv/fr", "model": "tiny"}})


def registry() -> ModelRegistry:
    return ModelRegistry(MODELS, {"gpt-4o-mini": "tiny"}, AdapterRegistry.parse(ADAPTERS))


def test_adapters_register_per_base_model_and_unknown_names_are_refused_naming_the_registered() -> None:
    models = registry()
    assert models.adapters_of("tiny") == ["fr", "sql"]
    assert models.adapters_of("small") == ["sql"]  # an adapter without a model fits every served one
    assert models.adapters.get("tiny", "fr").location == "/srv/fr"
    with pytest.raises(UnknownAdapter, match=r"'fr' is neither model 'small' nor a LoRA adapter registered "
                                             r"on it \(registered: sql\)"):
        models.adapters.get("small", "fr")
    # A batch line's model: a served model, an alias, or an adapter (then its base).
    assert models.resolve_requested("fr") == ("tiny", "fr")
    assert models.resolve_requested("gpt-4o-mini") == ("tiny", None)
    # A row's adapter: the base by its own name or an alias; a location as it is; an unknown name
    # fails only where the row requires it.
    assert models.row_adapter("tiny", "gpt-4o-mini") is None
    assert models.row_adapter("tiny", "s3://bucket/a") == "s3://bucket/a"
    assert models.row_adapter("small", "gpt-4o", required=False) is None
    with pytest.raises(UnknownAdapter):
        models.row_adapter("small", "gpt-4o")


@pytest.mark.parametrize(("text", "problem"), [
    ('{"tiny": "/a"}', "has the name of a served model"),
    ('{"gpt-4o-mini": "/a"}', "has the name of a served model or alias"),
    ('{"x": {"location": "/a", "model": "big"}}', "registered on model 'big', which is not served"),
])
def test_adapters_that_clash_with_served_names_or_pin_an_unserved_model_are_refused(text, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        ModelRegistry(MODELS, {"gpt-4o-mini": "tiny"}, AdapterRegistry.parse(text))


def test_settings_take_adapters_as_json_a_toml_table_or_name_equals_location(tmp_path) -> None:
    from_env = Settings.from_env({"BULKINFER_LORA_ADAPTERS": "sql=s3://a/sql,fr=/srv/fr"})
    assert [(a.name, a.location) for a in AdapterRegistry.parse(from_env.lora_adapters).all()] == \
        [("fr", "/srv/fr"), ("sql", "s3://a/sql")]
    config = tmp_path / "bulkinfer.toml"
    config.write_text('[lora_adapters]\nsql = "s3://a/sql"\nfr = { location = "/srv/fr", model = "tiny" }\n')
    from_file = Settings.from_env({}, config=config, models=json.dumps(MODELS))
    assert from_file.model_registry().adapters_of("small") == ["sql"]
    # Registered adapters turn LoRA on in the engines, with the limits passed through.
    assert Settings(lora_adapters='{"sql": "/a"}', max_loras=4).engine_options_dict() == \
        {"enable_lora": True, "max_loras": 4}
    assert Settings().engine_options_dict() == {}
    with pytest.raises(ConfigError, match="BULKINFER_LORA_ADAPTERS: lora_adapters: 'oops' is not NAME="):
        Settings.from_env({"BULKINFER_LORA_ADAPTERS": "oops"})


def test_lora_flags_add_to_the_adapters_the_environment_gives(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["lora_adapters", "max_lora_rank"])
    monkeypatch.setenv("BULKINFER_LORA_ADAPTERS", '{"sql": "/srv/sql"}')
    monkeypatch.delenv("BULKINFER_CONFIG", raising=False)
    args = parser.parse_args(["--lora", "fr=s3://a/fr", "--lora", "de=/srv/de", "--max-lora-rank", "32"])
    settings = settings_from_args(args)
    assert {a.name: a.location for a in AdapterRegistry.parse(settings.lora_adapters).all()} == \
        {"sql": "/srv/sql", "fr": "s3://a/fr", "de": "/srv/de"}
    assert settings.engine_options_dict() == {"enable_lora": True, "max_lora_rank": 32}
    with pytest.raises(ConfigError, match="--lora 'fr': expected NAME=LOCATION"):
        settings_from_args(parser.parse_args(["--lora", "fr"]))


def test_a_row_runs_on_its_lora_column_adapter_else_the_jobs_else_the_base() -> None:
    spec = JobSpec(input_uri="/in/x.jsonl", model="tiny", prompt_column="q", lora="sql",
                   lora_column="adapter")
    builder = RowBuilder(spec)
    assert builder.build(0, {"q": "a", "adapter": "fr"}).lora == "fr"
    assert builder.build(1, {"q": "a", "adapter": None}).lora == "sql"
    assert builder.build(2, {"q": "a", "adapter": ""}).lora == "sql"
    assert RowBuilder(spec.model_copy(update={"lora": None})).build(3, {"q": "a"}).lora is None
    not_text = builder.build(4, {"q": "a", "adapter": 7})
    assert isinstance(not_text, RowError) and not_text.code == RowErrorCode.INVALID_ROW
    # A location is the job's to give (the API checks the caller may read it), never a row's.
    location = builder.build(5, {"q": "a", "adapter": "s3://other-tenant/adapter"})
    assert isinstance(location, RowError) and location.code == RowErrorCode.UNKNOWN_LORA
    assert "is a location" in location.message


@pytest.mark.parametrize(("fields", "problem"), [
    ({"task": "embed", "lora": "sql"}, "lora: an embed job runs no LoRA adapter"),
    ({"input_format": "openai_batch", "prompt_column": None, "lora_column": "a"},
     "lora_column: OpenAI batch lines choose their adapter by body.model"),
    ({"lora": "s3://"}, "lora"),
    ({"lora_column": "a", "passthrough_columns": ["lora"]}, "'lora' would collide"),
])
def test_specs_refuse_adapters_where_they_cannot_apply(fields, problem) -> None:
    data = {"input_uri": "/in/x.jsonl", "model": "tiny", "prompt_column": "q", **fields}
    with pytest.raises(ValidationError, match=problem):
        JobSpec.model_validate({key: value for key, value in data.items() if value is not None})


def test_openai_and_anthropic_lines_choose_an_adapter_by_their_model() -> None:
    spec = JobSpec(input_uri="/in/b.jsonl", input_format="openai_batch", model="tiny")
    openai = OpenAIBatchRowBuilder(spec)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    line = type("Line", (), {"offset": 0, "number": 1})()
    adapter = openai.build(line, {"custom_id": "a", "url": "/v1/chat/completions",
                                  "body": {"model": "sql", **chat}})
    base = openai.build(line, {"custom_id": "b", "url": "/v1/chat/completions",
                               "body": {"model": "tiny", **chat}})
    assert (adapter.lora, adapter.lora_required) == ("sql", False)  # gpt-4o-mini in a file runs the base
    assert base.lora is None
    anthropic = AnthropicMessagesRowBuilder(spec, None)
    params = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic.row(0, "c", {"model": "fr", **params}, 1).lora == "fr"
    assert anthropic.row(0, "d", {"model": "tiny", **params}, 1).lora is None


def _row(lora: str | None) -> Row:
    return Row(0, "r", "same prompt", None, JobSpec(input_uri="/x.jsonl", model="tiny", prompt_column="q",
                                                     sampling={"temperature": 0}).sampling, None, lora=lora)


def test_rows_equal_but_for_their_adapter_are_not_copies() -> None:
    keys = {row_key(_row(lora)) for lora in (None, "sql", "fr")}
    assert len(keys) == 3
    assert row_key(_row("sql")) == row_key(_row("sql"))


def test_outputs_name_the_adapter_each_row_ran_on() -> None:
    row = OutputRow(0, "r", text="hi", finish_reason="stop", prompt_tokens=3, cached_tokens=0,
                    completion_tokens=2, choices=(Choice(0, "hi", "stop"),), lora="sql")
    assert jsonl_output_record(row, False)["usage"]["lora"] == "sql"
    body = openai_batch_record(row, job_id="j", model="tiny", created=0)["response"]["body"]
    assert body["model"] == "sql"  # as vLLM's server names the adapter a request ran on
    base = OutputRow(1, "b", text="x", finish_reason="stop", prompt_tokens=1, cached_tokens=0,
                     completion_tokens=1)
    assert "lora" not in jsonl_output_record(base, False)["usage"]
    table = output_table([row, base], False, [], include_lora=True)
    assert table.column("lora").to_pylist() == ["sql", None]


def test_job_usage_is_split_by_adapter(tmp_path) -> None:
    from datetime import UTC, datetime

    from bulkinfer.jobs.planning.sharding import ShardPlan
    from bulkinfer.jobs.state.results import PartFile, ShardResult

    part = PartFile(key="k", uri="u", rows=0, bytes=0, sha256="")
    rows = [OutputRow(i, str(i), text="t", finish_reason="stop", prompt_tokens=10, cached_tokens=0,
                      completion_tokens=i + 1, lora=lora)
            for i, lora in enumerate(["sql", None, "sql", "fr"])]
    now = datetime.now(UTC)
    results = [ShardResult.from_outputs(ShardPlan(index=i, estimated_rows=2, rows_exact=True), chunk,
                                        output=part, errors=part, started_at=now, finished_at=now)
               for i, chunk in enumerate([rows[:2], rows[2:]])]
    manifest = manifest_of("j", "h", "jsonl", results)
    assert {name: (u.prompt, u.completion) for name, u in manifest.usage_by_lora.items()} == \
        {"fr": (10, 4), "sql": (20, 4)}
    assert manifest.usage.completion == 10  # the base's 2 tokens are the rest


def test_a_dry_run_counts_rows_per_adapter_and_unknown_row_adapters_as_failing(local_store) -> None:
    lines = [{"q": "a", "adapter": "sql"}, {"q": "b", "adapter": "sql"}, {"q": "c"},
             {"q": "d", "adapter": "nope"}]
    local_store.put_bytes("rows.jsonl", b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    spec = JobSpec(input_uri="/rows.jsonl", input_format="jsonl", model="tiny", prompt_column="q",
                   lora_column="adapter")
    plan = plan_shards(local_store, "rows.jsonl", spec)
    estimate = estimate_job(local_store, "rows.jsonl", spec, plan, None, [], 0, registry=registry())
    assert estimate.rows_by_lora == {"sql": 2}
    assert estimate.rows_failing == 1
