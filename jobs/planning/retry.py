"""Retry plans: a job over only the rows of an ended job that did not succeed.

A retry job has its parent's spec (with `parent_job_id`) and a plan cut from the parent's plan:
one shard per parent shard that has something to run again, over the same byte or row range, with
`only_rows` listing the rows (by `Row.index`) that failed there, or none (every row) where the
parent never ran the shard (cancelled, failed before it ran). Each shard keeps the index of the
shard of the chain's first job that covers the range (`origin_shard`), which is what lets
`jobs/state/merge.py` merge a chain's results one range at a time.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.state.part_publication import staged_key
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import ShardResult, committed_shard_result
from bulkinfer.jobs.state.status import JobState, JobStatus

NOT_RUN = "not_run"  # the code a retry filter uses for rows of shards that never ran


class NothingToRetry(ValueError):
    """The parent has no row that failed (with the asked codes) or never ran."""


class NotRetryable(ValueError):
    """The parent has not ended yet."""


def check_retryable(parent: JobStatus) -> None:
    if not parent.state.is_terminal:
        raise NotRetryable(f"job {parent.job_id} is {parent.state.value}: retry it once it has ended "
                           f"({', '.join(sorted(s.value for s in JobState if s.is_terminal))})")


def retry_plan(repository: JobRepository, parent_id: str,
               error_codes: Collection[str] | None = None) -> list[ShardPlan] | None:
    """The retry's shards, numbered from 0 in input order. None when the parent was never planned
    (cancelled while queued, or failed before planning): the retry then plans its whole input.
    Raises `NothingToRetry` when no row qualifies."""
    try:
        parent_plan = repository.load_plan(parent_id)
    except ObjectNotFound:
        return None
    codes = frozenset(error_codes) if error_codes is not None else None
    layout = repository.layout(parent_id)
    shards: list[ShardPlan] = []
    for shard in parent_plan:
        result = committed_shard_result(repository.store, layout, shard.index)
        rows = _rows_to_retry(repository, shard, result, codes)
        if rows is not None and not rows:
            continue
        shards.append(shard.model_copy(update={
            "index": len(shards), "origin_shard": shard.origin, "only_rows": rows,
            "copies": {}, "exports": [],  # a retry's rows run on their own
            "estimated_rows": shard.estimated_rows if rows is None else len(rows),
            "rows_exact": shard.rows_exact if rows is None else True}))
    if not shards:
        wanted = "" if codes is None else f" with code {', '.join(sorted(codes))}"
        raise NothingToRetry(f"job {parent_id} has no row that failed{wanted} or did not run: "
                             "nothing to retry")
    return shards


def _rows_to_retry(repository: JobRepository, shard: ShardPlan, result: ShardResult | None,
                   codes: frozenset[str] | None) -> list[int] | None:
    """The row indices to run again ([] for none), or None for every row the shard covers."""
    if result is None:  # the shard never ran
        if codes is not None and NOT_RUN not in codes:
            return []
        return shard.only_rows
    if not result.rows_failed:
        return []
    if codes is not None and result.error_codes and not codes & result.error_codes.keys():
        return []
    return sorted(index for index, code in failed_rows(repository, result) if codes is None or code in codes)


def failed_rows(repository: JobRepository, result: ShardResult) -> list[tuple[int, str]]:
    """(index, code) of each row in the result's error part, in input order."""
    records = []
    for line in read_error_part(repository, result).splitlines():
        if line.strip():
            record = json.loads(line)
            records.append((int(record["index"]), str(record["error"]["code"])))
    return records


def read_error_part(repository: JobRepository, result: ShardResult) -> bytes:
    """The error part at its key, or still staged where its run committed but had not published."""
    try:
        return repository.store.get_bytes(result.errors.key)
    except ObjectNotFound:
        if result.fence is None:
            raise
        return repository.store.get_bytes(staged_key(result.errors.key, result.fence))
