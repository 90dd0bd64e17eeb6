"""A running shard's finished rows show in the job's counts before it commits, and no row is ever
counted twice: the commit takes the live figures' place in one step, a stale or older run cannot
bring them back, and an ended job shows only what was committed (real Redis, both stores)."""

from __future__ import annotations

import json

import pytest
import redis

from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.live_progress import LiveFigures, LiveProgress
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState
from tests.jobs.helpers import run_shard

ROWS = 10
SHARD_ROWS = 4  # three shards: 4, 4 and 2 rows


@pytest.fixture
def repository(store, redis_url) -> JobRepository:
    return JobRepository(store, redis.Redis.from_url(redis_url), prefix="tenant-a")


@pytest.fixture
def running_job(repository: JobRepository):
    store = repository.store
    lines = [json.dumps({"q": f"question {n}"}) for n in range(ROWS)]
    store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    spec = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", output_format="jsonl", model="m",
                   prompt_column="q", shard_size=SHARD_ROWS)
    job_id = repository.create(spec).job_id
    plan = repository.save_plan(job_id, plan_shards(store, "in/rows.jsonl", spec))
    repository.counters(job_id).initialize(plan)
    repository.transition(job_id, JobState.RUNNING)
    return job_id, spec, plan, LiveProgress(repository.redis, job_id)


def test_rows_show_while_their_shard_runs_and_its_commit_takes_their_place(repository, running_job) -> None:
    job_id, spec, plan, live = running_job
    running = LiveFigures(succeeded=2, failed=1, prompt=30, cached=10, completion=12, engine_ms=7)
    assert live.write(0, 1, running)
    status = repository.get(job_id)
    assert (status.rows.succeeded, status.rows.failed, status.rows.pending) == (2, 1, ROWS - 3)
    assert (status.usage.prompt, status.usage.cached, status.usage.completion) == (30, 10, 12)
    assert status.shards.done == 0  # rows move, shards only when they commit

    result = run_shard(repository.store, "in/rows.jsonl", repository.store, repository.layout(job_id), spec,
                       plan[0])
    repository.counters(job_id).apply_shard(result)
    committed = repository.get(job_id)
    assert (committed.rows.succeeded, committed.rows.failed) == (result.rows_succeeded, result.rows_failed)
    assert committed.usage == result.usage and committed.shards.done == 1
    # A run of the same shard that finishes late (it lost its lease) cannot bring its rows back.
    assert not live.write(0, 1, LiveFigures(succeeded=SHARD_ROWS))
    assert not live.write(0, 2, LiveFigures(succeeded=SHARD_ROWS))
    assert repository.get(job_id).rows == committed.rows


def test_a_rerun_replaces_its_shards_figures_and_an_older_run_cannot_overwrite_them(
        repository, running_job) -> None:
    job_id, _spec, _plan, live = running_job
    live.write(1, 1, LiveFigures(succeeded=3))  # a run that crashed after three rows
    assert live.write(1, 2, LiveFigures())  # its rerun starts from nothing: replaced, not added
    assert repository.get(job_id).rows.succeeded == 0
    live.write(1, 2, LiveFigures(succeeded=1))
    assert not live.write(1, 1, LiveFigures(succeeded=4))  # the stalled first run wakes up: refused
    live.clear(1, 1)  # …and cannot drop the rerun's figures either
    assert repository.get(job_id).rows.succeeded == 1
    live.write(2, 1, LiveFigures(failed=2))
    assert (repository.get(job_id).rows.succeeded, repository.get(job_id).rows.failed) == (1, 2)
    live.clear(1, 2)  # the rerun was handed back without a commit
    assert (repository.get(job_id).rows.succeeded, repository.get(job_id).rows.failed) == (0, 2)


def test_an_ended_job_shows_only_its_committed_rows(repository, running_job) -> None:
    job_id, spec, plan, live = running_job
    result = run_shard(repository.store, "in/rows.jsonl", repository.store, repository.layout(job_id), spec,
                       plan[0])
    repository.counters(job_id).apply_shard(result)
    live.write(1, 1, LiveFigures(succeeded=3, prompt=9))  # stopped by the cancel: never committed
    assert repository.get(job_id).rows.succeeded == result.rows_succeeded + 3
    cancelled = repository.request_cancel(job_id)
    assert cancelled.state == JobState.CANCELLED
    assert (cancelled.rows.succeeded, cancelled.usage) == (result.rows_succeeded, result.usage)
    assert repository.get(job_id).rows == cancelled.rows


def test_live_rows_come_back_with_the_counters_after_redis_lost_them(repository, running_job) -> None:
    job_id, spec, plan, live = running_job
    results = [run_shard(repository.store, "in/rows.jsonl", repository.store, repository.layout(job_id), spec,
                         shard) for shard in plan[:2]]
    repository.redis.delete(repository.counters(job_id).counts_key)  # lost; the store rebuilds them
    live.write(2, 1, LiveFigures(succeeded=1))
    status = repository.get(job_id)
    assert status.shards.done == 2
    assert status.rows.succeeded == sum(result.rows_succeeded for result in results) + 1


def test_finalizing_is_timestamped_and_kept_once_the_job_ends(repository, running_job) -> None:
    job_id = running_job[0]
    finalizing = repository.transition(job_id, JobState.FINALIZING)
    assert finalizing.finalizing_at is not None and finalizing.finished_at is None
    repository.redis.flushall()  # the timestamp is in status.json too
    assert repository.get(job_id).finalizing_at == finalizing.finalizing_at


def test_cancel_says_whether_this_call_ended_the_job(repository, running_job) -> None:
    job_id = running_job[0]
    status, cancelled_now = repository.cancel(job_id)
    assert status.state == JobState.CANCELLED and cancelled_now
    status, cancelled_now = repository.cancel(job_id)
    assert status.state == JobState.CANCELLED and not cancelled_now
