"""Leases: at most one live run of a job's step (a shard, its plan, its finalize) at a time.

A run holds a Redis key (`SET NX PX`) that a background thread keeps extending while the run
lives. A second delivery of the step waits for the key to go, then finds the first run's work
done (the shard result, the plan, the manifest). If the holder's process dies, nothing extends the
key, it expires after `ttl_s`, and the waiting (or re-sent) run takes over; the reaper
(`worker/shards/shard_reaper.py`) re-sends steps whose lease lapsed with the work undone.

Taking a `ShardLease` also adds the shard's index to the job's set of started shards, so the
reaper can tell a shard whose worker died from one still queued, and numbers the take (the
lease's generation): with the run's token it is the run's fencing token (`fence`), under which the
run stages its parts (jobs/state/part_publication.py), so a run that lost its lease overwrites nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType

import redis

from bulkinfer.jobs.names import shard_lease_key, shards_started_key
from bulkinfer.jobs.settings import DEFAULT_SHARD_LEASE_TTL_S

# KEYS: lease key. ARGV: token, ttl ms. Extends the lease if this run still holds it, takes it back
# if nobody does (Redis restarted without its data, or this run stalled and nobody took over);
# 0 only when another run holds it.
EXTEND_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""
# KEYS: lease key, the job's started set, the shard's generation counter. ARGV: token, TTL ms, shard
# index, the started set's TTL s. Takes the lease and records the shard as started in one step (a
# run killed between the two would leave a shard taken but not started: the reaper, which only
# re-sends started shards, would never see it), returning the new generation, or 0 if held.
TAKE_SHARD_SCRIPT = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
local generation = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[4])
return generation
"""
# KEYS: lease key. ARGV: token. Deletes the lease only if this run holds it.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


DEFAULT_LEASE_TTL_S = DEFAULT_SHARD_LEASE_TTL_S  # callers pass `settings.lease_ttl`
STARTED_TTL_S = 7 * 24 * 3600  # a week: longer than any job runs


class Lease:
    def __init__(self, client: redis.Redis, key: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = uuid.uuid4().hex
        self._extend = client.register_script(EXTEND_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._released = threading.Event()
        self._lost = threading.Event()
        self._keeper: threading.Thread | None = None

    def acquire(self, give_up: Callable[[], bool], poll_s: float = 0.5) -> bool:
        """Wait until this run holds the lease (True), or until `give_up()` says stop (False)."""
        while not self._take():
            if give_up():
                return False
            time.sleep(poll_s)  # the holder is alive: ask again shortly
        self._keeper = threading.Thread(target=self._keep, name=f"lease-{self.key}", daemon=True)
        self._keeper.start()
        return True

    def _take(self) -> bool:
        """One attempt to take the lease (a kind of lease may record more in the same step)."""
        return bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def _keep(self) -> None:
        # Extend three times per TTL, so a slow Redis round trip never lets a live run's lease lapse.
        extended_at = time.monotonic()
        while not self._released.wait(self.ttl_ms / 3000):
            try:
                extended = self._extend(keys=[self.key], args=[self.token, self.ttl_ms])
            except redis.RedisError:
                # Redis unreachable (or out of memory): past the TTL another run may hold the key, so
                # the lease counts as lapsed; keep asking, to take it back when Redis answers again.
                if time.monotonic() - extended_at >= self.ttl_ms / 1000:
                    self._lost.set()
                continue
            if not extended:
                self._lost.set()  # expired while this process stalled: the run that holds it now wins
                return
            # Extended, or taken back after an outage in which nobody else took it: held again, so
            # the reaper sees a live run instead of re-sending the shard.
            self._lost.clear()
            extended_at = time.monotonic()

    @property
    def held(self) -> bool:
        """False while the lease lapsed under this run (another run may hold it, or take it)."""
        return self._keeper is not None and not self._lost.is_set()

    def release(self) -> None:
        self._released.set()
        if self._keeper is not None:
            self._keeper.join()
            try:
                self._release(keys=[self.key], args=[self.token])
            except redis.RedisError:  # it expires by itself within its TTL
                pass

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


class ShardLease(Lease):
    def __init__(self, client: redis.Redis, job_id: str, shard_index: int, *,
                 ttl_s: float = DEFAULT_LEASE_TTL_S, namespace: str = "bulkinfer") -> None:
        super().__init__(client, shard_lease_key(namespace, job_id, shard_index), ttl_s=ttl_s)
        self.started_key = shards_started_key(namespace, job_id)
        self.shard_index = shard_index
        self._take_shard = client.register_script(TAKE_SHARD_SCRIPT)

    generation = 0  # how many times the shard's lease was taken, this take included

    @property
    def fence(self) -> str:
        """This run's fencing token: the generation orders runs; the token keeps two runs apart
        even when Redis lost its data and counts generations afresh."""
        return f"g{self.generation}-{self.token[:8]}"

    def _take(self) -> bool:
        generation = self._take_shard(keys=[self.key, self.started_key, f"{self.key}:generation"],
                                      args=[self.token, self.ttl_ms, self.shard_index, STARTED_TTL_S])
        if not generation:
            return False
        self.generation = int(generation)
        return True
