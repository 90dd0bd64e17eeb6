"""Infrastructure failures are retried, never turned into a failed job; input problems fail the job."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from botocore.exceptions import ClientError, EndpointConnectionError
from celery.exceptions import Retry
from kombu.exceptions import OperationalError

from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.tasks import (
    finalize_job,
    plan_job,
    retry_published,
    run_next_shard,
    run_shard,
    run_step,
)
from bulkinfer.worker.process.webhook_delivery import deliver_webhook
from bulkinfer.worker.shards.job_lifecycle import JobCannotRun, resolved_spec
from bulkinfer.worker.transient import is_transient, retry_delay_s
from tests.fixtures.services import S3Server, free_port
from tests.support.small_disk import small_disk


def s3_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, "GetObject")


def test_unreachable_services_and_throttling_are_transient_missing_objects_are_not() -> None:
    assert is_transient(redis.ConnectionError("refused"))
    assert is_transient(EndpointConnectionError(endpoint_url="http://s3"))
    assert is_transient(s3_error("SlowDown")) and is_transient(s3_error("503"))
    assert not is_transient(s3_error("NoSuchKey")) and not is_transient(s3_error("AccessDenied"))
    assert not is_transient(ValueError("not JSON"))


def test_an_unreachable_store_is_raised_for_a_retry_a_missing_input_fails_the_job(s3: S3Server) -> None:
    spec = JobSpec(input_uri="s3://inputs/rows.jsonl", model="tiny", prompt_column="q")
    down = WorkerContext(Settings(s3_endpoint_url=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(EndpointConnectionError):
        resolved_spec(down, spec)
    up = WorkerContext(Settings(s3_endpoint_url=s3.endpoint_url))
    s3.client().create_bucket(Bucket="inputs")
    with pytest.raises(JobCannotRun, match="cannot read the input s3://inputs/rows.jsonl"):
        resolved_spec(up, spec)


class RecordingTask:
    name = "bulkinfer.run_shard"

    def __init__(self, retries: int) -> None:
        self.request = SimpleNamespace(retries=retries, id="job-x.shard.00000")
        self.retried: dict = {}

    def retry(self, **options: object) -> Exception:
        self.retried = options
        return RuntimeError("retry scheduled")


@pytest.fixture
def context(redis_url: str, tmp_path: Path) -> WorkerContext:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), max_task_attempts=3)
    return WorkerContext(settings)


def test_a_step_retries_transient_errors_for_as_long_as_they_last(context: WorkerContext) -> None:
    job_id = context.repository.create(JobSpec(input_uri="s3://inputs/rows.jsonl", model="tiny",
                                               prompt_column="q")).job_id

    def unreachable() -> dict:
        raise redis.ConnectionError("refused")

    for retries in (3, 30):  # never counted as an attempt: an outage of any length is waited out
        task = RecordingTask(retries=retries)
        with pytest.raises(RuntimeError, match="retry scheduled"):
            run_step(task, context, job_id, "shard 0", unreachable)  # type: ignore[arg-type]
        assert task.retried["max_retries"] is None
    assert task.retried["countdown"] == 60 and retry_delay_s(3) == 8
    assert context.repository.get(job_id).state == JobState.QUEUED
    done = run_step(RecordingTask(0), context, job_id, "shard 0", lambda: {"status": "done"})  # type: ignore[arg-type]
    assert done == {"status": "done"}


def test_a_step_that_keeps_failing_the_same_way_fails_its_job_with_the_reason(context: WorkerContext) -> None:
    job_id = context.repository.create(JobSpec(input_uri="s3://inputs/rows.jsonl", model="tiny",
                                               prompt_column="q")).job_id

    def broken() -> dict:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    delays = []
    for _ in range(2):  # attempts 1 and 2: retried with backoff, the job still waits
        task = RecordingTask(0)
        with pytest.raises(RuntimeError, match="retry scheduled"):
            run_step(task, context, job_id, "shard 4", broken)  # type: ignore[arg-type]
        delays.append(task.retried["countdown"])
        assert context.repository.get(job_id).state == JobState.QUEUED
    assert delays == [1, 2]
    summary = run_step(RecordingTask(0), context, job_id, "shard 4", broken)  # type: ignore[arg-type]
    status = context.repository.get(job_id)
    assert summary["status"] == "failed" and status.state == JobState.FAILED
    assert status.error is not None
    assert status.error.startswith("shard 4 failed 3 time(s); last error: UnicodeEncodeError:")
    assert "surrogates not allowed" in status.error


class FlakyBrokerTask(RecordingTask):
    """retry() cannot publish the first `failures` times (Redis down), then it can."""

    def __init__(self, failures: int) -> None:
        super().__init__(retries=0)
        self.failures = failures
        self.tries = 0

    def retry(self, **options: object) -> Exception:
        self.tries += 1
        if self.tries <= self.failures:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return super().retry(**options)


def test_a_retry_that_cannot_be_published_is_sent_again_until_the_broker_takes_it() -> None:
    task, slept = FlakyBrokerTask(failures=3), []
    outcome = retry_published(task, redis.ConnectionError("refused"), 4.0, sleep=slept.append)  # type: ignore[arg-type]
    assert str(outcome) == "retry scheduled" and task.tries == 4
    assert slept == [1.0, 2.0, 4.0] and task.retried["countdown"] == 4.0


@contextmanager
def redis_out_of_memory(client: redis.Redis) -> Iterator[None]:
    """Redis's maxmemory below what it holds: every command that may grow memory is refused (OOM)."""
    client.set("ballast", "x" * 10_000)
    client.config_set("maxmemory", "1")
    try:
        yield
    finally:
        client.config_set("maxmemory", "0")


def test_redis_out_of_memory_is_transient_a_command_that_is_wrong_is_not(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("a-string", "v")
    refusals = []
    with redis_out_of_memory(client):
        for command in (lambda: client.set("k", "v"),
                        lambda: client.register_script("return redis.call('INCR', KEYS[1])")(keys=["n"]),
                        lambda: client.pipeline(transaction=True).incr("n").expire("n", 9).execute()):
            with pytest.raises(redis.ResponseError) as refused:
                command()
            refusals.append(refused.value)
    assert all(is_transient(error) for error in refusals), refusals  # a plain command, a script, a pipeline
    with pytest.raises(redis.ResponseError) as wrong_type:
        client.lpush("a-string", "x")
    with pytest.raises(redis.ResponseError) as in_script:
        client.register_script("return redis.call('LPUSH', KEYS[1], 'x')")(keys=["a-string"])
    assert not is_transient(wrong_type.value) and not is_transient(in_script.value)
    busy = redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL")
    assert is_transient(busy) and not is_transient(redis.ResponseError("unknown command 'FOO'"))


def test_a_full_disk_is_transient_other_os_errors_are_not(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "1m") as disk:
        disk.fill()
        with pytest.raises(OSError) as full:
            LocalObjectStore(disk.path).put_bytes("jobs/j/output/part-00000.jsonl", b"{}\n" * 1000)
    assert full.value.errno == errno.ENOSPC and is_transient(full.value)
    assert is_transient(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_transient(PermissionError(errno.EACCES, "Permission denied"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "No such file"))


def test_a_step_waits_out_a_full_disk_and_finishes_when_space_comes_back(context: WorkerContext,
                                                                        tmp_path: Path) -> None:
    job_id = context.repository.create(JobSpec(input_uri="s3://inputs/rows.jsonl", model="tiny",
                                               prompt_column="q")).job_id
    with small_disk(tmp_path / "disk", "1m") as disk:
        store = LocalObjectStore(disk.path)

        def write_part() -> dict:
            store.put_bytes("jobs/j/output/part-00000.jsonl", b"{}\n" * 1000)
            return {"status": "done"}

        disk.fill()
        for retries in range(5):  # more than max_task_attempts (3): none of them counted
            task = RecordingTask(retries)
            with pytest.raises(RuntimeError, match="retry scheduled"):
                run_step(task, context, job_id, "shard 0", write_part)  # type: ignore[arg-type]
            assert task.retried["countdown"] == retry_delay_s(retries)
        assert context.repository.get(job_id).state == JobState.QUEUED
        disk.free()
        assert run_step(RecordingTask(5), context, job_id, "shard 0", write_part) == {"status": "done"}  # type: ignore[arg-type]


def test_a_step_waits_out_redis_out_of_memory_but_a_wrong_command_counts(context: WorkerContext) -> None:
    repository = context.repository
    job_id = repository.create(JobSpec(input_uri="s3://inputs/rows.jsonl", model="tiny",
                                       prompt_column="q")).job_id

    def count_a_row() -> dict:
        return {"status": "done", "rows": repository.redis.incr(f"rows-of-{job_id}")}

    with redis_out_of_memory(repository.redis):
        for retries in range(4):
            with pytest.raises(RuntimeError, match="retry scheduled"):
                run_step(RecordingTask(retries), context, job_id, "shard 1", count_a_row)  # type: ignore[arg-type]
    assert repository.get(job_id).state == JobState.QUEUED
    done = run_step(RecordingTask(4), context, job_id, "shard 1", count_a_row)  # type: ignore[arg-type]
    assert done == {"status": "done", "rows": 1}

    repository.redis.set(f"list-of-{job_id}", "not a list")

    def wrong_type() -> dict:
        repository.redis.lpush(f"list-of-{job_id}", "row")
        return {}

    for _ in range(2):
        with pytest.raises(RuntimeError, match="retry scheduled"):
            run_step(RecordingTask(0), context, job_id, "shard 2", wrong_type)  # type: ignore[arg-type]
    summary = run_step(RecordingTask(0), context, job_id, "shard 2", wrong_type)  # type: ignore[arg-type]
    assert summary["status"] == "failed" and "WRONGTYPE" in str(repository.get(job_id).error)


@pytest.mark.parametrize("task", [plan_job, run_next_shard, run_shard, finalize_job, deliver_webhook],
                         ids=lambda task: task.name)
def test_a_step_is_retried_past_celerys_default_limit_of_three(task, monkeypatch) -> None:  # noqa: ANN001
    """Celery's retry(max_retries=None) falls back to the task's own limit, 3 unless set, and past it
    raises the error instead of scheduling a retry: a fourth transient failure (a disk full for
    longer than three retries) then read as a retry that could not be sent, and its shard sat for
    15 minutes. Our steps count their own attempts (run_step; webhooks theirs), so no task has a
    Celery limit."""
    from celery.canvas import Signature

    monkeypatch.setattr(Signature, "apply_async", lambda self, *args, **options: None)  # the publish
    task.push_request(id="attempt-11", retries=10, args=["job-a"], kwargs={}, called_directly=False)
    try:
        with pytest.raises(Retry):
            task.retry(exc=OSError(errno.ENOSPC, "No space left on device"), countdown=1, max_retries=None)
    finally:
        task.pop_request()
