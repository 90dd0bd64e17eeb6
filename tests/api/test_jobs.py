"""Reading jobs back: status, listing, cancel, results, health and the OpenAPI document."""

from __future__ import annotations

import io
import json

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.api.client import Client
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.status import JobState
from tests.api import helpers
from tests.api.conftest import refused
from tests.fixtures.services import free_port

ROWS = 10


def jsonl_rows(count: int = ROWS) -> bytes:
    return b"".join(json.dumps({"id": f"r{n}", "q": f"question {n}"}).encode() + b"\n" for n in range(count))


def submit(api, **changes):
    uri = api.put_input("rows.jsonl", jsonl_rows())
    return api.client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q", "id_column": "id",
                                   "shard_size": 4,
                                   **changes})


def test_status_shows_counts_moving_as_shards_finish(api) -> None:
    job = submit(api)
    helpers.start(api.repository, job.job_id)
    running = api.client.jobs.get(job.job_id)
    assert running.state == JobState.RUNNING and running.started_at is not None
    assert (running.rows.total, running.rows.pending, running.shards.total) == (ROWS, ROWS, 3)
    helpers.run_shards(api.repository, job.job_id, count=1)
    partway = api.client.jobs.get(job.job_id)
    assert (partway.rows.succeeded, partway.rows.pending, partway.shards.done) == (4, 6, 1)
    assert partway.usage.prompt > 0


def test_unknown_jobs_are_404(api) -> None:
    for call in (lambda: api.client.jobs.get("job-nope"), lambda: api.client.jobs.cancel("job-nope"),
                 lambda: api.client.jobs.result_parts("job-nope"), lambda: api.client.jobs.get("bad..id")):
        error = refused(call)
        assert error.status_code == 404 and "no job" in error.message


def test_list_pages_with_a_cursor_and_filters_by_status(api) -> None:
    ids = [submit(api, metadata={"n": str(n)}).job_id for n in range(5)]
    first = api.client.jobs.page(limit=2)
    second = api.client.jobs.page(limit=2, cursor=first.next_cursor)
    third = api.client.jobs.page(limit=2, cursor=second.next_cursor)
    assert [job.job_id for job in first.jobs + second.jobs + third.jobs] == ids[::-1]
    assert third.next_cursor is None
    assert [job.job_id for job in api.client.jobs.list(page_size=2)] == ids[::-1]

    helpers.start(api.repository, ids[1])
    assert [job.job_id for job in api.client.jobs.list(status="running")] == [ids[1]]
    assert len(list(api.client.jobs.list(status=JobState.QUEUED))) == 4
    error = refused(lambda: api.client.jobs.page(status="sleeping"))
    assert error.status_code == 422 and error.messages[0].startswith("status:")
    response = httpx.get(f"{api.url}/jobs", params={"cursor": "not-a-cursor"})
    assert response.status_code == 422 and response.json()["messages"][0].startswith("cursor:")


def test_cancel_a_job_once_or_twice_but_not_a_finished_one(api) -> None:
    job = submit(api)
    cancelled = api.client.jobs.cancel(job.job_id)
    assert cancelled.state == JobState.CANCELLED and cancelled.finished_at is not None
    assert api.repository.is_cancel_requested(job.job_id)
    assert api.client.jobs.cancel(job.job_id).state == JobState.CANCELLED

    finished = submit(api, metadata={"n": "2"})
    helpers.finish(api.repository, finished.job_id)
    error = refused(lambda: api.client.jobs.cancel(finished.job_id))
    assert (error.status_code, error.message) == (409, f"job {finished.job_id} already succeeded; there is "
                                                       "nothing to cancel")


def test_results_list_parts_with_urls_and_download_every_row_in_order(api) -> None:
    job = submit(api)
    error = refused(lambda: api.client.jobs.result_parts(job.job_id))
    assert error.status_code == 409 and "is queued: results are ready once it has succeeded" in error.message

    helpers.finish(api.repository, job.job_id)
    done = api.client.jobs.get(job.job_id)
    parts = api.client.jobs.result_parts(job.job_id)
    assert [part.uri for part in parts.parts] == done.output_uris and len(parts.parts) == 3
    assert [part.first_row for part in parts.parts] == [0, 4, 8]
    assert parts.rows.total == ROWS and parts.usage.prompt == done.usage.prompt
    fetched = b"".join(httpx.get(part.url).content if part.url.startswith("http")
                       else open(part.url.removeprefix("file://"), "rb").read() for part in parts.parts)
    rows = list(api.client.jobs.results(job.job_id))
    assert [row["id"] for row in rows] == [f"r{n}" for n in range(ROWS)]
    assert rows[3]["text"] == "3 noitseuq"  # the echo engine's reversed prompt
    assert fetched.decode().splitlines() == [json.dumps(row, separators=(",", ":")) for row in rows]


def test_parquet_results_download_as_json_lines(api) -> None:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"q": [f"question {n}" for n in range(7)]}), buffer)
    uri = api.put_input("rows.parquet", buffer.getvalue())
    job = api.client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q", "shard_size": 3})
    helpers.finish(api.repository, job.job_id)
    assert api.client.jobs.result_parts(job.job_id).output_format == "parquet"
    rows = list(api.client.jobs.results(job.job_id))
    assert [row["id"] for row in rows] == [str(n) for n in range(7)]
    assert rows[6]["text"] == "6 noitseuq"


def test_health_and_models(api) -> None:
    assert api.client.health() == {"status": "ok", "checks": {"redis": "ok", "store": "ok"}}
    assert api.client.models() == ["small", "tiny"]


def test_health_is_503_naming_what_is_down(tmp_path) -> None:
    from tests.api.conftest import serve

    settings = Settings(broker_url=f"redis://127.0.0.1:{free_port()}/0", store_uri=str(tmp_path / "store"))
    with serve(settings) as api:
        error = refused(api.client.health)
        assert error.status_code == 503 and error.message.startswith("redis: failing: ConnectionError")
        body = httpx.get(f"{api.url}/healthz").json()
        assert body["checks"]["store"] == "ok"
        assert body["checks"]["redis"].startswith("failing: ConnectionError")


def test_the_openapi_document_describes_every_route_and_both_submit_bodies(local_api) -> None:
    document = httpx.get(f"{local_api.url}/openapi.json").json()
    routes = {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/spec", "/jobs/{job_id}/cancel",
              "/jobs/{job_id}/results", "/jobs/{job_id}/progress", "/jobs/{job_id}/retry",
              "/jobs/{job_id}/results/merged", "/usage", "/healthz", "/models", "/metrics",
              "/workers", "/schedules", "/schedules/{schedule_id}",
              *(f"/schedules/{{schedule_id}}/{action}" for action in ("pause", "resume", "tick", "jobs")),
              "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
              "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", "/v1/models", "/v1/messages/batches",
              *(f"/v1/messages/batches/{{message_batch_id}}{tail}" for tail in ("", "/cancel", "/results"))}
    assert set(document["paths"]) == routes
    body = document["paths"]["/jobs"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/JobSpec"}
    assert set(body["multipart/form-data"]["schema"]["properties"]) == {"spec", "file"}
    assert "input_uri" in document["components"]["schemas"]["JobSpec"]["properties"]
    upload = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert set(upload["schema"]["properties"]) == {"purpose", "file", "expires_after[anchor]",
                                                   "expires_after[seconds]"}


def test_the_client_reports_an_unreachable_server() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", timeout=2) as client, pytest.raises(httpx.ConnectError):
        client.jobs.get("job-1")
