"""A shard's usage is added in the same Redis step that counts it: a worker that dies right after
counting a shard has not lost the shard's tokens from `GET /usage` (real Redis, a local store)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import redis

from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState
from bulkinfer.jobs.state.usage import usage_report
from bulkinfer.worker.shards.shard_runner import count_shard
from tests.jobs.helpers import T0, run_shard


class WorkerDied(BaseException):
    """The process ends here (a kill -9): nothing after it runs."""


@pytest.fixture
def repository(tmp_path, redis_url) -> JobRepository:
    return JobRepository(LocalObjectStore(tmp_path / "store"), redis.Redis.from_url(redis_url))


def _planned_job(repository: JobRepository):
    lines = [json.dumps({"q": f"question {n}"}) for n in range(6)]
    repository.store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    spec = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="m", prompt_column="q",
                   shard_size=3, tenant="acme").with_formats("jsonl")
    job_id = repository.create(spec).job_id
    plan = repository.save_plan(job_id, plan_shards(repository.store, "in/rows.jsonl", spec))
    repository.counters(job_id).initialize(plan)
    repository.transition(job_id, JobState.RUNNING)
    return job_id, spec, plan


def _die_after_counting(monkeypatch, counted_key: str) -> None:
    """Every Redis call after the one that marks the shard counted fails as a dead process would."""
    died = False
    original_command = redis.Redis.execute_command
    original_execute = redis.client.Pipeline.execute

    def execute_command(self, *args, **options):
        nonlocal died
        if died:
            raise WorkerDied
        answer = original_command(self, *args, **options)
        if args and str(args[0]).upper() in ("EVAL", "EVALSHA") and counted_key in args:
            died = True
        return answer

    def execute(self, *args, **options):
        if died:
            raise WorkerDied
        return original_execute(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", execute_command)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)


def test_a_worker_dying_right_after_counting_a_shard_keeps_its_usage(repository, monkeypatch) -> None:
    job_id, spec, plan = _planned_job(repository)
    layout = repository.layout(job_id)
    result = run_shard(repository.store, "in/rows.jsonl", repository.store, layout, spec, plan[0])
    assert result.usage.prompt > 0

    with monkeypatch.context() as patch:
        _die_after_counting(patch, repository.counters(job_id).counted_key)
        with pytest.raises(WorkerDied):
            count_shard(repository, layout, plan, result, send_finalize=lambda _: None, spec=spec)
    # The reaper (or a redelivery) counts the committed result again: a no-op for a counted shard.
    count_shard(repository, layout, plan, result, send_finalize=lambda _: None)

    assert repository.counters(job_id).read().shards.done == 1
    report = usage_report(repository.redis, repository.namespace, T0 - timedelta(hours=1),
                          T0 + timedelta(hours=1), tenant="acme")
    assert report.total.shards == 1
    assert report.total.usage.prompt == result.usage.prompt
    assert report.total.rows == result.rows


def test_counting_a_shard_twice_adds_its_usage_once(repository) -> None:
    job_id, spec, plan = _planned_job(repository)
    layout = repository.layout(job_id)
    results = [run_shard(repository.store, "in/rows.jsonl", repository.store, layout, spec, shard)
               for shard in plan]
    finalizes: list[str] = []
    for result in results + results:  # every shard delivered twice
        count_shard(repository, layout, plan, result, send_finalize=finalizes.append, spec=spec)
    report = usage_report(repository.redis, repository.namespace, T0 - timedelta(hours=1),
                          T0 + timedelta(hours=1))
    assert report.total.shards == len(plan) == 2
    assert report.total.usage.prompt == sum(result.usage.prompt for result in results)
    assert [line.tenant for line in report.lines] == ["acme"]
    assert finalizes and set(finalizes) == {job_id}
