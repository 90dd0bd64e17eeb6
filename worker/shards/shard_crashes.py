"""A row that kills its worker process: count the crashed runs, split the shard, end the row.

An out-of-memory kill or a native crash (SIGKILL, SIGSEGV) raises nothing, so no attempt is
recorded (worker/shards/task_attempts.py) and the reaper would re-send the shard forever, killing the
shards beside it each time. So a run is counted when it *starts*:

- Counting: one Redis hash per shard, field `shard` for the shard's deliveries and `<lo>-<hi>` for
  a piece (the shard's row positions lo..hi-1). A run adds 1 (HINCRBY, atomic) when it starts and
  takes it back when it ends in any way Python sees (a result, an exception, a hand-back); a
  process that dies takes nothing back. What stays is the number of runs that crashed.
- Splitting: after `crash_split_after` crashed deliveries (a neighbour's crash counts too: nothing
  tells them apart), a delivery runs alone in its worker process (worker/shards/exclusive_runs.py: no
  other shard's rows run there meanwhile, and it is counted only once it is alone), so a crash
  then is its own and kills nobody else's rows. It runs the shard's rows in halves; a half that
  crashed once is halved again on the next delivery, down to the single row; a single row that
  crashed its worker alone is that row's `worker_crashed` error. Halves that did not crash run
  (again) on every delivery, in memory: nothing is kept between deliveries but the counts.
- Committing: the pieces' outcomes make up the shard's outcome in input order, which is written
  and committed as any shard's (one write-once result, its fenced parts at the shard's
  deterministic keys), so the manifest, counters, merged results, retries and dedup see an
  ordinary shard, and no row is written twice.

A poison row among a shard's rows costs `crash_split_after` + ceil(log2(rows)) crashes. A split
shard that keeps crashing outside its pieces' runs (reading the input, writing parts) fails its
job after `crash_split_after` such crashes, with the reason, instead of looping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.names import job_key

logger = logging.getLogger(__name__)

COUNT_TTL_S = 7 * 24 * 3600  # as long as the other per-job step counts (worker/shards/task_attempts.py)
WHOLE = "shard"
WORKER_CRASHED_MESSAGE = ("this row's run killed the worker process (out of memory, a native crash or "
                          "SIGKILL) every time, the last time alone in its worker; it was not run again")

Outcomes = dict[int, OutputRow]
RunGroup = Callable[[list[int]], Outcomes | None]  # positions -> their outcomes (None: stopped)


def crashes_key(namespace: str, job_id: str, shard_index: int) -> str:
    return job_key(namespace, job_id, "shard", shard_index, "crashes")


@dataclass(frozen=True)
class CrashHistory:
    """What earlier runs of a shard left: crashed deliveries and crashed pieces."""

    whole: int  # deliveries of the shard that crashed, split ones included
    split_after: int
    pieces: dict[str, int] = field(default_factory=dict)  # "<lo>-<hi>" -> crashed runs of it

    @property
    def split(self) -> bool:
        return self.whole >= self.split_after

    @property
    def outside_pieces(self) -> int:
        """Crashed split deliveries that died outside any piece's run (reading, writing)."""
        return max(0, self.whole - self.split_after - sum(self.pieces.values())) if self.split else 0


class ShardCrashes:
    def __init__(self, client: redis.Redis, namespace: str, job_id: str, shard_index: int,
                 split_after: int) -> None:
        self.client = client
        self.key = crashes_key(namespace, job_id, shard_index)
        self.split_after = split_after

    def history(self) -> CrashHistory:
        """What earlier runs left (read by the lease's holder: no other run of the shard goes)."""
        runs = {(name.decode() if isinstance(name, bytes) else name): int(value)
                for name, value in self.client.hgetall(self.key).items()}
        pieces = {name: value for name, value in runs.items() if name != WHOLE and value > 0}
        return CrashHistory(whole=runs.get(WHOLE, 0), split_after=self.split_after, pieces=pieces)

    @contextmanager
    def delivery(self) -> Iterator[None]:
        """Count this delivery as running: a crash leaves it counted."""
        with self.running(WHOLE):
            yield

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key, name, 1)
            pipe.expire(self.key, COUNT_TTL_S)
            pipe.execute()
        try:
            yield
        finally:
            self._uncount(name)

    def _uncount(self, name: str) -> None:
        try:
            self.client.hincrby(self.key, name, -1)
        except redis.RedisError as error:  # counted as a crash then: the shard splits sooner, loses nothing
            logger.warning("%s: could not take back a run of %s (%s)", self.key, name, error)


def worker_crashed_row(item: Row | RowError) -> OutputRow:
    if isinstance(item, RowError):  # never reached the engine; keeps its own error
        return OutputRow.from_error(item)
    return OutputRow.engine_failed(item, RowErrorCode.WORKER_CRASHED, WORKER_CRASHED_MESSAGE)


def run_split(items: Sequence[Row | RowError], positions: Sequence[int], history: CrashHistory,
              crashes: ShardCrashes, run_group: RunGroup) -> Outcomes | None:
    """The outcomes of `positions` (of the shard's `items`), run piece by piece (the caller runs the
    delivery alone in its process); None when a piece's run was stopped (`run_group` said None)."""
    wanted = sorted(positions)
    outcomes: Outcomes = {}

    def walk(lo: int, hi: int) -> bool:
        members = [position for position in wanted if lo <= position < hi]
        if not members:
            return True
        name = f"{lo}-{hi}"
        if history.pieces.get(name, 0):
            if hi - lo == 1:
                outcomes[lo] = worker_crashed_row(items[lo])
                logger.warning("%s: row %s killed its worker alone; it is a worker_crashed error",
                               crashes.key, items[lo].row_id)
                return True
            middle = (lo + hi) // 2
            return walk(lo, middle) and walk(middle, hi)
        with crashes.running(name):
            got = run_group(members)
        if got is None:
            return False
        outcomes.update(got)
        return True

    total = len(items)
    middle = total // 2
    # Even a one-row shard runs alone once more: its earlier crashes may have been a neighbour's.
    tops = [(0, total)] if total <= 1 else [(0, middle), (middle, total)]
    if all(walk(lo, hi) for lo, hi in tops):
        return outcomes
    return None
