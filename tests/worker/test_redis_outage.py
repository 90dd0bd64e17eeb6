"""Redis unreachable for longer than the lease TTL while a shard runs: the run's work is committed,
not thrown away and computed again (the write-once result decides, the fence keeps one copy)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bulkinfer.jobs.names import shard_lease_key
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.shards.shard_runner import committed_result
from tests.fixtures.services import S3Server, celery_worker
from tests.worker.conftest import RestartableRedis, bare_pipeline
from tests.worker.test_redis_loss import QUEUES

pytestmark = pytest.mark.timeout(600)

LEASE_TTL_S = 3
# Longer than the lease TTL, and than the Redis client's socket timeout (10 s): every Redis call
# of the run fails meanwhile.
OUTAGE_S = 14


def test_a_shard_running_through_a_redis_outage_longer_than_its_lease_commits_its_own_work(
        private_redis: RestartableRedis, s3: S3Server, tiny_checkpoint: Path, tmp_path: Path) -> None:
    with bare_pipeline(private_redis.url, s3, tiny_checkpoint, tmp_path / "model-cache",
                       lease_ttl_s=LEASE_TTL_S) as (pipeline, env):
        # 16 waves of 16 sequences × 160 tokens: still running when the outage starts (64 rows ended
        # within a second of the lease on a quiet machine)
        rows = 256
        ids = [f"q{n:02d}" for n in range(rows)]
        lines = [json.dumps({"id": row_id, "question": f"def {row_id}(x):"}) for row_id in ids]
        spec = JobSpec(input_uri=pipeline.put_input("outage.jsonl", lines), model="tiny", id_column="id",
                       prompt_column="question",
                       sampling={"temperature": 0.0, "max_tokens": 160, "ignore_eos": True},
                       shard_size=rows)
        repository = pipeline.repository
        with celery_worker("bulkinfer.worker.process.celery_app", private_redis.url, env=env, queues=QUEUES,
                           pool="threads",
                           concurrency=2, ready_timeout=120):
            job_id = pipeline.submit(spec)
            lease = shard_lease_key(repository.namespace, job_id, 0)
            deadline = time.monotonic() + 180
            while not repository.redis.exists(lease):
                assert time.monotonic() < deadline, "the shard never started"
                time.sleep(0.05)
            time.sleep(0.5)  # the model loading or loaded, the rows about to run or running
            layout = repository.layout(job_id)
            assert not repository.store.exists(layout.shard_result_key(0)), "it ended before the outage"
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            outage_started = time.monotonic()
            try:
                time.sleep(OUTAGE_S)
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            status = pipeline.wait_for_end(job_id, timeout=240)
        assert status.state == JobState.SUCCEEDED, status.error
        assert [record["id"] for record in pipeline.output_records(job_id)] == ids
        assert (status.rows.total, status.rows.succeeded, status.shards.done) == (rows, rows, 1)
        # The run that took the lease first (generation 1) committed what it computed through the
        # outage; no later run computed the shard again.
        result = committed_result(repository, layout, 0)
        assert result is not None and str(result.fence).startswith("g1-"), result.fence
        assert time.monotonic() - outage_started > OUTAGE_S
