"""ShardLease on a real Redis: one holder at a time, kept while held, lapsing when the holder dies."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import redis

from bulkinfer.worker.shards.shard_lease import ShardLease
from tests.worker.test_redis_loss import RestartableRedis


def never() -> bool:
    return False


def test_a_second_run_waits_until_the_first_releases(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    first = ShardLease(client, "job-a", 0, ttl_s=0.3)
    assert first.acquire(never)
    second = ShardLease(client, "job-a", 0, ttl_s=0.3)
    acquired = threading.Event()
    waiter = threading.Thread(target=lambda: second.acquire(never) and acquired.set())
    waiter.start()
    # Held well past its TTL: the keeper extends it, so the second run keeps waiting.
    assert not acquired.wait(1.0)
    first.release()
    assert acquired.wait(5)
    waiter.join()
    second.release()
    assert client.exists(first.key) == 0
    assert ShardLease(client, "job-a", 1).acquire(never)  # another shard is another lease


def test_a_lease_whose_holder_died_lapses_after_its_ttl(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    dead = ShardLease(client, "job-b", 0, ttl_s=0.3)
    assert dead.acquire(never)
    dead._released.set()  # the process stalls or dies: nothing extends the key any more
    started = time.monotonic()
    assert ShardLease(client, "job-b", 0, ttl_s=0.3).acquire(never, poll_s=0.05)
    assert 0.1 < time.monotonic() - started < 2
    dead.release()  # a late release must not delete the new holder's lease
    assert client.exists(dead.key) == 1


def test_waiting_stops_when_told_to_give_up(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    holder = ShardLease(client, "job-c", 0)
    assert holder.acquire(never)
    asked = []
    assert not ShardLease(client, "job-c", 0).acquire(lambda: asked.append(1) or len(asked) >= 2, poll_s=0.01)
    holder.release()


def test_a_run_knows_when_another_run_took_its_lapsed_lease(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    lease = ShardLease(client, "job-d", 0, ttl_s=0.3)
    assert not lease.held
    assert lease.acquire(never)
    assert lease.held
    client.set(lease.key, "another-run")  # it lapsed while this process stalled, and a rerun took it
    deadline = time.monotonic() + 5
    while lease.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not lease.held
    lease.release()
    assert client.get(lease.key) == b"another-run"  # releasing never drops another run's lease


def test_a_lease_that_vanished_with_nobody_holding_it_is_taken_back(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    lease = ShardLease(client, "job-e", 0, ttl_s=0.3)
    assert lease.acquire(never)
    client.delete(lease.key)  # Redis restarted without its data
    deadline = time.monotonic() + 5
    while client.get(lease.key) != lease.token.encode() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lease.held and client.get(lease.key) == lease.token.encode()
    lease.release()
    assert not client.exists(lease.key)


def test_each_take_of_a_shard_lease_gets_a_newer_fencing_token(redis_url: str) -> None:
    """The generation orders the runs of one shard; the token part keeps them apart when Redis lost
    its data and counts generations afresh (their parts are staged under the fence)."""
    client = redis.Redis.from_url(redis_url)
    fences = []
    for _ in range(3):
        lease = ShardLease(client, "job-f", 0, ttl_s=0.3)
        assert lease.acquire(never)
        fences.append((lease.generation, lease.fence))
        lease.release()
    assert [generation for generation, _ in fences] == [1, 2, 3]
    assert [fence.split("-")[0] for _, fence in fences] == ["g1", "g2", "g3"]
    client.delete(f"{lease.key}:generation")  # Redis lost its data: generations restart, fences differ
    again = ShardLease(client, "job-f", 0, ttl_s=0.3)
    assert again.acquire(never) and again.generation == 1 and again.fence != fences[0][1]
    again.release()
    other = ShardLease(client, "job-f", 1, ttl_s=0.3)  # another shard counts on its own
    assert other.acquire(never) and other.generation == 1
    other.release()


def test_a_lease_that_lapsed_in_a_redis_outage_is_taken_back_when_redis_answers_again(tmp_path: Path) -> None:
    """Redis unreachable past the TTL: the run no longer counts on its lease; when Redis answers and
    nobody took it meanwhile, the run holds it again (so the reaper sees a live run, not a dead one)."""
    server = RestartableRedis(tmp_path)
    client = redis.Redis.from_url(server.url, socket_timeout=0.2, socket_connect_timeout=0.2)
    lease = ShardLease(client, "job-g", 0, ttl_s=0.3)
    try:
        assert lease.acquire(never)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            while lease.held and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not lease.held
            time.sleep(0.5)  # the key expires meanwhile
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while not lease.held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.held and client.get(lease.key) == lease.token.encode()
        lease.release()
        assert not client.exists(lease.key)
    finally:
        server.stop()
