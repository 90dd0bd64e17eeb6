"""When the reaper may re-send a shard that has no live run: after a grace, and one copy at a time.

A shard that is started, has no result and no live lease may have lost its worker, or may only
look so: its run is waiting out a fault before a retry (its lease released meanwhile), or Redis was
unreachable for longer than the lease TTL and its run, still alive, has not taken its lease back
yet. Re-sending at first sight would pile up copies (one per shard every two TTLs for as long as
an outage lasts), each of which retries on its own. So:

- a shard waiting for a retry of its run (`mark_retrying`, set by the task for the retry's delay
  plus a grace) is not due;
- a shard is due once the reaper has seen it without a live run on every look for `grace_s`
  (`due_for`): the "first seen" mark lapses when the reaper does not look for `gap_s` (an outage
  stops every reaper), so after an outage the grace starts again with Redis back, and the runs
  that survived it take their leases back or commit first;
- one outstanding re-send per shard: the lease's generation is recorded at a re-send, and while
  no run has taken the lease since (the generation has not moved) the copy sent is still waiting
  in the broker, and no other is sent; only when the shard's queue holds no message at all (the
  copy was taken by a worker that died before starting it) may it be sent again.
"""

from __future__ import annotations

import time

import redis

from bulkinfer.jobs.names import shard_lease_key, shard_resent_key

OUTSTANDING_TTL_S = 7 * 24 * 3600  # as long as the job's started set


def _due_key(namespace: str, job_id: str, index: int) -> str:
    return f"{shard_resent_key(namespace, job_id, index)}:due"


def _retry_key(namespace: str, job_id: str, index: int) -> str:
    return f"{shard_lease_key(namespace, job_id, index)}:retry"


def _generation(client: redis.Redis, namespace: str, job_id: str, index: int) -> int:
    return int(client.get(f"{shard_lease_key(namespace, job_id, index)}:generation") or 0)


def mark_retrying(client: redis.Redis, namespace: str, job_id: str, index: int, hold_s: float) -> None:
    """The shard's run hit a fault and retries within `hold_s`: the reaper leaves it alone until then."""
    client.set(_retry_key(namespace, job_id, index), 1, px=max(1, int(hold_s * 1000)))


def seen_alive(client: redis.Redis, namespace: str, job_id: str, indexes: list[int]) -> None:
    """The shards have a live run: their grace starts afresh the next time they have none."""
    if indexes:
        client.delete(*(_due_key(namespace, job_id, index) for index in indexes))


def may_resend(client: redis.Redis, namespace: str, job_id: str, index: int, *, grace_s: float,
               gap_s: float, queue_is_empty: bool) -> bool:
    """One look at a started shard without result or live lease: True when it is to be re-sent now
    (then call `resent`)."""
    if client.exists(_retry_key(namespace, job_id, index)):
        seen_alive(client, namespace, job_id, [index])
        return False
    outstanding = client.get(shard_resent_key(namespace, job_id, index))
    if outstanding is not None and int(outstanding) == _generation(client, namespace, job_id, index) \
            and not queue_is_empty:
        return False  # the copy sent last is still waiting for a worker
    return due_for(client, _due_key(namespace, job_id, index), grace_s, gap_s)


def resent(client: redis.Redis, namespace: str, job_id: str, index: int) -> None:
    """Record the re-send: outstanding until a run takes the lease."""
    generation = _generation(client, namespace, job_id, index)
    with client.pipeline(transaction=True) as pipe:
        pipe.set(shard_resent_key(namespace, job_id, index), generation, ex=OUTSTANDING_TTL_S)
        pipe.delete(_due_key(namespace, job_id, index))
        pipe.execute()


def due_for(client: redis.Redis, key: str, grace_s: float, gap_s: float) -> bool:
    """True once seen due on every look for `grace_s`, where looks at most `gap_s` apart count as
    "every look" (the mark lapses otherwise)."""
    now = time.time()
    gap_ms = max(1, int(gap_s * 1000))
    if client.set(key, now, nx=True, px=gap_ms):
        return False  # first seen now
    first = float(client.get(key) or now)
    client.pexpire(key, gap_ms)
    return now - first >= grace_s


def hold_for_retry(client: redis.Redis, namespace: str, job_id: str, step: str, delay_s: float,
                   ttl_s: float) -> None:
    """A step ("shard 3") retries after `delay_s`: keep the reaper off it until its retry had time to
    take the lease. Best effort: with Redis unreachable no reaper runs either."""
    kind, _, index = step.partition(" ")
    if kind != "shard" or not index.isdigit():
        return
    try:
        mark_retrying(client, namespace, job_id, int(index), delay_s + 2 * ttl_s)
    except redis.RedisError:
        pass
