"""Retry chains against a hostile tenant and a job that failed while shards still ran, over real HTTP
with tenant keys, no worker: jobs are moved through the pipeline with tests/api/helpers.py.

- No spec a user sends (a submit, a dry run, an upload, a schedule's job template) may set the fields
  only the server sets (`parent_job_id`, `retry_error_codes`), and a chain reaching another tenant's
  job is not found on `/results/merged`.
- A chain whose parts do not line up is a 409 before the answer starts, never an error mid-body; a
  shard of the failed parent that committed after the retry was cut still merges.
- A retry's idempotency key never lands on a submit's job."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.scheduling.schedules import Schedule, ScheduleRepository
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import SERVER_SET_FIELDS, JobSpec
from bulkinfer.jobs.state.repository import StoredPlan
from bulkinfer.jobs.state.status import JobState
from tests.api.conftest import MODELS, RunningApi, serve
from tests.api.helpers import finish, run_shards, start
from tests.jobs.helpers import run_shard

ACME, GLOBEX, ADMIN = "acme-secret", "globex-secret", "root-secret"
KEYS = f"acme={ACME},globex=sha256:{hashlib.sha256(GLOBEX.encode()).hexdigest()}"
SERVER_SET_VALUES = {"parent_job_id": "job-0123456789abcdef0123456789abcdef", "retry_error_codes": ["x"]}
# Four rows in two shards of two; the first is not JSON (a row error), written so that fixing it
# keeps its length (a JSONL row is its line's byte offset).
BROKEN = '{"q": "alpha"\n{"q": "bravo"}\n{"q": "delta"}\n{"q": "gamma"}\n'
FIXED = '{"q":"alpha"}\n{"q": "bravo"}\n{"q": "delta"}\n{"q": "gamma"}\n'
assert len(BROKEN) == len(FIXED)


@pytest.fixture
def api(redis_url: str, tmp_path) -> Iterator[RunningApi]:  # noqa: ANN001
    inputs = f"{tmp_path / 'store' / 'inputs'}/"  # where api.put_input writes: both tenants may read it
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys=ADMIN,
                        tenant_prefixes=json.dumps({"acme": [inputs], "globex": [inputs]}))
    with serve(settings) as running:
        yield running


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _spec(api: RunningApi, name: str, text: str = BROKEN, **fields: object) -> dict:
    return {"input_uri": api.put_input(name, text.encode()), "model": "tiny", "prompt_column": "q",
            "shard_size": 2, **fields}


def _merged(api: RunningApi, job_id: str, key: str = ACME) -> httpx.Response:
    return httpx.get(f"{api.url}/jobs/{job_id}/results/merged", headers=_headers(key), timeout=30)


def _failed_after_one_shard(api: RunningApi, job_id: str) -> None:
    """The job ran shard 0, then failed (as when shard 0's neighbour failed three times)."""
    start(api.repository, job_id)
    run_shards(api.repository, job_id, count=1)
    api.repository.transition(job_id, JobState.FAILED, error="shard 1 failed 3 time(s)")


def _commit_late(api: RunningApi, job_id: str, shard_index: int) -> None:
    spec = api.repository.get_spec(job_id)
    store, key = store_for_uri(spec.input_uri)
    shard = api.repository.load_plan(job_id)[shard_index]
    result = run_shard(store, key, api.store, api.repository.layout(job_id), spec, shard)
    api.repository.counters(job_id).apply_shard(result)


@pytest.mark.parametrize("field", sorted(SERVER_SET_FIELDS))
def test_no_spec_a_user_sends_may_set_a_field_only_the_server_sets(api: RunningApi, field: str) -> None:
    value = SERVER_SET_VALUES[field]
    headers = _headers(ACME)
    entries = {
        "submit": httpx.post(f"{api.url}/jobs", headers=headers,
                             json=_spec(api, "s.jsonl", **{field: value})),
        "dry run": httpx.post(f"{api.url}/jobs", headers=headers,
                              json=_spec(api, "d.jsonl", dry_run=True, **{field: value})),
        "upload": httpx.post(f"{api.url}/jobs", headers=headers, files=[
            ("spec", (None, json.dumps({"model": "tiny", "prompt_column": "q", field: value}))),
            ("file", ("rows.jsonl", FIXED.encode()))]),
        "schedule": httpx.post(f"{api.url}/schedules", headers=headers, json={
            "cron": "0 * * * *", "input_prefix": api.input_uri("sched/"),
            "job": {"model": "tiny", "prompt_column": "q", field: value}}),
    }
    for entry, answer in entries.items():
        assert answer.status_code == 422, (entry, answer.text)
        assert field in answer.json()["detail"], (entry, answer.text)
    assert api.repository.list(limit=10)[0] == [] and ScheduleRepository.beside(api.repository).list() == []
    # null is as good as leaving it out
    allowed = httpx.post(f"{api.url}/jobs", headers=headers, json=_spec(api, "n.jsonl", **{field: None}))
    assert allowed.status_code == 201, allowed.text


def test_a_schedule_cannot_make_jobs_that_read_another_tenants_job(api: RunningApi) -> None:
    with Client(api.url, api_key=GLOBEX) as globex, Client(api.url, api_key=ACME) as acme:
        theirs = globex.jobs.create(_spec(api, "g.jsonl"))
        finish(api.repository, theirs.job_id)
        api.put_input("sched/x.jsonl", FIXED.encode())
        template = {"model": "tiny", "prompt_column": "q", "parent_job_id": theirs.job_id}
        with pytest.raises(ApiError) as refused:
            acme.schedules.create(cron="0 * * * *", input_prefix=api.input_uri("sched/"), job=template)
        assert refused.value.status_code == 422 and "job: parent_job_id" in refused.value.message
        # One stored before templates were checked: its tick submits nothing and says why.
        stored = Schedule(cron="0 * * * *", input_prefix=api.input_uri("sched/"), job=template, tenant="acme",
                          id="sched-" + "a" * 32, created_at=datetime.now(UTC))
        api.store.put_bytes(f"schedules/{stored.id}.json", stored.model_dump_json().encode())
        report = acme.schedules.tick(stored.id)
        assert report.submitted == [] and "parent_job_id" in (report.error or "")
        assert list(acme.jobs.list()) == []


def test_merged_results_of_a_chain_through_another_tenants_job_are_not_found(api: RunningApi) -> None:
    with Client(api.url, api_key=GLOBEX) as globex:
        theirs = globex.jobs.create(_spec(api, "g.jsonl"))
    finish(api.repository, theirs.job_id)
    # A job of acme's whose parent is globex's (as a template that set parent_job_id made them).
    spec = JobSpec.model_validate({**_spec(api, "a.jsonl"), "tenant": "acme", "parent_job_id": theirs.job_id})
    mine = api.repository.create(spec).job_id
    answer = _merged(api, mine)
    assert answer.status_code == 404 and mine in answer.json()["detail"]
    assert theirs.job_id not in answer.text and "bravo"[::-1] not in answer.text
    admin = _merged(api, mine, ADMIN)  # an admin key sees every tenant's jobs
    assert admin.status_code == 200 and len(admin.text.splitlines()) == 4


def test_a_parent_shard_that_committed_after_the_retry_was_cut_still_merges(api: RunningApi) -> None:
    with Client(api.url, api_key=ACME) as acme:
        parent = acme.jobs.create(_spec(api, "p.jsonl")).job_id
        _failed_after_one_shard(api, parent)
        api.put_input("p.jsonl", FIXED.encode())
        retry = acme.jobs.retry(parent).job_id  # row 0 and the whole of shard 1 (it never ran)
    _commit_late(api, parent, shard_index=1)  # the parent's shard 1 was still running: it commits now
    start(api.repository, retry)
    run_shards(api.repository, retry)

    answer = _merged(api, retry)
    assert answer.status_code == 200, answer.text
    rows = [json.loads(line) for line in answer.text.splitlines()]
    assert [row["error"] for row in rows] == [None] * 4
    assert [row["text"] for row in rows] == [word[::-1] for word in ("alpha", "bravo", "delta", "gamma")]


def test_a_chain_whose_parts_do_not_line_up_is_a_409_before_any_row(api: RunningApi) -> None:
    with Client(api.url, api_key=ACME) as acme:
        parent = acme.jobs.create(_spec(api, "c.jsonl")).job_id
        finish(api.repository, parent)
        retry = acme.jobs.retry(parent).job_id
    start(api.repository, retry)
    run_shards(api.repository, retry)
    # The retry's plan now says it ran two rows where its part has one (as if the input had changed).
    layout = api.repository.layout(retry)
    plan = api.repository.load_plan(retry)
    plan[0] = plan[0].model_copy(update={"only_rows": [*plan[0].only_rows, 999]})
    api.store.put_bytes(layout.plan_key, StoredPlan(shards=plan).model_dump_json().encode())

    answer = _merged(api, retry)
    assert answer.status_code == 409, answer.text
    assert f"job {retry} shard 0 ran 1 rows of the 2 it retried" in answer.json()["detail"]


def test_a_retry_reusing_a_submits_idempotency_key_is_a_job_of_its_own(api: RunningApi) -> None:
    with Client(api.url, api_key=ACME) as acme:
        first = acme.jobs.create(_spec(api, "first.jsonl", text=FIXED, idempotency_key="nightly")).job_id
        parent = acme.jobs.create(_spec(api, "parent.jsonl")).job_id
        finish(api.repository, parent)
        retry = acme.jobs.retry(parent, idempotency_key="nightly")
        again = acme.jobs.retry(parent, idempotency_key="nightly")
        assert retry.job_id != first and retry.parent_job_id == parent
        assert again.job_id == retry.job_id  # the same retry, found again by its key
        assert acme.jobs.get(first).parent_job_id is None
    with pytest.raises(ObjectNotFound):  # the submit's job was not given the retry's plan
        api.repository.load_plan(first)
    finish(api.repository, first)
    status = api.repository.get(first)
    assert (status.state, status.rows.total, status.rows.succeeded) == (JobState.SUCCEEDED, 4, 4)
    answer = httpx.get(f"{api.url}/jobs/{first}/results?download=true", headers=_headers(ACME))
    assert [json.loads(line)["text"] for line in answer.text.splitlines()] == \
        [word[::-1] for word in ("alpha", "bravo", "delta", "gamma")]
