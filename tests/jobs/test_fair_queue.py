"""The fair queue's order against a real Redis: priority first, then tenants' shares by rows, then one
tenant's jobs; newcomers start level with those waiting; nothing is offered twice."""

from __future__ import annotations

import redis

from jobs.fair_queue import FairQueue


def _drain(queue: FairQueue, model: str = "m") -> list[tuple[str, int]]:
    taken = []
    while (shard := queue.take(model)) is not None:
        taken.append((shard.job_id, shard.shard_index))
    return taken


def _queue(redis_url: str) -> FairQueue:
    return FairQueue(redis.Redis.from_url(redis_url), "test")


def test_a_small_job_behind_a_big_one_gets_the_next_free_worker(redis_url: str) -> None:
    queue = _queue(redis_url)
    for index in range(100):
        queue.offer("m", "big", index, rows=1000, priority=5, tenant="acme")
    assert [queue.take("m").job_id for _ in range(3)] == ["big"] * 3
    queue.offer("m", "small", 0, rows=100, priority=5, tenant="acme")  # same tenant, a second job
    assert queue.take("m").job_id == "small"  # it starts level with `big`, which has been given 3000 rows
    assert {queue.take("m").job_id for _ in range(5)} == {"big"}


def test_tenants_share_by_rows_and_priority_goes_first(redis_url: str) -> None:
    queue = _queue(redis_url)
    for index in range(4):
        queue.offer("m", "a-job", index, rows=10, priority=5, tenant="a")
    for index in range(2):
        queue.offer("m", "b-job", index, rows=20, priority=5, tenant="b")  # shards twice as big
    queue.offer("m", "urgent", 0, rows=10, priority=8, tenant="c")
    queue.offer("m", "later", 0, rows=10, priority=1, tenant="a")
    order = _drain(queue)
    assert order[0] == ("urgent", 0)
    assert order[-1] == ("later", 0)
    middle = [job for job, _ in order[1:-1]]
    # a gets 10 rows a take and b 20: two of a's shards to one of b's, each in input order.
    assert middle in (["a-job", "b-job", "a-job", "a-job", "b-job", "a-job"],
                      ["b-job", "a-job", "a-job", "b-job", "a-job", "a-job"])
    assert [index for job, index in order if job == "a-job"] == [0, 1, 2, 3]


def test_offers_are_idempotent_and_a_dropped_job_yields_nothing(redis_url: str) -> None:
    queue = _queue(redis_url)
    assert queue.offer("m", "j", 0, rows=5, priority=5, tenant=None)
    assert not queue.offer("m", "j", 0, rows=5, priority=5, tenant=None)  # a planner that ran twice
    queue.offer("m", "j", 1, rows=5, priority=5, tenant=None)
    queue.offer("other-model", "k", 0, rows=5, priority=5, tenant=None)
    assert queue.waiting("m", "j") == 2
    queue.drop("m", "j")
    assert _drain(queue) == []
    assert _drain(queue, "other-model") == [("k", 0)]


def test_a_taken_shard_is_marked_started_for_the_reaper(redis_url: str) -> None:
    from jobs.names import shards_started_key

    queue = _queue(redis_url)
    queue.offer("m", "job-1", 3, rows=5, priority=5, tenant=None)
    assert queue.take("m").shard_index == 3
    assert queue.client.smembers(shards_started_key("test", "job-1")) == {b"3"}
