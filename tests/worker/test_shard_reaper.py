"""The shard reaper: a shard whose worker was killed mid-run is re-sent, not left for 12 h."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from bulkinfer.jobs.fair_queue import FairQueue
from bulkinfer.jobs.names import shard_lease_key as lease_key
from bulkinfer.jobs.names import shards_started_key as started_key
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.tasks import broker_ticket_count, send_ticket
from bulkinfer.worker.shards import shard_resend
from bulkinfer.worker.shards.job_lifecycle import plan_job
from bulkinfer.worker.shards.shard_lease import ShardLease
from bulkinfer.worker.shards.shard_reaper import reap_lost_tickets, reap_once
from tests.fixtures.services import S3Server, celery_worker
from tests.support.s3_fault_proxy import FaultPlan, s3_fault_proxy
from tests.worker.conftest import Pipeline, RestartableRedis, bare_pipeline

pytestmark = pytest.mark.timeout(600)

# The workers' lease TTL: a dead step is re-sent once its lease lapsed and the reaper saw it so for
# two TTLs, so the TTL sets how long these tests wait. A live run renews its lease every TTL/3.
LEASE_TTL_S = 2
APP = "bulkinfer.worker.process.celery_app"
QUEUES = "bulkinfer.control,bulkinfer.model.tiny"
STANDBY_QUEUE = "bulkinfer.test.standby"  # no task is ever sent there
# The standby worker's max_task_attempts (default 3): a step that fails the same way fails its job
# sooner. No other test on it has a step that raises.
MAX_ATTEMPTS = 2


@pytest.fixture
def parts(redis_url: str, s3: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, dict[str, str]]]:
    """A pipeline with no worker yet, and the environment a worker process needs (2 s leases)."""
    with bare_pipeline(redis_url, s3, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                       lease_ttl_s=LEASE_TTL_S) as made:
        yield made


@dataclass
class Standby:
    """A worker process kept for this module's tests, on a Redis of its own, consuming none of the
    pipeline's queues until a test tells it to (Celery's add_consumer): a worker that joins when the
    test needs one, without starting a process each time."""

    redis: RestartableRedis
    worker: subprocess.Popen
    model_cache: Path
    s3_faults: FaultPlan  # of the proxy the worker reaches S3 through: off unless a test turns it on

    @property
    def node(self) -> str:
        return self.worker.node  # type: ignore[attr-defined] - set by celery_worker


@pytest.fixture(scope="module")
def standby_worker(s3_server: S3Server, tiny_checkpoint: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standby]:
    server = RestartableRedis(tmp_path_factory.mktemp("standby-redis"))
    model_cache = tmp_path_factory.mktemp("model-cache")
    faults = FaultPlan(["slowdown", "reset", "internal", "slow"], every=4, slow_s=0.5)
    faults.enabled = False
    try:
        with bare_pipeline(server.url, s3_server, tiny_checkpoint, model_cache, LEASE_TTL_S) as (_, env), \
                s3_fault_proxy(s3_server.endpoint_url, faults) as proxy:
            env = {**env, "BULKINFER_S3_ENDPOINT_URL": proxy.endpoint_url,
                   "BULKINFER_MAX_TASK_ATTEMPTS": str(MAX_ATTEMPTS)}
            with celery_worker(APP, server.url, env=env, queues=STANDBY_QUEUE, pool="threads", concurrency=2,
                               ready_timeout=120) as worker:
                yield Standby(server, worker, model_cache, faults)
    finally:
        server.stop()


@pytest.fixture
def standby(standby_worker: Standby, s3: S3Server, tiny_checkpoint: Path
            ) -> Iterator[tuple[Pipeline, dict[str, str], Standby]]:
    """The standby worker idle, its Redis holding nothing of an earlier test (only the queue bindings
    its consumers need), and a pipeline on that Redis; afterwards it consumes none of the queues."""
    assert standby_worker.worker.poll() is None, "the standby worker died in an earlier test"
    client = redis.Redis.from_url(standby_worker.redis.url)
    for key in client.scan_iter(count=1000):
        if not key.startswith(b"_kombu.binding."):
            client.delete(key)
    client.close()
    with bare_pipeline(standby_worker.redis.url, s3, tiny_checkpoint, standby_worker.model_cache,
                       LEASE_TTL_S) as (pipeline, env):
        try:
            yield pipeline, env, standby_worker
        finally:
            for queue in QUEUES.split(","):
                pipeline.client.control.cancel_consumer(queue, destination=[standby_worker.node], reply=True,
                                                        timeout=10)


def consume(pipeline: Pipeline, standby: Standby, queues: str) -> None:
    """The standby worker starts consuming `queues` (comma-separated)."""
    for queue in queues.split(","):
        replies = pipeline.client.control.add_consumer(queue, destination=[standby.node], reply=True,
                                                       timeout=10)
        assert replies == [{standby.node: {"ok": f"add consumer {queue}"}}], replies


def wait_for(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def test_a_shard_whose_worker_was_killed_is_resent_and_the_job_succeeds(
        standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, env, spare = standby
    # One wave of 16 sequences × 128 tokens: seconds (after the model loads), while the kill comes
    # within a poll (50 ms) of the run taking the lease, so it lands mid-shard.
    rows = 16
    lines = [json.dumps({"id": f"q{n:02d}", "question": f"def f{n}(x):"}) for n in range(rows)]
    spec = JobSpec(input_uri=pipeline.put_input("long.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": 128},
                   shard_size=rows)
    repository = pipeline.repository
    with celery_worker(APP, spare.redis.url, env=env, queues=QUEUES, pool="threads",
                       concurrency=2, ready_timeout=120) as worker_a:
        job_id = pipeline.submit(spec)
        layout = repository.layout(job_id)
        wait_for(lambda: repository.redis.exists(lease_key(repository.namespace, job_id, 0)), 180,
                 "worker A to start the shard")
        worker_a.kill()
        worker_a.wait(timeout=30)
    # Worker A died mid-shard: the shard has no result, and its message sits unacked in Redis.
    assert not repository.store.exists(layout.shard_result_key(0)), "the shard finished before the kill"
    assert repository.get(job_id).state == JobState.RUNNING
    started = time.monotonic()
    consume(pipeline, spare, QUEUES)  # another worker, up all along, now takes the pipeline's tasks
    status = pipeline.wait_for_end(job_id, timeout=300)
    assert status.state == JobState.SUCCEEDED, status.error
    assert time.monotonic() - started < 300
    records = pipeline.output_records(job_id)
    assert [record["id"] for record in records] == [f"q{n:02d}" for n in range(rows)]
    assert (status.rows.total, status.rows.succeeded, status.shards.done) == (rows, rows, 1)


def test_the_reaper_resends_only_started_shards_with_no_live_lease(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    pipeline, _ = parts
    lines = [json.dumps({"question": f"def f{n}(x):"}) for n in range(6)]
    spec = JobSpec(input_uri=pipeline.put_input("three.jsonl", lines), model="tiny", prompt_column="question",
                   shard_size=2)
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    context = WorkerContext(pipeline.settings)
    plan_job(context, job_id, lambda *_: None)  # the shard tasks are never sent: nothing runs them
    assert repository.get(job_id).state == JobState.RUNNING
    # Shard 0: a live run holds its lease. Shard 1: never started. Shard 2: started, its holder died.
    live = ShardLease(repository.redis, job_id, 0, ttl_s=30, namespace=repository.namespace)
    assert live.acquire(give_up=lambda: True)
    repository.redis.sadd(started_key(repository.namespace, job_id), 2)
    sent: list[tuple[str, int, str]] = []

    def reap() -> list[tuple[str, int]]:
        return reap_once(context, lambda *args: sent.append(args), ttl_s=0.1, count_waiting=lambda _q: 0)

    try:
        first = reap()
        time.sleep(0.25)  # its grace: two lease TTLs
        second, third = reap(), reap()
    finally:
        live.release()

    assert first == []  # seen without a live run once: not yet
    assert second == [(job_id, 2)] and third == []  # after the grace, once
    assert sent == [(job_id, 2, "bulkinfer.model.tiny")]


def started_shard_without_a_run(pipeline: Pipeline, name: str, reaper_tick_s: float = 15
                                ) -> tuple[WorkerContext, str]:
    """A planned job whose shard 0 a run started, then left (its lease lapsed)."""
    spec, _ = small_job(pipeline, name, rows=2)
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    context = WorkerContext(pipeline.settings.model_copy(update={"reaper_interval_s": reaper_tick_s}))
    plan_job(context, job_id, lambda *_: None)
    lease = ShardLease(repository.redis, job_id, 0, ttl_s=0.1, namespace=repository.namespace)
    assert lease.acquire(give_up=lambda: True)
    lease._released.set()  # the run died: its lease lapses
    wait_for(lambda: not repository.redis.exists(lease.key), 5, "the lease to lapse")
    return context, job_id


def test_the_grace_starts_again_after_the_reaper_could_not_look_and_a_run_that_comes_back_keeps_it(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    """An outage stops every reaper: after it, a shard is re-sent only once seen without a live run
    for the whole grace with Redis back, so the runs that outlived the outage take their leases back
    (or commit) first."""
    pipeline, _ = parts
    context, job_id = started_shard_without_a_run(pipeline, "grace.jsonl", reaper_tick_s=0.2)
    sent: list[tuple[str, int, str]] = []

    def reap() -> list[tuple[str, int]]:
        return reap_once(context, lambda *args: sent.append(args), ttl_s=0.5, count_waiting=lambda _q: 0)

    def reap_every_tick(seconds: float) -> list[tuple[str, int]]:
        resent, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            resent += reap()
            time.sleep(0.1)
        return resent

    assert reap_every_tick(0.5) == []  # within the 1 s grace (two lease TTLs)
    time.sleep(1.0)  # no look for longer than three ticks (an outage): the grace starts again
    assert reap_every_tick(0.5) == []
    back = ShardLease(pipeline.repository.redis, job_id, 0, ttl_s=5, namespace=pipeline.repository.namespace)
    assert back.acquire(give_up=lambda: True)  # the run that outlived it holds its lease again
    try:
        assert reap_every_tick(1.2) == []
    finally:
        back.release()
    assert reap_every_tick(0.5) == []  # lease-less again: a new grace
    assert reap_every_tick(1.5) == [(job_id, 0)] and len(sent) == 1


def test_one_resent_copy_at_a_time_and_none_while_a_run_waits_for_its_retry(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    """A copy the reaper sent waits in the broker until a run takes the lease: no second copy joins
    it however long it waits (a busy or faulty hour piled one per shard every two TTLs)."""
    pipeline, _ = parts
    context, job_id = started_shard_without_a_run(pipeline, "one-copy.jsonl")
    repository = pipeline.repository
    sent: list[tuple[str, int, str]] = []
    in_broker = {"bulkinfer.model.tiny": 5}

    def reap() -> list[tuple[str, int]]:
        return reap_once(context, lambda *args: sent.append(args), ttl_s=0.05,
                         count_waiting=lambda queue: in_broker[queue])

    reap()
    time.sleep(0.15)
    assert reap() == [(job_id, 0)]
    for _ in range(4):  # its copy waits behind others: never a second one
        time.sleep(0.15)
        assert reap() == []
    # A run takes the copy, hits a fault and waits 2 s for its retry, without its lease meanwhile.
    lease = ShardLease(repository.redis, job_id, 0, ttl_s=0.05, namespace=repository.namespace)
    assert lease.acquire(give_up=lambda: True)
    lease.release()
    shard_resend.hold_for_retry(repository.redis, repository.namespace, job_id, "shard 0", 2.0, 0.05)
    for _ in range(4):
        time.sleep(0.15)
        assert reap() == []
    # Its worker died: once the retry was due, the grace, then one copy again. The broker empty
    # with that copy never taken (a worker took it and died): one more.
    repository.redis.delete(f"{lease.key}:retry")
    reap()
    time.sleep(0.15)
    assert reap() == [(job_id, 0)]
    in_broker["bulkinfer.model.tiny"] = 0
    reap()
    time.sleep(0.15)
    assert reap() == [(job_id, 0)] and len(sent) == 3


def test_shards_waiting_with_no_ticket_left_in_the_broker_get_their_tickets(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    """A ticket prefetched by a worker that was then killed stays unacknowledged for the broker's
    visibility timeout; its shard, never started, must not wait for it."""
    pipeline, _ = parts
    spec, _ = small_job(pipeline, "lost-tickets.jsonl")
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    context = WorkerContext(pipeline.settings)
    fair = FairQueue(repository.redis, repository.namespace)
    # Offered to the fair queue, every ticket lost.
    plan_job(context, job_id, lambda job, index, queue: fair.offer(queue, job, index, 2, spec.priority, None))
    queue = "bulkinfer.model.tiny"
    assert fair.waiting(queue, job_id) == 3 and broker_ticket_count(queue, pipeline.client) == 0

    def reap() -> dict[str, int]:
        return reap_lost_tickets(context, lambda q: broker_ticket_count(q, pipeline.client),
                                 lambda q: send_ticket(q, pipeline.client), ttl_s=0.05)

    assert reap() == {}  # first seen missing: a planner may be sending them right now
    time.sleep(0.15)
    assert reap() == {queue: 3}
    assert broker_ticket_count(queue, pipeline.client) == 3
    time.sleep(0.15)
    assert reap() == {}  # as many tickets as shards waiting: nothing more


# A dead step is re-sent once the reaper has seen it due for two lease TTLs, ticking every second.
RESEND_BOUND_S = 2 * LEASE_TTL_S + 10


def small_job(pipeline: Pipeline, name: str, rows: int = 6, **fields) -> tuple[JobSpec, list[str]]:  # noqa: ANN003
    ids = [f"r{n}" for n in range(rows)]
    lines = [json.dumps({"id": row_id, "question": f"def {row_id}(x):"}) for row_id in ids]
    spec = JobSpec(input_uri=pipeline.put_input(name, lines), model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": 4}, shard_size=2,
                   **fields)
    return spec, ids


def assert_every_row_once(pipeline: Pipeline, job_id: str, ids: list[str]) -> None:
    status = pipeline.repository.get(job_id)
    assert status.state == JobState.SUCCEEDED, status.error
    assert [record["id"] for record in pipeline.output_records(job_id)] == ids
    assert (status.rows.total, status.rows.succeeded, status.shards.done) == (len(ids), len(ids), 3)


def test_a_job_created_but_never_queued_is_planned_by_the_reaper(
        standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, _, worker = standby
    spec, ids = small_job(pipeline, "orphan.jsonl")
    job_id = pipeline.repository.create(spec).job_id  # the API died before sending plan_job
    consume(pipeline, worker, QUEUES)
    started = time.monotonic()
    pipeline.wait_for_end(job_id, timeout=RESEND_BOUND_S + 60)
    assert_every_row_once(pipeline, job_id, ids)
    assert time.monotonic() - started < RESEND_BOUND_S + 60


def test_a_planner_that_died_before_sending_every_shard_is_run_again(
        standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, _, worker = standby
    spec, ids = small_job(pipeline, "half-sent.jsonl")
    repository = pipeline.repository
    job_id = repository.create(spec).job_id

    def dies_after_the_first_shard(job: str, index: int, queue: str) -> None:
        if index > 0:
            raise SystemExit("killed")  # what kill -9 leaves: running, two shards never sent
        pipeline.client.send_task("bulkinfer.run_shard", args=[job, index], queue=queue)

    with pytest.raises(SystemExit):
        plan_job(WorkerContext(pipeline.settings), job_id, dies_after_the_first_shard)
    assert repository.get(job_id).state == JobState.RUNNING
    consume(pipeline, worker, QUEUES)
    pipeline.wait_for_end(job_id, timeout=RESEND_BOUND_S + 60)
    assert_every_row_once(pipeline, job_id, ids)


def test_a_finalizer_that_died_is_run_again(standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, _, worker = standby
    spec, ids = small_job(pipeline, "unfinished.jsonl")
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    # The worker on the model queue only runs the shards; the finalize they send waits on the control queue.
    consume(pipeline, worker, "bulkinfer.model.tiny")
    plan_job(WorkerContext(pipeline.settings), job_id,
             lambda job, index, queue: pipeline.client.send_task("bulkinfer.run_shard", args=[job, index],
                                                                 queue=queue))
    wait_for(lambda: repository.get(job_id).shards.done == 3, 120, "every shard to be counted")
    # The finalizer took the message, moved the job to finalizing and was killed: the message is gone.
    repository.redis.delete("bulkinfer.control")
    repository.transition(job_id, JobState.FINALIZING)
    consume(pipeline, worker, "bulkinfer.control")
    pipeline.wait_for_end(job_id, timeout=RESEND_BOUND_S + 60)
    assert_every_row_once(pipeline, job_id, ids)


def test_a_shard_that_fails_the_same_way_every_time_fails_the_job_with_the_reason(
        standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, _, worker = standby
    # Outputs go to a bucket that does not exist: every attempt at writing shard parts fails alike.
    spec, _ = small_job(pipeline, "nowhere.jsonl", output_uri="s3://no-such-bucket/out/")
    consume(pipeline, worker, QUEUES)
    job_id = pipeline.submit(spec)
    status = pipeline.wait_for_end(job_id, timeout=120)
    assert status.state == JobState.FAILED
    assert status.error is not None and f"failed {MAX_ATTEMPTS} time(s); last error:" in status.error
    assert status.error.startswith("shard ") and "NoSuchBucket" in status.error


def test_a_job_completes_every_row_once_through_a_flaky_s3(
        standby: tuple[Pipeline, dict[str, str], Standby]) -> None:
    pipeline, _, worker = standby
    spec, ids = small_job(pipeline, "flaky.jsonl", rows=12)
    spec = spec.model_copy(update={"shard_size": 3})
    plan = worker.s3_faults  # every 4th request the worker makes: these faults in turn
    assert not plan.injected, "the faults were on before this test"
    consume(pipeline, worker, QUEUES)
    plan.enabled = True
    try:
        job_id = pipeline.submit(spec)
        status = pipeline.wait_for_end(job_id, timeout=180)
    finally:
        plan.enabled = False
    assert status.state == JobState.SUCCEEDED, status.error
    assert [record["id"] for record in pipeline.output_records(job_id)] == ids
    assert (status.rows.total, status.rows.succeeded, status.shards.done) == (12, 12, 4)
    assert sum(plan.injected.values()) >= 8 and len(plan.injected) == 4


def test_a_job_past_the_shard_or_row_limit_fails_at_planning_naming_it(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    pipeline, _ = parts
    spec, _ = small_job(pipeline, "limits.jsonl")  # 6 rows in shards of 2: 3 shards
    for limit, phrase in [({"max_shards_per_job": 2}, "plans into 3 shards of 2 rows"),
                          ({"max_rows_per_job": 5}, "6 rows; this deployment takes at most 5")]:
        context = WorkerContext(pipeline.settings.model_copy(update=limit))
        distinct = spec.model_copy(update={"metadata": {"limit": phrase[:20]}})
        job_id = pipeline.repository.create(distinct).job_id
        summary = plan_job(context, job_id, lambda *_: None)
        status = pipeline.repository.get(job_id)
        assert summary["status"] == "failed" and status.state == JobState.FAILED
        assert status.error is not None and phrase in status.error and next(iter(limit)) in status.error


def test_a_shard_committed_but_not_counted_before_its_worker_died_is_counted_and_finalized(
        parts: tuple[Pipeline, dict[str, str]]) -> None:
    from datetime import UTC, datetime

    from bulkinfer.jobs.state.results import PartFile, ShardResult, save_shard_result

    pipeline, _ = parts
    spec, _ = small_job(pipeline, "uncounted.jsonl", rows=2)  # one shard
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    context = WorkerContext(pipeline.settings)
    plan_job(context, job_id, lambda *_: None)
    [shard] = repository.load_plan(job_id)
    # The run took the lease, committed the shard's result, and was killed before counting it.
    repository.redis.sadd(started_key(repository.namespace, job_id), 0)
    part = PartFile(key="k", uri="s3://b/k", rows=0, bytes=0, sha256="0" * 64)
    now = datetime.now(UTC)
    result = ShardResult.from_outputs(shard, [], output=part, errors=part, started_at=now, finished_at=now)
    save_shard_result(repository.store, repository.layout(job_id), result)
    assert repository.get(job_id).shards.done == 0
    finalized: list[str] = []
    assert reap_once(context, lambda *_: None, ttl_s=30, send_finalize=finalized.append) == []
    assert repository.get(job_id).shards.done == 1 and finalized == [job_id]
    reap_once(context, lambda *_: None, ttl_s=30, send_finalize=finalized.append)
    assert finalized == [job_id]  # counted once
