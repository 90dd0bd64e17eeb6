"""POST /jobs with a JSON spec: what is accepted, what is refused at submit, and what is queued."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from bulkinfer.jobs.state.status import JobState
from tests.api.conftest import refused

ROWS = b"".join(json.dumps({"id": n, "q": f"question {n}"}).encode() + b"\n" for n in range(6))


def spec(uri: str, **changes) -> dict:
    return {"input_uri": uri, "model": "tiny", "prompt_column": "q", **changes}


def queued_job_ids(api) -> list[str]:
    """The job ids of plan_job messages on the control queue (the kombu envelope, decoded)."""
    ids = []
    for message in api.control_queue_messages():
        assert message["headers"]["task"] == "bulkinfer.plan_job"
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        ids.append(args[0])
    return ids


def test_a_valid_spec_creates_a_queued_job_and_sends_plan_job(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    job = api.client.jobs.create(spec(uri, metadata={"team": "search"}))
    assert job.state == JobState.QUEUED and job.rows.total == 0
    assert queued_job_ids(api) == [job.job_id]
    stored = api.client.jobs.spec(job.job_id)
    assert (stored.input_format, stored.output_format) == ("jsonl", "jsonl")  # resolved at submit
    assert stored.metadata == {"team": "search"}
    assert api.repository.store.exists(api.repository.layout(job.job_id).spec_key)


def test_an_invalid_spec_is_422_with_one_message_per_field(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    error = refused(lambda: api.client.jobs.create(spec(uri, prompt_column="q", template="{q}",
                                                        sampling={"temperature": 9}, colour="red")))
    assert error.status_code == 422
    assert any(m.startswith("sampling.temperature:") for m in error.messages)
    assert any(m.startswith("colour:") and "Extra inputs" in m for m in error.messages)
    assert "invalid job spec" in error.message
    response = httpx.post(f"{api.url}/jobs", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 422 and "not JSON" in response.json()["detail"]
    assert api.control_queue_messages() == []


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_an_enormous_or_deeply_nested_schema_is_422_naming_the_limit(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(40)}}
    error = refused(lambda: api.client.jobs.create(spec(uri, response_format=deep)))
    assert error.status_code == 422
    assert any("nests" in m and "at most 32" in m for m in error.messages), error.messages
    huge = {"type": "json_schema", "json_schema": {"name": "huge", "schema": {
        "type": "object", "properties": {f"field_{n}": {"type": "string", "description": "x" * 200}
                                         for n in range(400)}}}}
    error = refused(lambda: api.client.jobs.create(spec(uri, response_format=huge)))
    assert error.status_code == 422 and any("at most 65,536 are allowed" in m for m in error.messages)
    assert api.control_queue_messages() == []


def test_a_webhook_to_plain_http_or_to_this_network_is_refused_naming_the_rule(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    for url, rule in [("http://hooks.example.com/done", "must be an https:// URL"),
                      ("https://169.254.169.254/latest/meta-data/", "link-local address"),
                      ("https://localhost:8080/hook", "is this machine")]:
        error = refused(lambda url=url: api.client.jobs.create(spec(uri, webhook_url=url)))
        assert error.status_code == 400 and rule in error.message and "webhook_allow_" in error.message
    assert api.control_queue_messages() == []
    job = api.client.jobs.create(spec(uri, webhook_url="https://hooks.example.com/done?token=t"))
    assert job.state == JobState.QUEUED


def test_an_unknown_model_is_refused_naming_the_served_ones(api) -> None:
    error = refused(lambda: api.client.jobs.create(spec(api.put_input("rows.jsonl", ROWS), model="gpt-9")))
    assert error.status_code == 400
    assert error.message == ("model 'gpt-9' is not served here (served: small, tiny; aliases: none); to send "
                             "'gpt-9' to a served model, add an alias: BULKINFER_MODEL_ALIASES="
                             "'{\"gpt-9\": \"small\"}' (the model_aliases setting)")


def test_a_missing_input_is_refused_naming_its_uri(api) -> None:
    uri = api.input_uri("absent.jsonl")
    error = refused(lambda: api.client.jobs.create(spec(uri)))
    assert (error.status_code, error.message) == (400, f"input_uri {uri}: no such object")
    empty = api.put_input("empty.jsonl", b"")
    assert refused(lambda: api.client.jobs.create(spec(empty))).message.endswith("the file is empty")


def test_an_unreadable_s3_input_is_refused_with_the_reason(s3_api) -> None:
    error = refused(lambda: s3_api.client.jobs.create(spec("s3://no-such-bucket/rows.jsonl")))
    assert error.status_code == 400
    assert error.message.startswith("input_uri s3://no-such-bucket/rows.jsonl:")


def test_a_column_no_head_row_has_is_refused_naming_it(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    error = refused(lambda: api.client.jobs.create(spec(uri, prompt_column="question")))
    assert error.status_code == 400
    assert error.message == (f"column 'question' is in none of the first 5 rows of {uri} "
                             "(their columns: id, q)")
    templated = refused(lambda: api.client.jobs.create(spec(uri, prompt_column=None, template="{q} {lang}")))
    assert "column 'lang'" in templated.message


def test_a_column_only_some_rows_lack_is_left_to_the_rows(api) -> None:
    lines = b'{"q": "a"}\n{"other": 1}\nnot json at all\n{"q": "b"}\n'
    job = api.client.jobs.create(spec(api.put_input("mixed.jsonl", lines)))
    assert job.state == JobState.QUEUED


def test_a_parquet_input_is_checked_against_its_schema(api) -> None:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": [1, 2], "q": ["a", "b"]}), buffer)
    uri = api.put_input("rows.parquet", buffer.getvalue())
    error = refused(lambda: api.client.jobs.create(spec(uri, prompt_column="text")))
    assert (error.status_code, error.message) == (400, f"column 'text' is not in {uri} (its columns: id, q)")
    assert api.client.jobs.create(spec(uri, id_column="id")).state == JobState.QUEUED
    misspelled = refused(lambda: api.client.jobs.create(spec(uri, image_column="photo")))
    assert (misspelled.status_code, misspelled.message) == (
        400, f"column 'photo' is not in {uri} (its columns: id, q)")
    broken = api.put_input("broken.parquet", b"PAR1 this is not really parquet")
    assert "not a readable Parquet file" in refused(lambda: api.client.jobs.create(spec(broken))).message


def test_an_openai_batch_input_is_detected(api) -> None:
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}}
    uri = api.put_input("batch.jsonl", json.dumps(line).encode() + b"\n")
    job = api.client.jobs.create({"input_uri": uri, "model": "tiny"})
    assert api.client.jobs.spec(job.job_id).input_format == "openai_batch"


def test_same_idempotency_key_is_the_same_job_and_another_spec_is_409(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    first = api.client.jobs.create(spec(uri, idempotency_key="nightly-1"))
    again = api.client.jobs.create(spec(uri, idempotency_key="nightly-1"))
    assert again.job_id == first.job_id
    error = refused(lambda: api.client.jobs.create(spec(uri, idempotency_key="nightly-1", model="small")))
    assert error.status_code == 409 and "'nightly-1' was already used" in error.message
    api.repository.transition(first.job_id, JobState.RUNNING)
    assert api.client.jobs.create(spec(uri, idempotency_key="nightly-1")).state == JobState.RUNNING
    assert queued_job_ids(api) == [first.job_id, first.job_id]  # the running one is not planned again


def test_local_paths_must_be_inside_a_local_store(s3_api, local_api, tmp_path) -> None:
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_bytes(ROWS)
    error = refused(lambda: s3_api.client.jobs.create(spec(str(outside))))
    assert error.status_code == 400
    assert "is a local path, but this deployment keeps jobs in S3" in error.message
    assert s3_api.settings.store_uri not in error.message  # the job store's bucket and prefix are its own
    error = refused(lambda: local_api.client.jobs.create(spec(str(outside))))
    assert error.status_code == 400 and "is outside the store directory" in error.message
    assert str(local_api.settings.local_store_root()) not in error.message
    sneaky = str(local_api.settings.local_store_root() / ".." / "elsewhere.jsonl")
    assert "outside the store" in refused(lambda: local_api.client.jobs.create(spec(sneaky))).message
    inside = local_api.put_input("rows.jsonl", ROWS)
    assert local_api.client.jobs.create(spec(f"file://{inside}")).state == JobState.QUEUED


def test_other_content_types_are_415(api) -> None:
    response = httpx.post(f"{api.url}/jobs", content=b"model=tiny", headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "application/json" in response.json()["detail"]
