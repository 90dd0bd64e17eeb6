"""The test services are real: Redis, moto S3 over HTTP, and a Celery worker in its own process."""

from __future__ import annotations

import os

import pytest
from botocore.exceptions import ClientError

from tests.fixtures.services import celery_worker
from tests.support.probe_app import app as probe_app


def test_redis_is_a_real_server_and_clean_per_test(redis_url: str, redis_server) -> None:
    client = redis_server.client()
    assert client.dbsize() == 0
    client.set("bulkinfer:test", "1")
    assert client.info("server")["tcp_port"] == int(redis_url.rsplit(":", 1)[1].split("/")[0])


def test_s3_round_trip_and_write_once(s3) -> None:
    client = s3.client()
    client.create_bucket(Bucket="bucket")
    client.put_object(Bucket="bucket", Key="a/b.txt", Body=b"hello", IfNoneMatch="*")
    assert client.get_object(Bucket="bucket", Key="a/b.txt")["Body"].read() == b"hello"
    # Conditional writes are how output parts stay write-once; moto must honour them.
    with pytest.raises(ClientError) as error:
        client.put_object(Bucket="bucket", Key="a/b.txt", Body=b"again", IfNoneMatch="*")
    assert error.value.response["Error"]["Code"] == "PreconditionFailed"


def test_s3_is_reset_between_tests(s3) -> None:
    assert s3.client().list_buckets()["Buckets"] == []


@pytest.mark.timeout(180)
def test_task_sent_through_redis_runs_in_a_worker_process_and_writes_to_s3(redis_url: str, s3) -> None:
    client = s3.client()
    client.create_bucket(Bucket="results")
    with celery_worker("tests.support.probe_app", redis_url, env=s3.env()) as worker_process:
        probe_app.conf.broker_url = redis_url
        probe_app.conf.result_backend = redis_url
        result = probe_app.send_task("probe.write_object", args=["results", "probe/out.txt", "from-worker"],
                                     ignore_result=False)  # the app stores no result unless asked
        reply = result.get(timeout=60)
        assert reply["pid"] == worker_process.pid != os.getpid()
    body = client.get_object(Bucket="results", Key="probe/out.txt")["Body"].read()
    assert body == b"from-worker"


@pytest.mark.timeout(120)
def test_worker_helper_reports_a_worker_that_cannot_start(redis_url: str) -> None:
    # A worker that dies at start-up is reported with its log, not waited on until the timeout
    # (which would raise TimeoutError instead).
    with pytest.raises(RuntimeError, match="exited early"):
        with celery_worker("tests.support.no_such_module", redis_url, ready_timeout=120):
            pass
