"""A schedule's job template is held to what a submit is held to, and refuses what makes no sense
for the real jobs a tick submits."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.scheduling.schedule_tick import tick_due
from bulkinfer.jobs.scheduling.schedules import Schedule, ScheduleRepository
from tests.api.conftest import RunningApi

JOB = {"model": "tiny", "prompt_column": "q"}


def schedule_body(api: RunningApi, **job) -> dict:  # noqa: ANN003
    api.put_input("tpl/x.jsonl", b'{"q": "hello"}\n')
    return {"cron": "0 0 1 1 *", "input_prefix": api.input_uri("tpl") + "/", "job": {**JOB, **job}}


@pytest.mark.parametrize(("job", "status", "message"), [
    ({"dry_run": True}, 422, "job: dry_run: a schedule submits real jobs"),
    ({"completion_window": "30d"}, 422, "completion_window: '30d' is longer than this deployment's "
                                        "max_completion_window (7d)"),
])
def test_a_template_field_no_tick_could_honour_is_refused(local_api: RunningApi, job, status,
                                                          message) -> None:
    with pytest.raises(ApiError) as refused:
        local_api.client.schedules.create(schedule_body(local_api, **job))
    assert refused.value.status_code == status and message in refused.value.message, refused.value.message
    assert local_api.client.schedules.list() == []


def test_a_template_within_the_limits_is_accepted(local_api: RunningApi) -> None:
    body = schedule_body(local_api, dry_run=False, completion_window="2d")
    schedule = local_api.client.schedules.create(body)
    [submitted] = local_api.client.schedules.tick(schedule.id).submitted
    assert local_api.client.jobs.get(submitted.job_id).state == "queued"


def test_a_stored_dry_run_template_submits_nothing_and_says_why(local_api: RunningApi) -> None:
    """A schedule stored before templates refused dry_run: its tick creates no job (each would run
    for real) and the schedule's last_error says why."""
    schedules = ScheduleRepository.beside(local_api.repository)
    body = schedule_body(local_api)
    created = local_api.client.schedules.create(body)
    old_template = {**JOB, "dry_run": True}
    stored = Schedule.model_validate({**schedules.get(created.id).model_dump(), "job": old_template})
    schedules.store.put_bytes(schedules._key(created.id), stored.model_dump_json().encode())
    report = local_api.client.schedules.tick(created.id)
    assert report.submitted == [] and "dry_run" in report.error
    assert list(local_api.client.jobs.list()) == []
    assert "dry_run" in local_api.client.schedules.get(created.id).runtime.last_error


def test_a_cron_that_never_fires_is_a_422_and_a_stored_one_stops_no_other_schedule(
        local_api: RunningApi) -> None:
    api = local_api
    with pytest.raises(ApiError) as refused:
        api.client.schedules.create({**schedule_body(api), "cron": "0 0 31 2 *"})
    assert refused.value.status_code == 422 and "'0 0 31 2 *' never fires" in refused.value.message
    # One stored before that check (any tenant's): listed with no next tick, and every other
    # schedule still ticks when due.
    schedules = ScheduleRepository.beside(api.repository)
    never = api.client.schedules.create(schedule_body(api))
    stored = Schedule.model_validate({**schedules.get(never.id).model_dump(), "cron": "0 0 31 2 *"})
    schedules.store.put_bytes(schedules._key(never.id), stored.model_dump_json().encode())
    api.put_input("other/y.jsonl", b'{"q": "hi"}\n')
    other = api.client.schedules.create({**schedule_body(api), "cron": "* * * * *",
                                         "input_prefix": api.input_uri("other") + "/"})
    listed = {view.id: view for view in api.client.schedules.list()}
    assert listed[never.id].runtime.next_tick_at is None and listed[other.id].runtime.next_tick_at
    later = datetime.now(UTC) + timedelta(minutes=2)
    results = tick_due(schedules, api.repository, lambda _job_id: None, now=later)
    assert [result.schedule_id for result in results] == [other.id]
    assert len(results[0].submitted) == 1


def test_a_stored_schedule_that_no_longer_reads_is_left_out_not_every_tenants(
        local_api: RunningApi) -> None:
    """A rule tightened after a schedule was stored (here: its template sets input_uri, refused
    since) hides that schedule only: the listing and every other schedule's ticks go on."""
    api = local_api
    schedules = ScheduleRepository.beside(api.repository)
    broken = api.client.schedules.create(schedule_body(api))
    data = json.loads(schedules.store.get_bytes(schedules._key(broken.id)))
    data["job"]["input_uri"] = "s3://bucket/x.jsonl"
    schedules.store.put_bytes(schedules._key(broken.id), json.dumps(data).encode())
    fine = api.client.schedules.create({**schedule_body(api), "cron": "* * * * *"})
    assert [view.id for view in api.client.schedules.list()] == [fine.id]
    results = tick_due(schedules, api.repository, lambda _job_id: None,
                       now=datetime.now(UTC) + timedelta(minutes=2))
    assert [result.schedule_id for result in results] == [fine.id] and len(results[0].submitted) == 1
    # Its owner is told why (409, not a 500) and may delete it.
    answer = httpx.get(f"{api.url}/schedules/{broken.id}")
    assert answer.status_code == 409 and "no longer reads (job: input_uri" in answer.json()["detail"]
    assert httpx.delete(f"{api.url}/schedules/{broken.id}").status_code == 204
    assert httpx.get(f"{api.url}/schedules/{broken.id}").status_code == 404
