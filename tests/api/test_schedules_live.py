"""Schedules and webhooks through the whole stack: the API over HTTP, a real worker process (tiny
model) whose ticker fires a schedule every second, moto S3, and a local webhook receiver.

One worker serves the module. Redis is flushed once, at the start (a flush between tests would
delete the worker's queue bindings), so tests here never use `redis_url` or `s3`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from bulkinfer.api.client import Client
from bulkinfer.jobs import webhooks
from bulkinfer.jobs.scheduling.schedules import ScheduleView
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process.celery_app import create_app as create_celery_app
from tests.api.live_stack import live_stack
from tests.fixtures.services import RedisServer, S3Server, wait_until
from tests.support.webhook_receiver import webhook_receiver

pytestmark = pytest.mark.timeout(300)

JOBS_BUCKET = "sched-jobs"
INPUTS_BUCKET = "sched-inputs"
ENGINE_OPTIONS = {"max_model_len": 128, "num_kv_blocks": 64, "max_num_seqs": 4}
JOB = {"model": "tiny", "prompt_column": "q", "sampling": {"temperature": 0.0, "max_tokens": 4}}
SECRET = "live-test-secret"
WAIT_S = 120


@dataclass
class Deployment:
    client: Client
    repository: JobRepository
    redis: redis.Redis
    s3: S3Server
    broker_url: str

    def put(self, key: str) -> None:
        self.s3.client().put_object(Bucket=INPUTS_BUCKET, Key=key, Body=b'{"q": "def add(a, b):"}\n')

    def jobs(self) -> list:
        return self.repository.list(limit=1000)[0]


@pytest.fixture(scope="module")
def deployment(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    settings_fields = {"schedule_tick_s": 0.5, "webhook_secret": SECRET, "webhook_retry_base_s": 0.2,
                       "webhook_allow_http": True, "webhook_allow_private": True}  # a receiver on 127.0.0.1
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    models={"tiny": str(tiny_checkpoint)}, jobs_bucket=JOBS_BUCKET,
                    inputs_bucket=INPUTS_BUCKET, engine_options=ENGINE_OPTIONS,
                    client_options={"timeout": 30},
                    settings_fields=settings_fields) as live:
        yield Deployment(live.client, live.repository, redis_server.client(), live.s3, redis_server.url)


def ticks_after(deployment: Deployment, schedule: ScheduleView, count: int) -> None:
    """Wait until the worker's ticker has ticked `schedule` `count` more times."""
    seen = [deployment.client.schedules.get(schedule).runtime.last_tick_at]

    def advanced() -> bool:
        last = deployment.client.schedules.get(schedule).runtime.last_tick_at
        if last != seen[-1]:
            seen.append(last)
        return len(seen) > count

    wait_until(advanced, timeout=WAIT_S, what=f"{count} ticks of {schedule.id}", interval=0.1)


def test_the_ticker_submits_one_job_per_file_and_each_webhook_arrives_signed_after_a_retry(
        deployment: Deployment) -> None:
    schedules = deployment.client.schedules
    with webhook_receiver(statuses=[500]) as receiver:  # the first delivery fails: it must be retried
        schedule = schedules.create(cron="* * * * * *", input_prefix=f"s3://{INPUTS_BUCKET}/feed/", job=JOB,
                                    webhook_url=receiver.url)
        deployment.put("feed/a.jsonl")
        wait_until(lambda: len(schedules.submitted(schedule)) == 1, timeout=WAIT_S, what="a's job")
        deployment.put("feed/b.jsonl")
        wait_until(lambda: len(schedules.submitted(schedule)) == 2, timeout=WAIT_S, what="b's job")
        ticks_after(deployment, schedule, 3)

        # A restarted scheduler that lost its record of what it submitted (Redis flushed) finds the
        # same jobs again through their ids, derived from (schedule, key, ETag).
        deployment.redis.delete(f"bulkinfer:schedule:{{{schedule.id}}}:seen")
        wait_until(lambda: len(schedules.submitted(schedule)) == 2, timeout=WAIT_S, what="the record rebuilt")
        ticks_after(deployment, schedule, 2)

        job_ids = sorted(item.job_id for item in schedules.submitted(schedule))
        assert sorted(job.job_id for job in deployment.jobs()) == job_ids
        for job_id in job_ids:
            status = deployment.client.jobs.wait(job_id, poll_interval=0.2, timeout=WAIT_S)
            assert status.state == JobState.SUCCEEDED, status.error
        wait_until(lambda: len(receiver.requests) == 3, timeout=WAIT_S, what="three webhook requests")

    assert [request.answered for request in receiver.requests] == [500, 200, 200]
    for request in receiver.requests:
        assert webhooks.verify_signature(SECRET, request.body, request.headers[webhooks.SIGNATURE_HEADER])
        body = json.loads(request.body)
        assert body["job"]["state"] == "succeeded" and body["job"]["job_id"] in job_ids
        expected_id = f"{body['job']['job_id']}.succeeded"
        assert request.headers[webhooks.DELIVERY_HEADER] == body["delivery_id"] == expected_id
    retried = receiver.requests[0].headers[webhooks.DELIVERY_HEADER]
    assert [r.headers[webhooks.DELIVERY_HEADER] for r in receiver.requests].count(retried) == 2
    assert sorted(json.loads(r.body)["job"]["job_id"] for r in receiver.requests[1:]) == job_ids


def test_a_paused_schedule_is_passed_over_by_the_ticker(deployment: Deployment) -> None:
    schedules = deployment.client.schedules
    paused = schedules.create(cron="* * * * * *", input_prefix=f"s3://{INPUTS_BUCKET}/paused/", job=JOB,
                              paused=True)
    witness = schedules.create(cron="* * * * * *", input_prefix=f"s3://{INPUTS_BUCKET}/empty/", job=JOB)
    deployment.put("paused/a.jsonl")
    ticks_after(deployment, witness, 3)  # the ticker has come round several times meanwhile
    assert schedules.submitted(paused) == []
    assert schedules.get(paused).runtime.last_tick_at is None
    schedules.delete(witness)
    schedules.delete(paused)


def test_a_job_cancelled_through_the_api_and_a_failed_job_report_their_end(deployment: Deployment) -> None:
    sender = create_celery_app(deployment.broker_url, name="bulkinfer-test-sender")
    with webhook_receiver() as receiver:
        # Never planned, so no worker task ever sees this job: the API's cancel sends its webhook.
        cancelled = deployment.repository.create(JobSpec(
            input_uri=f"s3://{INPUTS_BUCKET}/never.jsonl", webhook_url=receiver.url, **JOB)).job_id
        deployment.client.jobs.cancel(cancelled)
        deployment.client.jobs.cancel(cancelled)  # again: still one delivery
        failed = deployment.repository.create(JobSpec(
            input_uri=f"s3://{INPUTS_BUCKET}/missing.jsonl", webhook_url=receiver.url, **JOB)).job_id
        sender.send_task("bulkinfer.plan_job", args=[failed], queue="bulkinfer.control")  # as at submit
        wait_until(lambda: len(receiver.requests) == 2, timeout=WAIT_S, what="two webhook requests")
    sender.close()
    assert len(receiver.requests) == 2

    bodies = {body["job"]["job_id"]: body for body in (json.loads(r.body) for r in receiver.requests)}
    assert bodies[cancelled]["job"]["state"] == "cancelled"
    assert bodies[failed]["job"]["state"] == "failed" and "missing.jsonl" in bodies[failed]["job"]["error"]
    assert all(webhooks.verify_signature(SECRET, r.body, r.headers[webhooks.SIGNATURE_HEADER])
               for r in receiver.requests)
