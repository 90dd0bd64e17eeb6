"""JobRepository against real Redis and both stores (moto S3 and a local directory)."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.counters import JobCounters
from bulkinfer.jobs.state.manifest import build_manifest, write_manifest
from bulkinfer.jobs.state.repository import IdempotencyConflict, JobConflict, JobNotFound, JobRepository
from bulkinfer.jobs.state.status import IllegalTransition, JobState, JobStatus
from tests.jobs.helpers import run_shard

PREFIX = "tenant-a"


@pytest.fixture
def redis_client(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def repository(store, redis_client) -> JobRepository:
    return JobRepository(store, redis_client, prefix=PREFIX)


def make_spec(**changes) -> JobSpec:
    fields = {"input_uri": "/in/rows.jsonl", "input_format": "jsonl", "model": "m", "prompt_column": "q",
              "shard_size": 4}
    return JobSpec(**{**fields, **changes})


def stored_status(repository: JobRepository, job_id: str) -> JobStatus:
    return JobStatus.model_validate_json(repository.store.get_bytes(repository.layout(job_id).status_key))


@pytest.fixture
def planned_job(repository):
    """A 10-row JSONL job planned into 3 shards and moved to running."""
    store = repository.store
    lines = [json.dumps({"q": f"question {n}"}) for n in range(10)]
    store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    spec = make_spec().with_formats("jsonl")
    status = repository.create(spec)
    plan = repository.save_plan(status.job_id, plan_shards(store, "in/rows.jsonl", spec))
    repository.counters(status.job_id).initialize(plan)
    repository.transition(status.job_id, JobState.RUNNING)
    return status.job_id, spec, plan


def test_create_writes_the_spec_and_status_and_records_the_job(repository, store, redis_client) -> None:
    status = repository.create(make_spec())
    assert status.state == JobState.QUEUED and status.job_id.startswith("job-")
    layout = repository.layout(status.job_id)
    assert layout.spec_key.startswith(f"{PREFIX}/jobs/{status.job_id}/")
    assert JobSpec.model_validate_json(store.get_bytes(layout.spec_key)) == make_spec()
    assert stored_status(repository, status.job_id).state == JobState.QUEUED
    assert repository.get(status.job_id).created_at == status.created_at
    assert repository.get_spec(status.job_id) == make_spec()
    assert not repository.is_cancel_requested(status.job_id)


def test_unknown_job_is_not_found(repository) -> None:
    with pytest.raises(JobNotFound, match="no job 'job-nope'"):
        repository.get("job-nope")
    with pytest.raises(JobNotFound):
        repository.request_cancel("job-nope")
    with pytest.raises(ValueError, match="letters, digits"):
        repository.get("../etc")


def test_same_idempotency_key_and_spec_is_the_same_job_even_after_redis_lost_it(
        repository, redis_client) -> None:
    first = repository.create(make_spec(idempotency_key="nightly-2026-11-29"))
    repository.transition(first.job_id, JobState.RUNNING)
    again = repository.create(make_spec(idempotency_key="nightly-2026-11-29"))
    assert again.job_id == first.job_id and again.state == JobState.RUNNING

    redis_client.flushall()
    after_flush = repository.create(make_spec(idempotency_key="nightly-2026-11-29"))
    assert (after_flush.job_id, after_flush.state) == (first.job_id, JobState.RUNNING)
    assert [job.job_id for job in repository.list()[0]] == [first.job_id]


def test_same_idempotency_key_with_another_spec_is_a_conflict(repository) -> None:
    first = repository.create(make_spec(idempotency_key="k1"))
    with pytest.raises(IdempotencyConflict, match="'k1' was already used for job") as conflict:
        repository.create(make_spec(idempotency_key="k1", model="other"))
    assert conflict.value.job_id == first.job_id
    assert repository.create(make_spec(idempotency_key="k2")).job_id != first.job_id


def test_an_explicit_job_id_is_created_once(repository) -> None:
    assert repository.create(make_spec(), job_id="job-mine").job_id == "job-mine"
    assert repository.create(make_spec(), job_id="job-mine").job_id == "job-mine"
    with pytest.raises(JobConflict, match="already exists with a different spec"):
        repository.create(make_spec(model="other"), job_id="job-mine")
    keyed = make_spec(idempotency_key="k")
    derived = JobRepository.job_id_for(keyed)
    assert repository.create(keyed, job_id=derived).job_id == derived
    with pytest.raises(ValueError, match="has the id"):
        repository.create(keyed, job_id="job-other")


def test_concurrent_creates_with_one_key_make_one_job(repository) -> None:
    spec = make_spec(idempotency_key="race")
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(repository.create(spec).job_id))
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6 and len(set(results)) == 1
    assert len(repository.list()[0]) == 1


def test_transitions_follow_the_machine_and_repeats_are_no_ops(repository) -> None:
    job_id = repository.create(make_spec()).job_id
    running = repository.transition(job_id, JobState.RUNNING)
    assert running.state == JobState.RUNNING and running.started_at is not None
    assert stored_status(repository, job_id).state == JobState.RUNNING

    assert repository.transition(job_id, "running").started_at == running.started_at  # delivered twice
    repository.transition(job_id, JobState.FINALIZING)
    assert repository.transition(job_id, JobState.RUNNING).state == JobState.FINALIZING  # already past it
    with pytest.raises(ValueError, match="needs an error message"):
        repository.transition(job_id, JobState.FAILED)
    failed = repository.transition(job_id, JobState.FAILED, error="input unreadable")
    assert (failed.state, failed.error) == (JobState.FAILED, "input unreadable")
    assert failed.finished_at is not None
    assert stored_status(repository, job_id).error == "input unreadable"
    with pytest.raises(IllegalTransition, match="a failed job cannot become succeeded"):
        repository.transition(job_id, JobState.SUCCEEDED)


def test_concurrent_final_transitions_have_exactly_one_winner(repository) -> None:
    job_id = repository.create(make_spec()).job_id
    repository.transition(job_id, JobState.RUNNING)
    repository.transition(job_id, JobState.FINALIZING)
    targets = [JobState.SUCCEEDED, JobState.CANCELLED, JobState.FAILED] * 4
    outcomes: list[JobState | str] = []
    barrier = threading.Barrier(len(targets))

    def attempt(target: JobState) -> None:
        barrier.wait()
        try:
            outcomes.append(repository.transition(job_id, target, error="lost a race").state)
        except IllegalTransition:
            outcomes.append("refused")

    threads = [threading.Thread(target=attempt, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = repository.get(job_id).state
    winners = [outcome for outcome in outcomes if outcome != "refused"]
    assert final.is_terminal and set(winners) == {final}
    assert len(winners) == targets.count(final)  # only repeats of the winning transition succeed
    assert stored_status(repository, job_id).state == final
    assert [job.job_id for job in repository.list(state=final)[0]] == [job_id]
    for other in (JobState.QUEUED, JobState.RUNNING, JobState.FINALIZING):
        assert repository.list(state=other)[0] == []


def test_get_rebuilds_state_and_counts_from_the_store_after_redis_was_flushed(
        repository, planned_job, redis_client) -> None:
    job_id, spec, plan = planned_job
    layout = repository.layout(job_id)
    result = run_shard(repository.store, "in/rows.jsonl", repository.store, layout, spec, plan[0])
    repository.counters(job_id).apply_shard(result)
    repository.request_cancel(job_id)
    live = repository.get(job_id)

    redis_client.flushall()
    restored = repository.get(job_id)
    assert restored.state == JobState.CANCELLED == live.state
    assert (restored.shards.done, restored.shards.total) == (1, len(plan))
    assert restored.rows == live.rows and restored.usage == live.usage
    assert repository.is_cancel_requested(job_id)  # the flag comes back with a cancelled job


def test_transition_after_redis_was_flushed_continues_from_the_store(
        repository, planned_job, redis_client) -> None:
    job_id, spec, plan = planned_job
    layout = repository.layout(job_id)
    results = [run_shard(repository.store, "in/rows.jsonl", repository.store, layout, spec, shard)
               for shard in plan]
    redis_client.flushall()
    assert repository.transition(job_id, JobState.FINALIZING).state == JobState.FINALIZING
    manifest = build_manifest(job_id, spec.spec_hash(), "jsonl", len(plan), results)
    write_manifest(repository.store, layout, manifest)

    done = repository.transition(job_id, JobState.SUCCEEDED)
    assert done.state == JobState.SUCCEEDED and done.started_at is not None
    assert done.output_uris == [part.output.uri for part in manifest.parts]
    assert done.manifest_uri == repository.store.uri(layout.manifest_key)
    assert (done.rows.total, done.rows.succeeded, done.rows.pending) == (10, 10, 0)
    assert stored_status(repository, job_id).output_uris == done.output_uris


def test_list_pages_newest_first_with_a_stable_cursor_and_a_state_filter(repository) -> None:
    ids = [repository.create(make_spec(metadata={"n": str(n)})).job_id for n in range(7)]
    first, cursor = repository.list(limit=3)
    assert [job.job_id for job in first] == ids[::-1][:3] and cursor
    newer = repository.create(make_spec(metadata={"n": "late"})).job_id  # must not shift the pages
    second, cursor = repository.list(cursor=cursor, limit=3)
    third, last_cursor = repository.list(cursor=cursor, limit=3)
    assert [job.job_id for job in second + third] == ids[::-1][3:] and last_cursor is None
    assert repository.list(limit=1)[0][0].job_id == newer

    for job_id in ids[:3]:
        repository.transition(job_id, JobState.RUNNING)
    running, _ = repository.list(state="running")
    assert [job.job_id for job in running] == ids[:3][::-1]
    assert all(job.state == JobState.RUNNING for job in running)
    queued_ids = [job.job_id for job in repository.list(state=JobState.QUEUED, limit=100)[0]]
    assert set(queued_ids) == {*ids[3:], newer}
    with pytest.raises(ValueError):
        repository.list(state="sleeping")
    with pytest.raises(ValueError, match="limit"):
        repository.list(limit=0)


def test_cancel_raises_the_flag_and_leaves_a_finished_job_alone(repository) -> None:
    queued = repository.create(make_spec()).job_id
    cancelled = repository.request_cancel(queued)
    assert cancelled.state == JobState.CANCELLED and cancelled.finished_at is not None
    assert repository.is_cancel_requested(queued)
    assert repository.request_cancel(queued).finished_at == cancelled.finished_at  # again: no change

    finished = repository.create(make_spec(metadata={"a": "b"})).job_id
    for state in (JobState.RUNNING, JobState.FINALIZING, JobState.SUCCEEDED):
        repository.transition(finished, state)
    assert repository.request_cancel(finished).state == JobState.SUCCEEDED
    assert stored_status(repository, finished).state == JobState.SUCCEEDED


def test_a_plan_is_saved_once_and_a_second_planner_gets_the_first_plan(repository, planned_job) -> None:
    job_id, _spec, plan = planned_job
    assert repository.load_plan(job_id) == plan
    assert repository.save_plan(job_id, plan[:1]) == plan


def test_counters_live_under_the_repository_namespace(repository, planned_job, redis_client) -> None:
    job_id, _spec, plan = planned_job
    assert JobCounters(redis_client, job_id).read().shards.total == len(plan)
    assert repository.get(job_id).shards.total == len(plan)
