"""Infrastructure failures are retried, never turned into a failed job; input problems fail the job."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis
from botocore.exceptions import ClientError, EndpointConnectionError

from jobs.settings import Settings
from jobs.spec import JobSpec
from tests.fixtures.services import S3Server, free_port
from worker.context import WorkerContext
from worker.job_lifecycle import JobCannotRun, resolved_spec
from worker.tasks import retrying_transient_errors
from worker.transient import is_transient, retry_delay_s


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


def test_a_task_retries_transient_errors_with_backoff_and_lets_others_through() -> None:
    task = RecordingTask(retries=3)

    def unreachable() -> dict:
        raise redis.ConnectionError("refused")

    with pytest.raises(RuntimeError, match="retry scheduled"):
        retrying_transient_errors(task, unreachable)  # type: ignore[arg-type]
    assert task.retried["countdown"] == 8 and task.retried["max_retries"] is None
    assert retry_delay_s(20) == 60

    def broken() -> dict:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        retrying_transient_errors(RecordingTask(0), broken)  # type: ignore[arg-type]
    done = retrying_transient_errors(RecordingTask(0), lambda: {"status": "done"})  # type: ignore[arg-type]
    assert done == {"status": "done"}
