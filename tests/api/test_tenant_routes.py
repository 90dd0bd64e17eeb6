"""Every route, walked with another tenant's key: a route that names a job or a schedule answers 404
for another tenant's (and changes nothing), and every other route is in a list that says why it is
safe. A route added later without an owner check, or without a decision in that list, fails here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest

from bulkinfer.api.app import create_app
from bulkinfer.api.body_limit import MAX_BODY_BYTES
from bulkinfer.api.client import Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, serve
from tests.fixtures.services import free_port

ROWS = b'{"q": "def f(x):"}\n{"q": "class A:"}\n'
KEYS = "acme=acme-secret,globex=globex-secret"
OWNER = {"Authorization": "Bearer acme-secret"}
OTHER = {"Authorization": "Bearer globex-secret"}

# Routes that name no job or schedule, and why another tenant learns nothing of acme through them.
UNOWNED_ROUTES = {
    ("GET", "/healthz"): "open: says whether Redis and the store answer, nothing of any job",
    ("GET", "/ui"): "open: a static page; its data comes through keyed calls",
    ("GET", "/models"): "the deployment's model names, the same for every tenant",
    ("GET", "/workers"): "live workers (what a tenant may see of them: issue 40 item 10)",
    ("GET", "/metrics"): "admin keys only (403 for a tenant's)",
    ("GET", "/usage"): "the caller's tenant only",
    ("GET", "/jobs"): "lists the caller's tenant's jobs",
    ("POST", "/jobs"): "creates a job of the caller's tenant",
    ("GET", "/schedules"): "lists the caller's tenant's schedules",
    ("POST", "/schedules"): "creates a schedule of the caller's tenant",
    ("GET", "/v1/files"): "lists the caller's tenant's files",
    ("POST", "/v1/files"): "uploads a file of the caller's tenant",
    ("GET", "/v1/batches"): "lists the caller's tenant's batches",
    ("POST", "/v1/batches"): "creates a batch of the caller's tenant (from one of its own files)",
    ("GET", "/v1/messages/batches"): "lists the caller's tenant's message batches",
    ("POST", "/v1/messages/batches"): "creates a message batch of the caller's tenant",
    ("GET", "/v1/models"): "the deployment's model names and aliases, the same for every tenant",
    ("GET", "/openapi.json"): "the schema, the same for every tenant",
    ("GET", "/docs"): "the schema's page",
}
OBJECT_PARAMETERS = {"job_id", "schedule_id", "file_id", "batch_id", "message_batch_id"}


def _flat(routes: list, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(path, route) for every route, into included routers (FastAPI keeps those nested)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _flat(included.routes, prefix + route.include_context.prefix)
        else:
            yield prefix + route.path, route


def _routes(settings: Settings) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves (HEAD, which Starlette adds to GET, aside)."""
    routes = []
    for path, route in _flat(create_app(settings).routes):
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, path))
    assert routes, "no routes found: the walk no longer understands how the app keeps them"
    return routes


@pytest.fixture(scope="module")
def keyed_api(redis_server, tmp_path_factory):
    redis_server.client().flushall()
    store = tmp_path_factory.mktemp("tenant-routes") / "store"
    settings = Settings(broker_url=redis_server.url, store_uri=str(store), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys="root-secret")
    with serve(settings) as running:
        yield running


@pytest.fixture(scope="module")
def acme_objects(keyed_api):
    """A job, a schedule and a file of acme's."""
    api = keyed_api
    with Client(api.url, api_key="acme-secret") as acme:
        own = api.settings.local_store_root() / "tenants" / "acme"  # its own folder, whatever the rules
        (own / "sched").mkdir(parents=True)
        (own / "rows.jsonl").write_bytes(ROWS)
        (own / "sched" / "x.jsonl").write_bytes(ROWS)
        job = acme.jobs.create({"input_uri": str(own / "rows.jsonl"), "model": "tiny", "prompt_column": "q",
                                "metadata": {"secret": "acme-only"}})
        schedule = acme.schedules.create({"cron": "0 0 1 1 *", "input_prefix": f"{own / 'sched'}/",
                                          "job": {"model": "tiny", "prompt_column": "q"}})
    uploaded = httpx.post(f"{api.url}/v1/files", headers=OWNER,
                          files={"purpose": (None, b"batch"), "file": ("rows.jsonl", ROWS)})
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}}
    requests = httpx.post(f"{api.url}/v1/files", headers=OWNER, files={
        "purpose": (None, b"batch"), "file": ("requests.jsonl", json.dumps(line).encode())})
    batch = httpx.post(f"{api.url}/v1/batches", headers=OWNER, json={
        "input_file_id": requests.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert batch.status_code == 200 and batch.json()["status"] == "validating", batch.text
    anthropic_key = {"x-api-key": "acme-secret"}
    message_batch = httpx.post(f"{api.url}/v1/messages/batches", headers=anthropic_key, json={
        "requests": [{"custom_id": "a", "params": {"model": "tiny", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "Hi"}]}}]})
    assert message_batch.status_code == 200, message_batch.text
    return {"job_id": job.job_id, "schedule_id": schedule.id, "file_id": file_id,
            "batch_id": batch.json()["id"], "message_batch_id": message_batch.json()["id"]}


def test_every_route_is_either_owner_checked_or_listed_as_safe(keyed_api) -> None:
    for method, path in _routes(keyed_api.settings):
        parameters = set(re.findall(r"{(\w+)}", path))
        if parameters:
            assert parameters <= OBJECT_PARAMETERS, (
                f"{method} {path}: a new path parameter {parameters - OBJECT_PARAMETERS}; add it to this "
                "test with an object of another tenant's")
        else:
            assert (method, path) in UNOWNED_ROUTES, (
                f"{method} {path} names no job or schedule: say in UNOWNED_ROUTES why another tenant "
                "learns nothing through it (or make it check the caller's tenant)")


def test_another_tenants_key_gets_404_on_every_route_naming_a_job_or_schedule(keyed_api,
                                                                              acme_objects) -> None:
    api = keyed_api
    walked = []
    for method, path in _routes(api.settings):
        if not re.search(r"{(job_id|schedule_id|file_id|batch_id|message_batch_id)}", path):
            continue
        url = api.url + path.format(**acme_objects)
        for query in ("", "?download=true", "?partial=true&download=true"):
            answer = httpx.request(method, url + query, headers=OTHER,
                                   json={} if method in ("POST", "PUT", "PATCH") else None)
            assert answer.status_code == 404, (method, path, query, answer.status_code, answer.text)
            assert "acme" not in answer.text, (method, path, answer.text)  # nothing of acme's in the body
        walked.append((method, path))
    assert ("POST", "/jobs/{job_id}/cancel") in walked and ("DELETE", "/schedules/{schedule_id}") in walked
    assert ("DELETE", "/v1/files/{file_id}") in walked and ("GET", "/v1/files/{file_id}/content") in walked
    assert ("POST", "/v1/batches/{batch_id}/cancel") in walked
    assert ("DELETE", "/v1/messages/batches/{message_batch_id}") in walked
    batch = httpx.get(f"{api.url}/v1/batches/{acme_objects['batch_id']}", headers=OWNER).json()
    assert batch["status"] == "validating"  # not cancelled by the other tenant
    message_batch = httpx.get(f"{api.url}/v1/messages/batches/{acme_objects['message_batch_id']}",
                              headers=OWNER).json()
    assert message_batch["processing_status"] == "in_progress"
    # Nothing was changed by those calls: the job still queued, the schedule there and not paused.
    job = httpx.get(f"{api.url}/jobs/{acme_objects['job_id']}", headers=OWNER).json()
    assert job["state"] == "queued"
    schedule = httpx.get(f"{api.url}/schedules/{acme_objects['schedule_id']}", headers=OWNER).json()
    assert schedule["paused"] is False and schedule["runtime"]["jobs_submitted"] == 0
    listed = httpx.get(f"{api.url}/jobs", headers=OWNER).json()["jobs"]
    batch_jobs = {f"job-{acme_objects['batch_id'].removeprefix('batch_')}",
                  f"job-{acme_objects['message_batch_id'].removeprefix('msgbatch_')}"}
    # No retry job was made: acme's job and the jobs under its two batches.
    assert {entry["job_id"] for entry in listed} == {acme_objects["job_id"], *batch_jobs}
    content = httpx.get(f"{api.url}/v1/files/{acme_objects['file_id']}/content", headers=OWNER)
    assert content.status_code == 200 and content.content == ROWS  # the file not deleted


def test_routes_that_name_nothing_show_another_tenant_nothing_of_acme(keyed_api, acme_objects) -> None:
    api = keyed_api
    assert httpx.get(f"{api.url}/jobs", headers=OTHER).json()["jobs"] == []
    for status in ("queued", "running", "succeeded"):
        assert httpx.get(f"{api.url}/jobs?status={status}", headers=OTHER).json()["jobs"] == []
    assert httpx.get(f"{api.url}/schedules", headers=OTHER).json()["schedules"] == []
    assert httpx.get(f"{api.url}/v1/files", headers=OTHER).json()["data"] == []
    assert httpx.get(f"{api.url}/metrics", headers=OTHER).status_code == 403
    usage = httpx.get(f"{api.url}/usage?tenant=acme", headers=OTHER)
    assert usage.status_code == 403
    # A cursor made of acme's own job id pages globex's jobs only, and says nothing of acme's.
    cursor = f"99999999999999999:{acme_objects['job_id']}"
    page = httpx.get(f"{api.url}/jobs", params={"cursor": cursor}, headers=OTHER).json()
    assert page["jobs"] == [] and page["next_cursor"] is None
    digest = hashlib.sha256(b"acme-secret").hexdigest()
    for path in ("/healthz", "/models", "/ui"):
        text = httpx.get(api.url + path, headers=OTHER).text
        assert acme_objects["job_id"] not in text and digest not in text and "acme-secret" not in text


def test_the_walk_covers_every_route_of_the_schema(keyed_api) -> None:
    schema = httpx.get(f"{keyed_api.url}/openapi.json", headers=OWNER).json()
    published = {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    walked = set(_routes(keyed_api.settings))
    assert published <= walked, published - walked
    assert len([route for route in walked if "{" in route[1]]) >= 13  # jobs' and schedules' sub-routes


def test_the_open_health_check_names_no_host_port_or_path_when_keys_are_set(tmp_path) -> None:
    port = free_port()  # nothing listens there: Redis is down
    settings = Settings(broker_url=f"redis://127.0.0.1:{port}/0", store_uri=str(tmp_path / "store"),
                        models=json.dumps(MODELS), api_keys=KEYS)
    with serve(settings) as api:
        answer = httpx.get(f"{api.url}/healthz")
    assert answer.status_code == 503 and answer.json()["checks"]["redis"] == "failing: ConnectionError"
    assert str(port) not in answer.text and str(tmp_path) not in answer.text


@pytest.mark.parametrize("path", ["/schedules", "/jobs/{job_id}/retry", "/jobs"])
def test_a_body_past_the_limit_is_413_before_any_route_reads_it(keyed_api, acme_objects, path) -> None:
    """One tenant's multi-gigabyte body must not take the API (every tenant's) out of memory: refused
    by its declared length, or, sent without one, once the limit is passed."""
    url = keyed_api.url + path.format(**acme_objects)
    padding = {"padding": "x" * MAX_BODY_BYTES}
    declared = httpx.post(url, json=padding, headers=OWNER)
    assert declared.status_code == 413
    assert f"larger than {MAX_BODY_BYTES:,} bytes" in declared.json()["detail"]
    chunks = (b'{"padding": "' + b"x" * 65536 * n for n in range(1, 40))  # ~50 MiB, no Content-Length
    chunked = httpx.post(url, content=chunks, headers={**OWNER, "content-type": "application/json"})
    assert chunked.status_code == 413, chunked.text
