"""`model_aliases` names work wherever a model is named, not only under `/v1`: `POST /jobs` (JSON and
upload), dry runs, the SDK, `bulkinfer submit` and schedules accept an alias and store the served
model it names. A name that is neither served nor an alias is refused naming the served models, the
aliases and the setting that adds one: on `/jobs`, and through the official `openai` and `anthropic`
clients. The live API over real HTTP with real Redis and a local store; no worker is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from bulkinfer.api.cli import main
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, RunningApi, refused, serve

ALIASES = {"gpt-4o-mini": "tiny"}
ROWS = b'{"q": "hello"}\n{"q": "bye"}\n'
# What a deployment serving MODELS with ALIASES says about a name it does not know.
HOW_TO_ADD = ("to send 'claude-haiku-4-5' to a served model, add an alias: BULKINFER_MODEL_ALIASES="
              "'{\"gpt-4o-mini\": \"tiny\", \"claude-haiku-4-5\": \"small\"}' (the model_aliases setting)")
LISTED = "(served: small, tiny; aliases: gpt-4o-mini → tiny)"


@pytest.fixture
def api(redis_url: str, tmp_path: Path) -> Iterator[RunningApi]:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        model_aliases=json.dumps(ALIASES))
    with serve(settings) as running:
        yield running


def test_jobs_uploads_and_dry_runs_take_an_alias_and_run_the_served_model(api: RunningApi) -> None:
    jobs = api.client.jobs
    by_uri = jobs.create(input=api.put_input("rows.jsonl", ROWS), model="gpt-4o-mini", prompt_column="q")
    uploaded = jobs.create(input=[{"q": "hello"}], model="gpt-4o-mini", prompt_column="q")
    assert jobs.spec(by_uri).model == "tiny" and jobs.spec(uploaded).model == "tiny"
    assert jobs.estimate(input=[{"q": "hello"}], model="gpt-4o-mini", prompt_column="q").rows == 1
    # The alias and the name it stands for are the same job: one idempotency key finds it again.
    first = jobs.create(input=api.put_input("rows.jsonl", ROWS), model="gpt-4o-mini", prompt_column="q",
                        idempotency_key="nightly")
    again = jobs.create(input=api.put_input("rows.jsonl", ROWS), model="tiny", prompt_column="q",
                        idempotency_key="nightly")
    assert again.job_id == first.job_id


def test_bulkinfer_submit_takes_an_alias(api: RunningApi, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(ROWS)
    code = main(["submit", str(rows), "--model", "gpt-4o-mini", "--prompt-column", "q", "--json",
                 "--api-url", api.url])
    assert code == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    assert api.client.jobs.spec(job_id).model == "tiny"


def test_a_schedule_made_under_an_alias_submits_jobs_of_the_served_model(api: RunningApi) -> None:
    folder = api.input_uri("daily/x").rsplit("/", 1)[0] + "/"
    schedule = api.client.schedules.create(cron="0 * * * *", input_prefix=folder,
                                           job={"model": "gpt-4o-mini", "prompt_column": "q"})
    assert schedule.job["model"] == "tiny"
    api.put_input("daily/a.jsonl", ROWS)
    [submitted] = api.client.schedules.tick(schedule).submitted
    assert api.client.jobs.spec(submitted.job_id).model == "tiny"


def test_an_unknown_model_is_refused_naming_the_models_the_aliases_and_how_to_add_one(
        api: RunningApi) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    error = refused(lambda: api.client.jobs.create(input=uri, model="claude-haiku-4-5", prompt_column="q"))
    assert error.status_code == 400
    assert error.message == f"model 'claude-haiku-4-5' is not served here {LISTED}; {HOW_TO_ADD}"
    job = {"model": "claude-haiku-4-5", "prompt_column": "q"}
    error = refused(lambda: api.client.schedules.create(cron="0 * * * *", input_prefix=uri.rsplit("/", 1)[0],
                                                        job=job))
    assert error.status_code == 400 and HOW_TO_ADD in error.message


def test_the_openai_sdk_is_told_which_models_and_aliases_there_are(api: RunningApi) -> None:
    sdk = openai.OpenAI(base_url=f"{api.url}/v1", api_key="any", max_retries=0)
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "Hi"}]}}
    file = sdk.files.create(file=("requests.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    [problem] = batch.errors.data
    assert problem.code == "model_not_found" and problem.line == 1
    assert problem.message == f"model 'claude-haiku-4-5' is not served here {LISTED}; {HOW_TO_ADD}"


def test_the_anthropic_sdk_is_told_which_models_and_aliases_there_are(api: RunningApi) -> None:
    sdk = anthropic.Anthropic(base_url=api.url, api_key="any", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refusal:
        sdk.messages.batches.create(requests=[{"custom_id": "q", "params": {
            "model": "claude-haiku-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}}])
    message = refusal.value.body["error"]["message"]
    assert message == f"model 'claude-haiku-4-5' is not served here {LISTED}; {HOW_TO_ADD}"
    assert "LoRA" not in message
