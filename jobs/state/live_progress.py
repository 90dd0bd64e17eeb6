"""Rows a running shard has finished, before it commits: what `GET /jobs`, the batch APIs' counts
and usage show while a shard runs.

One Redis hash per job, one field per running shard holding that run's *absolute* figures (never
increments), tagged with its lease generation. So a shard that runs again (a crash, a hand-back, a
redelivery) replaces its figures instead of adding to them, and nothing is counted twice:

- a run writes at most once per interval (worker/shards/shard_progress.py), never a write per row;
- a write is refused once the shard is counted (its committed figures are in the counters) and
  when a newer run (a higher generation) holds the field, so a stale run cannot bring its figures back;
- counting the shard (`JobCounters.apply_shard`) drops its field in the same Lua step that adds
  its committed figures, and a reader adds only the fields of shards not counted yet, in one
  MULTI with the counters: committed + in flight, each row once.

Live figures are a view, never the truth: the committed counters (rebuilt from the store) are;
a job that has ended shows only those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from bulkinfer.jobs.names import counted_shards_key, live_progress_key

# KEYS: the live hash, the counted-shards set. ARGV: shard index, generation, encoded figures.
# Returns 1 if written, 0 if refused (the shard is counted, or a newer run holds its field).
WRITE_SCRIPT = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 0 end
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current and tonumber(string.match(current, '^%d+')) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
# KEYS: the live hash. ARGV: shard index, generation. Drops the field only if that run wrote it.
CLEAR_SCRIPT = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current and tonumber(string.match(current, '^%d+')) == tonumber(ARGV[2]) then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


@dataclass(frozen=True)
class LiveFigures:
    """Finished rows and the tokens the engine computed for them (copies' tokens are their source's)."""

    succeeded: int = 0
    failed: int = 0
    deduplicated: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    engine_ms: int = 0

    def __add__(self, other: LiveFigures) -> LiveFigures:
        return LiveFigures(self.succeeded + other.succeeded, self.failed + other.failed,
                           self.deduplicated + other.deduplicated, self.prompt + other.prompt,
                           self.cached + other.cached, self.completion + other.completion,
                           self.engine_ms + other.engine_ms)

    @property
    def rows(self) -> int:
        return self.succeeded + self.failed

    def encode(self, generation: int) -> str:
        values = (getattr(self, field.name) for field in dataclasses.fields(self))
        return " ".join(str(value) for value in (generation, *values))

    @classmethod
    def decode(cls, value: bytes | str) -> LiveFigures:
        text = value.decode() if isinstance(value, bytes) else value
        return cls(*(int(number) for number in text.split()[1:]))


def total(figures: Iterable[LiveFigures]) -> LiveFigures:
    return sum(figures, LiveFigures())


def in_flight(live: Mapping[bytes | str, bytes | str], counted: Iterable[bytes | str | int]) -> LiveFigures:
    """The figures of the shards that are not counted yet (`live`: the hash; `counted`: the set)."""
    done = {int(member) for member in counted}
    return total(LiveFigures.decode(value) for shard, value in live.items() if int(shard) not in done)


class LiveProgress:
    """The live-progress hash of one job (its writes; the counters read it)."""

    def __init__(self, client: redis.Redis, job_id: str, namespace: str = "bulkinfer") -> None:
        # The {job_id} hash tag keeps both keys in the counters' Redis Cluster slot, as Lua requires.
        self.key = live_progress_key(namespace, job_id)
        self.counted_key = counted_shards_key(namespace, job_id)
        self._write = client.register_script(WRITE_SCRIPT)
        self._clear = client.register_script(CLEAR_SCRIPT)

    def write(self, shard_index: int, generation: int, figures: LiveFigures) -> bool:
        """Set the shard's figures for the run of lease `generation`; False if refused."""
        return bool(self._write(keys=[self.key, self.counted_key],
                                args=[shard_index, generation, figures.encode(generation)]))

    def clear(self, shard_index: int, generation: int) -> None:
        """Drop the shard's figures if the run of `generation` wrote them (it ended without a commit)."""
        self._clear(keys=[self.key], args=[shard_index, generation])
