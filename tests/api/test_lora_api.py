"""LoRA adapters at the API (no workers): listed per model, a job's `lora` checked at submit (a name
must be registered; a location must be readable by the caller and hold an adapter), a dry run's
per-adapter counts, and batch files whose `model` names an adapter."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from bulkinfer.api.client import Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import BUCKET, MODELS, refused, serve

ROWS = b'{"q": "def f(x):", "adapter": "sql"}\n{"q": "class A:", "adapter": "nope"}\n{"q": "x = 1"}\n'
ADAPTERS = {"sql": "s3://adapters/sql", "fr": {"location": "/srv/fr", "model": "tiny"}}
KEYS = "acme=acme-key,globex=globex-key"


@pytest.fixture
def api(s3, redis_url):
    s3.client().create_bucket(Bucket=BUCKET)
    settings = Settings(broker_url=redis_url, store_uri=f"s3://{BUCKET}/deploy",
                        s3_endpoint_url=s3.endpoint_url, models=json.dumps(MODELS),
                        lora_adapters=json.dumps(ADAPTERS), api_keys=KEYS)
    with serve(settings) as running:
        yield running


def test_models_list_each_base_models_adapters(api) -> None:
    listed = httpx.get(f"{api.url}/models", headers={"Authorization": "Bearer acme-key"}).json()
    assert listed == {"models": ["small", "tiny"], "adapters": {"small": ["sql"], "tiny": ["fr", "sql"]}}
    with Client(api.url, api_key="acme-key") as sdk:
        assert sdk.lora_adapters() == listed["adapters"]
    v1 = httpx.get(f"{api.url}/v1/models", headers={"Authorization": "Bearer acme-key"}).json()["data"]
    assert [(model["id"], model.get("parent")) for model in v1] == \
        [("small", None), ("tiny", None), ("fr", "tiny"), ("sql", None)]  # sql: on both models


def test_a_job_level_adapter_must_be_registered_on_the_model_or_a_location_the_tenant_may_read(api) -> None:
    with Client(api.url, api_key="acme-key") as acme:
        uri = api.put_tenant_input("acme", "rows.jsonl", ROWS)
        job = {"input_uri": uri, "model": "small", "prompt_column": "q"}
        unknown = refused(lambda: acme.jobs.create({**job, "lora": "fr"}))
        assert unknown.status_code == 400
        assert "'fr' is neither model 'small' nor a LoRA adapter registered on it (registered: sql)" in \
            unknown.message
        assert acme.jobs.create({**job, "lora": "sql"}).state == "queued"
        # By location: inside the caller's own folder, and holding an adapter.
        mine = api.tenant_uri("acme", "adapters/mine")
        empty = refused(lambda: acme.jobs.create({**job, "lora": mine}))
        assert empty.status_code == 400 and "adapter_config.json is missing" in empty.message
        api.put_uri(f"{mine}/adapter_config.json", b'{"peft_type": "LORA", "r": 4}')
        assert acme.jobs.create({**job, "lora": mine, "idempotency_key": "by-location"}).state == "queued"
        theirs = api.tenant_uri("globex", "adapters/theirs")
        api.put_uri(f"{theirs}/adapter_config.json", b'{"peft_type": "LORA", "r": 4}')
        other = refused(lambda: acme.jobs.create({**job, "lora": theirs}))
        assert other.status_code == 403 and "outside the prefixes tenant 'acme' may use" in other.message


def test_a_location_adapter_needs_lora_enabled(s3, redis_url) -> None:
    s3.client().create_bucket(Bucket=BUCKET)
    settings = Settings(broker_url=redis_url, store_uri=f"s3://{BUCKET}/deploy",
                        s3_endpoint_url=s3.endpoint_url, models=json.dumps(MODELS))
    with serve(settings) as api:
        uri = api.put_input("rows.jsonl", ROWS)
        job = {"input_uri": uri, "model": "tiny", "prompt_column": "q", "lora": f"s3://{BUCKET}/inputs/adapter"}
        error = refused(lambda: api.client.jobs.create(job))
        assert error.status_code == 400 and "runs no LoRA adapters" in error.message


def test_a_dry_run_counts_rows_per_adapter_and_an_unregistered_rows_adapter_as_failing(api) -> None:
    with Client(api.url, api_key="acme-key") as acme:
        uri = api.put_tenant_input("acme", "rows.jsonl", ROWS)
        estimate = acme.jobs.estimate({"input_uri": uri, "model": "tiny", "prompt_column": "q",
                                       "lora_column": "adapter", "lora": "fr"})
    assert estimate.rows == 3 and estimate.rows_failing == 1
    assert estimate.rows_by_lora == {"fr": 1, "sql": 1}  # the row without one runs on the job's


def _batch_file(models: list[str]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
                               ).encode() + b"\n" for n, model in enumerate(models))


def test_an_openai_batch_may_name_adapters_of_one_base_model_and_runs_on_that_base(api) -> None:
    import openai

    sdk = openai.OpenAI(base_url=f"{api.url}/v1", api_key="acme-key", max_retries=0)
    def create(models: list[str]):  # noqa: ANN202
        file = sdk.files.create(file=("a.jsonl", io.BytesIO(_batch_file(models))), purpose="batch")
        return sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

    batch = create(["fr", "tiny", "fr"])
    assert batch.status == "validating" and batch.model == "tiny"
    # fr is tiny's only: small and fr are two base models.
    [mixed] = create(["small", "fr"]).errors.data
    assert (mixed.code, mixed.line) == ("mismatched_model", 2) and "'fr' (model 'tiny')" in mixed.message
    # sql is registered on both served models: a line cannot say which.
    [ambiguous] = create(["sql"]).errors.data
    assert (ambiguous.code, ambiguous.line) == ("model_not_found", 1)
    assert "'sql' is a LoRA adapter registered on every served model" in ambiguous.message


def test_an_anthropic_batch_keeps_an_adapters_name_in_its_requests(api) -> None:
    params = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body = {"requests": [{"custom_id": "a", "params": {"model": "fr", **params}},
                         {"custom_id": "b", "params": {"model": "tiny", **params}}]}
    created = httpx.post(f"{api.url}/v1/messages/batches", json=body, headers={"x-api-key": "acme-key"})
    assert created.status_code == 200, created.text
    job_id = "job-" + created.json()["id"].removeprefix("msgbatch_")
    spec = api.repository.get_spec(job_id)
    assert spec.model == "tiny"
    store_key = spec.input_uri.removeprefix(f"s3://{BUCKET}/")
    lines = [json.loads(line) for line in api.store.get_bytes(store_key).splitlines()]
    assert [line["body"]["model"] for line in lines] == ["fr", "tiny"]


def test_a_schedules_job_template_is_held_to_the_same_adapter_checks(api) -> None:
    """Its ticks create jobs without POST /jobs: the template's lora is checked when it is created."""
    theirs = api.tenant_uri("globex", "adapters/theirs")
    api.put_uri(f"{theirs}/adapter_config.json", b'{"peft_type": "LORA", "r": 4}')
    with Client(api.url, api_key="acme-key") as acme:
        schedule = {"cron": "* * * * *", "input_prefix": api.tenant_uri("acme", "incoming/")}
        template = {"model": "tiny", "prompt_column": "q"}
        other = refused(lambda: acme.schedules.create({**schedule, "job": {**template, "lora": theirs}}))
        assert other.status_code == 403 and "lora" in other.message
        unknown = refused(lambda: acme.schedules.create({**schedule, "job": {**template, "lora": "nope"}}))
        assert unknown.status_code == 400 and "registered: fr, sql" in unknown.message
        assert acme.schedules.create({**schedule, "job": {**template, "lora": "fr"}}).job["lora"] == "fr"


def test_an_uploads_adapter_location_is_checked_as_the_callers_tenant(api) -> None:
    theirs = api.tenant_uri("globex", "adapters/theirs")
    api.put_uri(f"{theirs}/adapter_config.json", b'{"peft_type": "LORA", "r": 4}')
    spec = {"model": "tiny", "prompt_column": "q", "lora": theirs, "tenant": "globex"}  # tenant: replaced
    response = httpx.post(f"{api.url}/jobs", headers={"Authorization": "Bearer acme-key"},
                          files={"spec": (None, json.dumps(spec)), "file": ("rows.jsonl", ROWS)})
    assert response.status_code == 403 and "outside the prefixes tenant 'acme' may use" in response.text


def test_models_of_a_deployment_without_adapters_answer_as_before(s3, redis_url) -> None:
    s3.client().create_bucket(Bucket=BUCKET)
    settings = Settings(broker_url=redis_url, store_uri=f"s3://{BUCKET}/deploy",
                        s3_endpoint_url=s3.endpoint_url, models=json.dumps(MODELS))
    with serve(settings) as api:
        assert httpx.get(f"{api.url}/models").json() == {"models": ["small", "tiny"]}
        assert api.client.lora_adapters() == {}
