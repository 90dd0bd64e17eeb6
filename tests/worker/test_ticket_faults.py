"""A Redis fault while a ticket takes its shard from the fair queue: the ticket is retried with
backoff (not counted as an attempt) and its shard runs once Redis answers; the ticket is never lost
to the reaper's lost-ticket pass, two lease TTLs later. Real Redis faults: a Redis busy running a
script (BUSY), and a Redis nobody answers at."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from bulkinfer.jobs.fair_queue import FairQueue
from bulkinfer.jobs.names import shards_started_key
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.process import tasks
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards import shard_runner
from bulkinfer.worker.transient import retry_delay_s
from tests.fixtures.services import free_port, wait_until
from tests.worker.test_transient import RecordingTask

QUEUE = "bulkinfer.model.tiny"


@pytest.fixture
def context(redis_url: str, tmp_path: Path) -> WorkerContext:
    return WorkerContext(Settings(broker_url=redis_url, store_uri=str(tmp_path / "store")))


@pytest.fixture
def shard_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The shards the tickets ran (the runner itself is tested elsewhere: here, what a ticket takes)."""
    runs: list[tuple[str, int]] = []

    def record(_context: WorkerContext, job_id: str, shard_index: int, _send_finalize: object) -> dict:
        runs.append((job_id, shard_index))
        return {"job_id": job_id, "shard_index": shard_index, "status": "done"}

    monkeypatch.setattr(shard_runner, "run_shard", record)
    return runs


def run_ticket(task: RecordingTask, context: WorkerContext, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The ticket task's body as a worker runs it, with `task` for its request and retries."""
    monkeypatch.setattr(tasks, "worker_context", lambda: context)
    return tasks.run_next_shard.run.__func__(task, QUEUE)


@contextmanager
def redis_busy(url: str) -> Iterator[None]:
    """A script that loops past Redis's script time limit: every other client's command is refused
    with BUSY until SCRIPT KILL ends it."""
    client = redis.Redis.from_url(url)
    limit = client.config_get("lua-time-limit")["lua-time-limit"]
    client.config_set("lua-time-limit", 10)

    def loop() -> None:
        try:
            redis.Redis.from_url(url).eval("while true do end", 0)
        except redis.ResponseError:
            pass  # killed

    looping = threading.Thread(target=loop, daemon=True)
    looping.start()

    def refused_busy() -> bool:
        try:
            client.ping()
        except redis.ResponseError as error:
            return str(error).startswith("BUSY")
        return False

    try:
        wait_until(refused_busy, timeout=10, what="Redis to answer BUSY")
        yield
    finally:
        wait_until(lambda: client.script_kill(), timeout=10, what="SCRIPT KILL")
        looping.join(timeout=10)
        client.config_set("lua-time-limit", limit)


def started(context: WorkerContext, job_id: str) -> set[int]:
    repository = context.repository
    members = repository.redis.smembers(shards_started_key(repository.namespace, job_id))
    return {int(index) for index in members}


def test_a_ticket_that_finds_redis_busy_is_retried_and_runs_its_shard_when_redis_answers(
        context: WorkerContext, shard_runs: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    fair = FairQueue(context.repository.redis, context.repository.namespace)
    fair.offer(QUEUE, "job-a", 0, cost=10, priority=5, tenant="acme")
    with redis_busy(context.settings.broker_url):
        for retries in (0, 2, 30):  # never counted: a fault of any length is waited out
            task = RecordingTask(retries)
            with pytest.raises(RuntimeError, match="retry scheduled"):
                run_ticket(task, context, monkeypatch)
            assert task.retried["countdown"] == retry_delay_s(retries)
            assert task.retried["max_retries"] is None
            assert task.retried["kwargs"] == {}  # a ticket again: it takes the fairest shard then
    assert shard_runs == [] and fair.waiting(QUEUE, "job-a") == 1 and started(context, "job-a") == set()
    summary = run_ticket(RecordingTask(31), context, monkeypatch)  # the retry, Redis answering
    assert summary["status"] == "done" and shard_runs == [("job-a", 0)]
    assert fair.waiting(QUEUE, "job-a") == 0 and started(context, "job-a") == {0}  # taken and marked started


def test_a_ticket_that_cannot_reach_redis_is_retried_and_runs_its_shard_when_redis_answers(
        context: WorkerContext, shard_runs: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    fair = FairQueue(context.repository.redis, context.repository.namespace)
    fair.offer(QUEUE, "job-b", 3, cost=10, priority=5, tenant="acme")
    unreachable = WorkerContext(Settings(broker_url=f"redis://127.0.0.1:{free_port()}/0",
                                         store_uri=str(tmp_path / "store")))
    task = RecordingTask(retries=4)
    with pytest.raises(RuntimeError, match="retry scheduled"):
        run_ticket(task, unreachable, monkeypatch)
    assert task.retried["countdown"] == retry_delay_s(4) and task.retried["max_retries"] is None
    assert isinstance(task.retried["exc"], redis.ConnectionError)
    assert shard_runs == [] and fair.waiting(QUEUE, "job-b") == 1
    assert run_ticket(RecordingTask(5), context, monkeypatch)["status"] == "done"
    assert shard_runs == [("job-b", 3)] and started(context, "job-b") == {3}
