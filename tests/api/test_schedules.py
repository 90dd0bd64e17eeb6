"""Schedules over HTTP: the live API (uvicorn, real Redis, moto S3 or a local store), the SDK and the
CLI. No worker here: a tick's jobs stay queued with their plan_job message on the control queue.
The ticker and webhooks through a real worker are in test_schedules_live.py.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from bulkinfer.api.cli import main
from bulkinfer.api.client import ApiError, AsyncClient
from tests.api.conftest import RunningApi

JOB = {"model": "tiny", "prompt_column": "q", "sampling": {"max_tokens": 4}}


def prefix(api: RunningApi, folder: str) -> str:
    return api.input_uri(f"{folder}/x").rsplit("/", 1)[0] + "/"


def put(api: RunningApi, folder: str, name: str) -> None:
    api.put_input(f"{folder}/{name}", b'{"q": "hello"}\n')


def planned_job_ids(api: RunningApi) -> list[str]:
    """The job ids of the plan_job messages waiting on the control queue."""
    return [json.loads(base64.b64decode(message["body"]))[0][0] for message in api.control_queue_messages()
            if message["headers"]["task"] == "bulkinfer.plan_job"]


def test_a_schedule_ticked_repeatedly_makes_one_job_per_file_as_files_appear(api: RunningApi) -> None:
    schedules = api.client.schedules
    schedule = schedules.create(cron="0 * * * *", input_prefix=prefix(api, "daily"), job=JOB, name="daily")
    assert (schedule.name, schedule.paused, schedule.runtime.jobs_submitted) == ("daily", False, 0)

    assert schedules.tick(schedule).submitted == []
    put(api, "daily", "a.jsonl")
    first = schedules.tick(schedule)
    put(api, "daily", "b.jsonl")
    for _ in range(3):
        schedules.tick(schedule)

    assert [item.job_id for item in first.submitted] == [schedules.submitted(schedule)[0].job_id]
    submitted = schedules.submitted(schedule)
    assert [item.key.rsplit("/", 1)[1] for item in submitted] == ["a.jsonl", "b.jsonl"]
    jobs = list(api.client.jobs.list())
    assert sorted(job.job_id for job in jobs) == sorted(item.job_id for item in submitted)
    assert sorted(planned_job_ids(api)) == sorted(item.job_id for item in submitted)  # each planned once
    assert api.repository.get_spec(submitted[0].job_id).metadata == {"schedule_id": schedule.id}
    view = schedules.get(schedule)
    assert view.runtime.jobs_submitted == 2 and view.runtime.last_tick_at is not None


def test_a_paused_schedule_submits_nothing_until_resumed(api: RunningApi) -> None:
    schedules = api.client.schedules
    schedule = schedules.create(cron="* * * * *", input_prefix=prefix(api, "paused"), job=JOB)
    assert schedules.pause(schedule).paused
    put(api, "paused", "a.jsonl")
    with pytest.raises(ApiError) as caught:
        schedules.tick(schedule)
    assert caught.value.status_code == 409 and "paused" in caught.value.message
    assert list(api.client.jobs.list()) == []

    assert not schedules.resume(schedule).paused
    assert len(schedules.tick(schedule).submitted) == 1


def test_schedules_are_listed_read_and_deleted(api: RunningApi) -> None:
    schedules = api.client.schedules
    first = schedules.create(cron="0 * * * *", input_prefix=prefix(api, "one"), job=JOB)
    second = schedules.create(cron="0 0 * * *", input_prefix=prefix(api, "two"), job=JOB, paused=True)
    assert [s.id for s in schedules.list()] == [first.id, second.id]
    assert schedules.get(second).runtime.next_tick_at is None  # paused

    schedules.delete(first)
    assert [s.id for s in schedules.list()] == [second.id]
    with pytest.raises(ApiError) as caught:
        schedules.get(first)
    assert caught.value.status_code == 404 and first.id in caught.value.message


def test_every_route_answers_404_for_an_unknown_schedule(api: RunningApi) -> None:
    for method, path in (("GET", ""), ("POST", "/pause"), ("POST", "/resume"), ("DELETE", ""),
                         ("POST", "/tick"), ("GET", "/jobs")):
        response = httpx.request(method, f"{api.url}/schedules/sched-nope{path}")
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["detail"] == "no schedule 'sched-nope'"


def test_a_bad_cron_is_a_422_naming_it(api: RunningApi) -> None:
    body = {"cron": "61 * * * *", "input_prefix": prefix(api, "x"), "job": JOB}
    response = httpx.post(f"{api.url}/schedules", json=body)
    assert response.status_code == 422
    assert response.json()["messages"] == [
        "cron: '61 * * * *' is not a valid cron expression: [61 * * * *] is not acceptable, out of range"]


@pytest.mark.parametrize(("fields", "status", "message"), [
    ({"job": {**JOB, "model": "huge"}}, 400, "huge"),
    ({"job": {**JOB, "input_uri": "s3://b/x.jsonl"}}, 422, "job: input_uri: set per input object"),
    ({"webhook_url": "ftp://example.com"}, 422, "webhook_url: must be an http:// or https:// URL"),
    ({"surprise": 1}, 422, "surprise: Extra inputs are not permitted"),
])
def test_a_bad_schedule_is_refused_with_the_reason(api: RunningApi, fields, status, message) -> None:
    with pytest.raises(ApiError) as caught:
        api.client.schedules.create({"cron": "* * * * *", "input_prefix": prefix(api, "x"), "job": JOB,
                                     **fields})
    assert caught.value.status_code == status and message in caught.value.message


def test_a_prefix_over_the_job_store_itself_is_refused(api: RunningApi) -> None:
    """Its own outputs would be new inputs on every tick."""
    if api.settings.is_local_store:
        store_prefix = f"{api.settings.local_store_root()}/"
    else:
        store_prefix = api.settings.store_uri + "/"
    with pytest.raises(ApiError) as caught:
        api.client.schedules.create(cron="* * * * *", input_prefix=store_prefix, job=JOB)
    assert caught.value.status_code == 403 and "holds the job store's jobs/ folder" in caught.value.message


def test_the_cli_creates_ticks_lists_and_deletes_a_schedule(api: RunningApi, capsys) -> None:
    common = ["--api-url", api.url, "--json"]
    assert main(["schedule", "create", "--cron", "*/10 * * * *", "--input-prefix", prefix(api, "cli"),
                 "--model", "tiny", "--prompt-column", "q", "--max-tokens", "4", *common]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["cron"] == "*/10 * * * *" and created["job"]["sampling"] == {"max_tokens": 4}

    put(api, "cli", "a.jsonl")
    assert main(["schedule", "tick", created["id"], *common]) == 0
    assert len(json.loads(capsys.readouterr().out)["submitted"]) == 1
    assert main(["schedule", "list", "--api-url", api.url]) == 0
    assert created["id"] in capsys.readouterr().out
    assert main(["schedule", "delete", created["id"], *common]) == 0
    capsys.readouterr()
    assert main(["schedule", "get", created["id"], "--api-url", api.url]) == 2
    assert f"404: no schedule '{created['id']}'" in capsys.readouterr().err

    assert main(["schedule", "create", "--cron", "bad", "--input-prefix", prefix(api, "cli"),
                 "--model", "tiny", "--prompt-column", "q", "--api-url", api.url]) == 2
    assert "422: invalid schedule: cron: 'bad' is not a cron expression" in capsys.readouterr().err


def test_the_async_client_drives_a_schedule_the_same_way(api: RunningApi) -> None:
    async def scenario() -> None:
        async with AsyncClient(api.url) as client:
            body = {"cron": "0 * * * *", "input_prefix": prefix(api, "async"), "job": JOB}
            schedule = await client.schedules.create(body)
            put(api, "async", "a.jsonl")
            report = await client.schedules.tick(schedule)
            assert [item.key.rsplit("/", 1)[1] for item in report.submitted] == ["a.jsonl"]
            assert (await client.schedules.tick(schedule)).submitted == []
            assert [item.job_id for item in await client.schedules.submitted(schedule)] == \
                [report.submitted[0].job_id]
            assert (await client.schedules.pause(schedule)).paused
            assert not (await client.schedules.resume(schedule)).paused
            assert [s.id for s in await client.schedules.list()] == [schedule.id]
            assert (await client.schedules.get(schedule.id)).runtime.jobs_submitted == 1
            await client.schedules.delete(schedule)
            assert await client.schedules.list() == []

    asyncio.run(scenario())


def test_an_object_rewritten_with_new_content_is_new_input_and_gets_a_new_job(api: RunningApi) -> None:
    schedules = api.client.schedules
    schedule = schedules.create(cron="0 * * * *", input_prefix=prefix(api, "changing"), job=JOB)
    put(api, "changing", "a.jsonl")
    first = schedules.tick(schedule).submitted
    api.put_input("changing/a.jsonl", b'{"q": "hello"}\n{"q": "again"}\n')  # a new ETag
    second = schedules.tick(schedule).submitted
    assert [item.key for item in first] == [item.key for item in second]
    assert first[0].etag != second[0].etag and first[0].job_id != second[0].job_id
    assert len(list(api.client.jobs.list())) == 2
