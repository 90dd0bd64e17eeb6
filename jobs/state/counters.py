"""Live job counters in Redis: rows, shards and tokens, each shard counted at most once.

A Lua script adds a shard's numbers and records its index in one atomic step, so a shard
reported twice (a task delivered again after a worker died) changes nothing the second time.
Redis is not the truth: `rebuild_from_store` recomputes everything from the shard results (or
the manifest) in the object store. Rows of shards still running are kept apart
(jobs/state/live_progress.py): counting a shard drops them in the same step, and `read(live=True)`
adds those of the shards not counted yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from pydantic import BaseModel

from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.names import counted_shards_key, counts_key, live_progress_key
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.state.live_progress import LiveFigures, in_flight
from bulkinfer.jobs.state.manifest import Manifest
from bulkinfer.jobs.state.results import ShardResult, TokenUsage, load_shard_results
from bulkinfer.jobs.state.status import RowCounts, ShardCounts
from bulkinfer.jobs.state.usage import UsageEntry

# KEYS: counts hash, counted-shards set, live-progress hash, and with usage: its bucket hash and the
# usage index set.
# ARGV: shard index, the number of counter pairs, the counter field/increment pairs, then with usage:
# its field/increment pairs, the bucket's TTL in seconds and the index member.
# Returns 1 if applied, 0 if the shard was already counted, -1 if the counters do not exist.
# Counting and usage are one step: a worker dying between two calls would count the shard (so no
# later delivery adds it again) and lose its usage. The shard's live figures (its rows before it
# committed) go in the same step, so a reader never sees its rows both live and counted, or neither.
# (The usage keys are not in the job's hash slot: on a Redis Cluster this script would need them
# tagged alike.)
APPLY_SHARD_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
local counter_end = 2 + 2 * tonumber(ARGV[2])
for i = 3, counter_end, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
if #KEYS == 5 then
  for i = counter_end + 1, #ARGV - 2, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
  redis.call('EXPIRE', KEYS[4], ARGV[#ARGV - 1])
  redis.call('SADD', KEYS[5], ARGV[#ARGV])
end
return 1
"""
# KEYS: counts hash. ARGV: field/value pairs. Sets them only if the job has no counters yet.
INITIALIZE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
FIELDS = ("rows_total", "rows_succeeded", "rows_failed", "rows_deduplicated", "shards_total", "shards_done",
          "tokens_prompt", "tokens_cached", "tokens_completion", "engine_ms")


def engine_ms(usage: TokenUsage) -> int:
    """Engine seconds as the integer milliseconds the counters add up (HINCRBY takes integers)."""
    return round(usage.engine_seconds * 1000)


class CountersMissing(RuntimeError):
    """Redis has no counters for the job (never initialized, or lost): rebuild them."""


class CounterSnapshot(BaseModel):
    rows: RowCounts
    shards: ShardCounts
    usage: TokenUsage

    @classmethod
    def from_results(cls, plan: Sequence[ShardPlan], results: Sequence[ShardResult]) -> CounterSnapshot:
        """Shards not done yet count their planned rows toward the total."""
        done = {result.shard_index: result for result in results}
        total = sum(done[shard.index].rows if shard.index in done else shard.estimated_rows for shard in plan)
        usage = sum((result.usage for result in done.values()), TokenUsage())
        return cls(rows=RowCounts(total=total, succeeded=sum(r.rows_succeeded for r in done.values()),
                                  failed=sum(r.rows_failed for r in done.values()),
                                  deduplicated=sum(r.rows_deduplicated for r in done.values())),
                   shards=ShardCounts(done=len(done), total=len(plan)), usage=usage)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> CounterSnapshot:
        shard_count = len(manifest.parts)
        return cls(rows=manifest.rows, shards=ShardCounts(done=shard_count, total=shard_count),
                   usage=manifest.usage)

    def as_fields(self) -> dict[str, int]:
        return {"rows_total": self.rows.total, "rows_succeeded": self.rows.succeeded,
                "rows_failed": self.rows.failed, "rows_deduplicated": self.rows.deduplicated,
                "shards_total": self.shards.total,
                "shards_done": self.shards.done,
                "tokens_prompt": self.usage.prompt, "tokens_cached": self.usage.cached,
                "tokens_completion": self.usage.completion, "engine_ms": engine_ms(self.usage)}


class JobCounters:
    def __init__(self, client: redis.Redis, job_id: str, namespace: str = "bulkinfer") -> None:
        self.client = client
        # The {job_id} hash tag keeps both keys in one Redis Cluster slot, as Lua requires.
        self.counts_key = counts_key(namespace, job_id)
        self.counted_key = counted_shards_key(namespace, job_id)
        self.live_key = live_progress_key(namespace, job_id)
        self._apply = client.register_script(APPLY_SHARD_SCRIPT)
        self._initialize = client.register_script(INITIALIZE_SCRIPT)

    def initialize(self, plan: Sequence[ShardPlan]) -> bool:
        """Start counting a planned job; a second call (a retried submit) changes nothing."""
        arguments: list[str | int] = []
        for name, value in CounterSnapshot.from_results(plan, []).as_fields().items():
            arguments += [name, value]
        return bool(self._initialize(keys=[self.counts_key], args=arguments))

    def apply_shard(self, result: ShardResult, usage: UsageEntry | None = None) -> bool:
        """Add a finished shard's counts, and `usage` to its tenant's and model's bucket in the same
        atomic step; False (and nothing added) if this shard was counted before.

        Raises `CountersMissing` if Redis has no counters for the job (rebuild, then retry).
        """
        increments = {
            "rows_total": result.rows - result.planned_rows,  # the estimate becomes the real count
            "rows_succeeded": result.rows_succeeded, "rows_failed": result.rows_failed,
            "rows_deduplicated": result.rows_deduplicated, "shards_done": 1,
            "tokens_prompt": result.usage.prompt, "tokens_cached": result.usage.cached,
            "tokens_completion": result.usage.completion, "engine_ms": engine_ms(result.usage),
        }
        arguments: list[str | int] = [result.shard_index, len(increments)]
        for name, value in increments.items():
            arguments += [name, value]
        keys = [self.counts_key, self.counted_key, self.live_key]
        if usage is not None:
            keys += [usage.bucket_key, usage.index_key]
            for name, value in usage.increments.items():
                arguments += [name, value]
            arguments += [usage.ttl_s, usage.index_member]
        applied = int(self._apply(keys=keys, args=arguments))
        if applied < 0:
            raise CountersMissing(f"no counters at {self.counts_key}")
        return applied == 1

    def read(self, live: bool = False) -> CounterSnapshot:
        """The counted shards' counts; with `live`, plus the rows the shards not counted yet have
        finished (read with the counters in one MULTI, so no row shows twice or not at all while a
        shard commits). Raises `CountersMissing` when Redis has none."""
        if not live:
            raw = self.client.hgetall(self.counts_key)
            running = LiveFigures()
        else:
            with self.client.pipeline(transaction=True) as pipeline:
                pipeline.hgetall(self.counts_key)
                pipeline.hgetall(self.live_key)
                pipeline.smembers(self.counted_key)
                raw, live_fields, counted = pipeline.execute()
            running = in_flight(live_fields, counted)
        if not raw:
            raise CountersMissing(f"no counters at {self.counts_key}")
        values = {key.decode() if isinstance(key, bytes) else key: int(value) for key, value in raw.items()}
        values = {name: values.get(name, 0) for name in FIELDS}
        return CounterSnapshot(
            rows=RowCounts(total=values["rows_total"], succeeded=values["rows_succeeded"] + running.succeeded,
                           failed=values["rows_failed"] + running.failed,
                           deduplicated=values["rows_deduplicated"] + running.deduplicated),
            shards=ShardCounts(done=values["shards_done"], total=values["shards_total"]),
            usage=TokenUsage(prompt=values["tokens_prompt"] + running.prompt,
                             cached=values["tokens_cached"] + running.cached,
                             completion=values["tokens_completion"] + running.completion,
                             engine_seconds=(values["engine_ms"] + running.engine_ms) / 1000))

    def replace(self, snapshot: CounterSnapshot, counted_shards: Sequence[int]) -> None:
        """Set the counters and the counted-shard set together, atomically (MULTI/EXEC)."""
        with self.client.pipeline(transaction=True) as pipeline:
            pipeline.delete(self.counts_key, self.counted_key)
            fields: dict[Any, int] = snapshot.as_fields()  # redis' stubs take only an Any-keyed dict
            pipeline.hset(self.counts_key, mapping=fields)
            if counted_shards:
                pipeline.sadd(self.counted_key, *counted_shards)
            pipeline.execute()

    def rebuild_from_store(self, store: ObjectStore, layout: JobLayout,
                           plan: Sequence[ShardPlan]) -> CounterSnapshot:
        """Recompute the counters from the manifest if the job has one, else from shard results.

        Safe while workers run: workers save a shard's result before applying it, so a shard that
        applied while we rebuilt has its result in the store, and the second pass below (a no-op
        for shards already counted) puts it back.
        """
        try:
            manifest = Manifest.model_validate_json(store.get_bytes(layout.manifest_key))
        except ObjectNotFound:
            results = load_shard_results(store, layout)
            snapshot = CounterSnapshot.from_results(plan, results)
            counted = [result.shard_index for result in results]
        else:
            counted = [part.shard_index for part in manifest.parts]
            self.replace(CounterSnapshot.from_manifest(manifest), counted)
            return self.read()
        self.replace(snapshot, counted)
        for result in load_shard_results(store, layout):
            self.apply_shard(result)
        return self.read()

    def delete(self) -> None:
        self.client.delete(self.counts_key, self.counted_key, self.live_key)
