"""A running shard's finished rows, written to Redis as they finish, at a bounded rate.

The row loop (worker/hosts/row_window.py) reports rows whose outcome is final and the provisional
figures of the rows finished inside windows still in the engine (`update`). Whatever
the throughput, a shard writes its figures at most once every `interval_s` (plus one last write
when its rows are done, before its parts are written), and never when nothing changed: one Redis
write per shard per interval, not one per row. The figures are the run's absolute ones under its
lease generation (jobs/state/live_progress.py), so a rerun replaces them and a commit drops them.

Progress is a view: a write that fails (Redis down or refusing writes) is skipped, never fails
the shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import redis

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.state.live_progress import LiveFigures, LiveProgress

logger = logging.getLogger(__name__)

WRITE_INTERVAL_S = 1.0


def settled_figures(outputs: Iterable[OutputRow]) -> LiveFigures:
    """Rows whose outcome is final, counted as the shard's result will count them
    (`ShardResult.from_outputs`: a copy's tokens were computed once, for its source)."""
    rows = list(outputs)
    computed = [row for row in rows if not row.deduplicated]
    failed = sum(row.failed for row in rows)
    return LiveFigures(succeeded=len(rows) - failed, failed=failed,
                       deduplicated=sum(row.deduplicated for row in rows),
                       prompt=sum(row.prompt_tokens or 0 for row in computed),
                       cached=sum(row.cached_tokens or 0 for row in computed),
                       completion=sum(row.completion_tokens or 0 for row in computed),
                       engine_ms=round(sum(row.engine_seconds for row in computed) * 1000))


class ShardProgress:
    """One shard run's finished rows, written under its lease `generation`; called from the
    shard's own thread only."""

    def __init__(self, live: LiveProgress, shard_index: int, generation: int, *,
                 interval_s: float = WRITE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._live = live
        self._shard = shard_index
        self._generation = generation
        self._interval_s = interval_s
        self._clock = clock
        self._settled = LiveFigures()
        self._running = LiveFigures()
        self._written: LiveFigures | None = None
        self._written_at: float | None = None

    @property
    def figures(self) -> LiveFigures:
        return self._settled + self._running

    @contextmanager
    def of_this_run(self) -> Iterator[ShardProgress]:
        """From the run's start (what an earlier run of the shard left, if it crashed, becomes
        zeros) to its end (figures a commit did not take are dropped)."""
        self._write()
        try:
            yield self
        finally:
            self.clear()

    def update(self, finished: Iterable[OutputRow], running: LiveFigures | None = None) -> None:
        """Adds rows whose outcome is final (a window the engine finished, copies of other shards'
        rows) and, given, replaces `running`: the rows finished so far inside the windows still in
        the engine (provisional: e.g. an output that is not valid JSON fails when its window ends)."""
        self._settled += settled_figures(finished)
        if running is not None:
            self._running = running
        self._write_if_due()

    def flush(self) -> None:
        """Write now if anything changed since the last write (the rows are done: before the parts)."""
        if self.figures != self._written:
            self._write()

    def clear(self) -> None:
        """The run ended without committing: its figures go (a commit drops them itself)."""
        try:
            self._live.clear(self._shard, self._generation)
        except (redis.RedisError, OSError) as error:
            logger.debug("shard %d: could not clear its live progress: %s", self._shard, error)

    def _write_if_due(self) -> None:
        due = self._written_at is None or self._clock() - self._written_at >= self._interval_s
        if due and self.figures != self._written:
            self._write()

    def _write(self) -> None:
        figures = self.figures
        self._written_at = self._clock()  # a failed write waits an interval too: no retry storm
        try:
            self._live.write(self._shard, self._generation, figures)
        except (redis.RedisError, OSError) as error:
            logger.debug("shard %d: live progress not written: %s", self._shard, error)
            return
        self._written = figures
