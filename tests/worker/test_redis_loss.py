"""Redis restarted with its data lost mid-job: jobs are rebuilt from the object store and finish."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from tests.fixtures.services import S3Server, celery_worker, wait_until
from tests.worker.conftest import Pipeline, RestartableRedis, bare_pipeline

pytestmark = pytest.mark.timeout(600)

LEASE_TTL_S = 2  # short leases: the reaper re-plans a lost job after two TTLs
QUEUES = "bulkinfer.control,bulkinfer.model.tiny"


@pytest.fixture
def parts(private_redis: RestartableRedis, s3: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, dict[str, str]]]:
    with bare_pipeline(private_redis.url, s3, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                       LEASE_TTL_S) as made:
        yield made


def test_jobs_finish_after_redis_restarts_without_its_data(
        private_redis: RestartableRedis, parts: tuple[Pipeline, dict[str, str]]) -> None:
    pipeline, env = parts
    repository = pipeline.repository

    def job(name: str, rows: int, max_tokens: int) -> tuple[JobSpec, list[str]]:
        ids = [f"{name}-{n:02d}" for n in range(rows)]
        lines = [json.dumps({"id": row_id, "question": f"def {row_id.replace('-', '_')}(x):"})
                 for row_id in ids]
        return JobSpec(input_uri=pipeline.put_input(f"{name}.jsonl", lines), model="tiny", id_column="id",
                       prompt_column="question", sampling={"temperature": 0.0, "max_tokens": max_tokens},
                       shard_size=4), ids

    with celery_worker("bulkinfer.worker.process.celery_app", private_redis.url, env=env, queues=QUEUES,
                       pool="threads",
                       concurrency=2, ready_timeout=120):
        done_spec, done_ids = job("done", 4, 4)
        done_id = pipeline.submit(done_spec)
        assert pipeline.wait_for_end(done_id).state == JobState.SUCCEEDED
        running_spec, running_ids = job("running", 32, 120)  # 8 shards, several seconds each
        running_id = pipeline.submit(running_spec)
        wait_until(lambda: repository.get(running_id).shards.done >= 1, 180, "a first shard to finish")
        queued_spec, queued_ids = job("queued", 4, 4)
        queued_id = repository.create(queued_spec).job_id  # its plan message is lost with Redis
        assert repository.get(running_id).shards.done < 8, "the job ended before Redis was lost"
        private_redis.restart_empty()
        started = time.monotonic()
        statuses = {job_id: pipeline.wait_for_end(job_id, timeout=240)
                    for job_id in (running_id, queued_id)}
    for job_id, ids in ((running_id, running_ids), (queued_id, queued_ids)):
        status = statuses[job_id]
        assert status.state == JobState.SUCCEEDED, status.error
        assert [record["id"] for record in pipeline.output_records(job_id)] == ids  # each row once
        assert (status.rows.total, status.rows.succeeded) == (len(ids), len(ids))
    assert time.monotonic() - started < 240
    listed = {status.job_id: status.state for status in repository.list(limit=10)[0]}
    assert listed == {done_id: JobState.SUCCEEDED, running_id: JobState.SUCCEEDED,
                      queued_id: JobState.SUCCEEDED}  # the job that ended before is listed again
    assert [record["id"] for record in pipeline.output_records(done_id)] == done_ids
