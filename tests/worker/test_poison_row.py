"""A row that kills its worker process (SIGKILL: what an OOM kill or a native crash looks like)
ends as that row's `worker_crashed` error; every other row, its neighbours' jobs' too, runs once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bulkinfer.jobs.names import shard_lease_key
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.shards.fault_injection import KILL_MARKER_ENV
from bulkinfer.worker.shards.shard_crashes import WHOLE, crashes_key
from tests.fixtures.services import S3Server, celery_worker
from tests.worker.conftest import Pipeline, bare_pipeline

pytestmark = pytest.mark.timeout(600)

MARKER = "poison-7f3a9c1e-kill-me"
QUEUES = "bulkinfer.control,bulkinfer.model.tiny"


def supervise(pipeline: Pipeline, redis_url: str, env: dict[str, str], job_ids: list[str],
              timeout: float, started: list[str] | None = None) -> int:
    """Run one worker process, starting a fresh one whenever it dies (as a deployment's supervisor
    would), until every job ended; returns how many times it died."""
    deaths, deadline = 0, time.monotonic() + timeout

    def ended() -> bool:
        return bool(job_ids) and all(pipeline.repository.get(job_id).state.is_terminal for job_id in job_ids)

    while not ended():
        assert time.monotonic() < deadline, f"jobs still running after {timeout}s ({deaths} worker deaths)"
        with celery_worker("bulkinfer.worker.process.celery_app", redis_url, env=env, queues=QUEUES,
                           pool="threads",
                           concurrency=2, ready_timeout=120) as worker:
            if started is not None:  # the first worker: jobs submitted once it is up
                job_ids += [submit() for submit in started]
                started = None
            while worker.poll() is None and not ended() and time.monotonic() < deadline:
                time.sleep(0.1)
            deaths += worker.poll() is not None
    return deaths


def test_a_row_that_kills_its_worker_is_a_worker_crashed_error_and_every_other_row_runs_once(
        redis_url: str, s3: S3Server, tiny_checkpoint: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with bare_pipeline(redis_url, s3, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                       lease_ttl_s=2) as (pipeline, env):
        env = {**env, KILL_MARKER_ENV: MARKER, "BULKINFER_CRASH_SPLIT_AFTER": "1"}
        repository = pipeline.repository
        # The neighbour: another job's shard, long enough to be running in the same worker process
        # when the poison row arrives.
        neighbour_ids = [f"n{n:02d}" for n in range(48)]
        neighbour = JobSpec(
            input_uri=pipeline.put_input("neighbour.jsonl", [json.dumps({"id": i, "question": f"def {i}(x):"})
                                                             for i in neighbour_ids]),
            model="tiny", id_column="id", prompt_column="question",
            sampling={"temperature": 0.0, "max_tokens": 160}, shard_size=48)
        # Two shards of 4; row p5 (the second of shard 1) kills any worker that runs it.
        poison_ids = [f"p{n}" for n in range(8)]
        lines = [json.dumps({"id": i, "question": f"def {i}(x): {MARKER if i == 'p5' else ''}"})
                 for i in poison_ids]
        poison = JobSpec(input_uri=pipeline.put_input("poison.jsonl", lines), model="tiny", id_column="id",
                         prompt_column="question", sampling={"temperature": 0.0, "max_tokens": 4},
                         shard_size=4)
        jobs: list[str] = []

        def submit_neighbour() -> str:
            job_id = pipeline.submit(neighbour)
            deadline = time.monotonic() + 120
            while not repository.redis.exists(shard_lease_key(repository.namespace, job_id, 0)):
                assert time.monotonic() < deadline, "the neighbour's shard never started"
                time.sleep(0.05)
            return job_id

        deaths = supervise(pipeline, redis_url, env, jobs, timeout=400,
                           started=[submit_neighbour, lambda: pipeline.submit(poison)])
        neighbour_id, poison_id = jobs

        status = repository.get(poison_id)
        assert status.state == JobState.SUCCEEDED, status.error
        assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (8, 7, 1)
        records = pipeline.output_records(poison_id)
        assert [record["id"] for record in records] == poison_ids  # every row once, in order
        errors = pipeline.error_records(poison_id)
        assert [(record["id"], record["error"]["code"]) for record in errors] == [("p5", "worker_crashed")]
        assert all(record["error"] is None for record in records if record["id"] != "p5")

        status = repository.get(neighbour_id)
        assert status.state == JobState.SUCCEEDED, status.error
        assert [record["id"] for record in pipeline.output_records(neighbour_id)] == neighbour_ids
        assert status.rows.succeeded == len(neighbour_ids)
        # It was running in the worker the poison row killed (its crashed delivery stays counted).
        assert repository.redis.hget(crashes_key(repository.namespace, neighbour_id, 0), WHOLE) == b"1"
        # One crash of the whole shard, then one of its half holding p5, then one of p5 alone: no more.
        assert deaths == 3
