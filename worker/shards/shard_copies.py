"""A shard's rows that are identical to an earlier shard's (marked at planning, jobs/planning/job_dedup.py):
the shard exports the outcomes later shards copy, and takes its copies from its sources' exports.

A source shard has a lower index than its copies, so when a copy's shard has run its own rows, the
source is running or done. Each run of the source writes its exports under its own fencing token
(as it stages its parts: jobs/state/part_publication.py), and the copy waits for the source's committed
result, then reads the exports of the run that committed it: two runs of a source can race (a
stalled run resumes after the reaper re-sent the shard) and their outcomes can differ (logprobs,
cached tokens, any nondeterminism), and a copy must equal the source row that stands. The copy
computes the row itself when the committed run wrote no exports (the expiry sweep's result, or an
older worker's), or after `MAX_WAIT_S`; it stops with the shard on cancel or shutdown, and its rows
expire at the job's deadline like the others.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from bulkinfer.jobs.formats.output import OutputRow, expired_row
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.planning.job_dedup import dump_outputs, exports_key, load_outputs
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import committed_shard_result

WAIT_POLL_S = 0.5
MAX_WAIT_S = 600.0


def write_exports(repository: JobRepository, layout: JobLayout, shard: ShardPlan,
                  outcomes: dict[int, OutputRow], fence: str) -> None:
    """The outcomes of this shard's rows that later shards copy, under this run's fencing token;
    written before the run commits, so the committed run's exports are there when copies look."""
    exported = {position: outcomes[position] for position in shard.exports if position in outcomes}
    if exported:
        repository.store.put_bytes(exports_key(layout.job_dir, shard.index, fence), dump_outputs(exported))


def discard_exports(repository: JobRepository, layout: JobLayout, shard: ShardPlan, fence: str) -> None:
    """Drop the exports of a run whose result did not commit (no copy ever reads them)."""
    if shard.exports:
        repository.store.delete(exports_key(layout.job_dir, shard.index, fence))


class Stopped(Exception):
    """The shard must stop (cancel or shutdown) while its copies wait."""


def copy_rows(repository: JobRepository, layout: JobLayout, shard: ShardPlan,
              items: Mapping[int, Row | RowError], should_stop: Callable[[], bool],
              expires_at: datetime | None) -> tuple[dict[int, OutputRow], list[int]]:
    """The copies' outcomes by position, and the positions the shard must compute itself (its
    source exported nothing). Raises `Stopped` when `should_stop()` says so while waiting."""
    by_source: dict[int, list[tuple[int, int]]] = {}
    for position, (source_shard, source_position) in shard.copies.items():
        by_source.setdefault(source_shard, []).append((position, source_position))
    copied: dict[int, OutputRow] = {}
    compute: list[int] = []
    started = time.monotonic()
    for source_shard, pairs in sorted(by_source.items()):
        exported = _wait_for_exports(repository, layout, source_shard, should_stop, expires_at, started)
        for position, source_position in pairs:
            item = items[position]
            if isinstance(exported, str):  # "expired"
                copied[position] = expired_row(item)
            elif exported is None or source_position not in exported or isinstance(item, RowError):
                compute.append(position)
            else:
                copied[position] = dataclasses.replace(
                    exported[source_position], index=item.index, row_id=item.row_id,
                    passthrough=item.passthrough, line=item.line, deduplicated=True, engine_seconds=0.0,
                    echo_prompt=item.prompt if item.echo else None)
    return copied, compute


def _wait_for_exports(repository: JobRepository, layout: JobLayout, source_shard: int,
                      should_stop: Callable[[], bool], expires_at: datetime | None,
                      started: float) -> dict[int, OutputRow] | str | None:
    """The exports of the run that committed the source; None when it has none; "expired" at the
    job's deadline."""
    while True:
        committed = committed_shard_result(repository.store, layout, source_shard)
        if committed is not None:
            try:  # its exports were written before it committed, unless it never wrote any
                return load_outputs(repository.store.get_bytes(
                    exports_key(layout.job_dir, source_shard, committed.fence)))
            except ObjectNotFound:
                return None
        if should_stop():
            raise Stopped
        if expires_at is not None and datetime.now(UTC) >= expires_at:
            return "expired"
        if time.monotonic() - started > MAX_WAIT_S:
            return None
        time.sleep(WAIT_POLL_S)
