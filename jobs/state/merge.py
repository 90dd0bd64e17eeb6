"""Merged results of a retry chain: one row per input row, the latest success, else the latest error.

A chain is a job and the retries made from it (`parent_job_id`), oldest first. Every retry shard
names the shard of the chain's first planned job that covers its range (`ShardPlan.origin`), so
the merge walks those ranges in input order and holds one range's rows at a time:

- the range's *base* is the last job in the chain that ran the whole range (`only_rows` None);
  its output part has one row per input row, in input order, and its error part lists the failed
  ones, in the same order, with their `Row.index`. A later job runs a range whole only when no
  earlier one had finished it when the retry was cut, so an earlier whole run is one that committed
  after that (a shard of a failed job still running then) and the later one stands;
- every later job that ran the range ran only the rows its `only_rows` lists, and its output part
  has one row for each, in that order; a success replaces the row, an error replaces an error.

Rows of a range no job in the chain has finished are not in the output (`MergedChain.missing`).
`load_chain` checks from the shard results that the parts line up before any row is read, so a
chain that does not is refused before an answer starts, never halfway through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from bulkinfer.jobs.formats.csv_parts import part_rows
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.jobs.planning.retry import failed_rows
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import PartFile, ShardResult, load_shard_results

MAX_CHAIN = 100  # retries of retries; a longer chain (or a loop) is refused
OpenPart = Callable[[PartFile], tuple[ObjectStore, str]]


class MergeError(ValueError):
    """The chain's parts do not line up (the input changed between retries, or a part is gone)."""


@dataclass(frozen=True)
class _Ran:
    """One job's finished shard over a range."""

    job_id: str
    shard: ShardPlan
    result: ShardResult


@dataclass(frozen=True)
class MergedChain:
    job_ids: list[str]  # oldest first
    output_format: str
    ranges: dict[int, list[_Ran]]  # origin shard → the jobs that finished it, oldest first
    total_ranges: int

    @property
    def missing(self) -> int:
        """Ranges (shards of the first job) that no job in the chain has finished."""
        return self.total_ranges - sum(1 for runs in self.ranges.values() if runs)


def chain_of(repository: JobRepository, job_id: str) -> list[str]:
    """The job and its ancestors, oldest first."""
    chain = [job_id]
    parent = repository.get_spec(job_id).parent_job_id
    while parent is not None:
        if parent in chain or len(chain) >= MAX_CHAIN:
            raise MergeError(f"job {job_id}'s retry chain is longer than {MAX_CHAIN} jobs or loops")
        chain.append(parent)
        parent = repository.get_spec(parent).parent_job_id
    return chain[::-1]


def load_chain(repository: JobRepository, job_id: str,
               published: Callable[[ShardResult], bool]) -> MergedChain:
    """What the merge reads: every job's plan and the results whose parts are `published`."""
    job_ids = chain_of(repository, job_id)
    spec = repository.get_spec(job_id)
    output_format = str(spec.effective_output_format or InputFormat.JSONL)
    ranges: dict[int, list[_Ran]] = {}
    total: int | None = None
    for chain_id in job_ids:
        try:
            plan = repository.load_plan(chain_id)
        except ObjectNotFound:
            continue  # never planned (cancelled while queued): it ran nothing
        if total is None:
            total = len(plan)
        results = {result.shard_index: result
                   for result in load_shard_results(repository.store, repository.layout(chain_id))
                   if published(result)}
        for shard in plan:
            runs = ranges.setdefault(shard.origin, [])
            if shard.index in results:
                runs.append(_Ran(chain_id, shard, results[shard.index]))
    for runs in ranges.values():
        _check_lines_up(runs)
    return MergedChain(job_ids, output_format, ranges, total or 0)


def _base_at(runs: list[_Ran]) -> int | None:
    """The last run over the whole range, or None."""
    return next((i for i in reversed(range(len(runs))) if runs[i].shard.only_rows is None), None)


def _check_lines_up(runs: list[_Ran]) -> None:
    """`MergeError` when the parts the merge would read do not line up, judged from the results'
    counts (what each part was written with), before a row is read."""
    base_at = _base_at(runs)
    if base_at is not None:
        base = runs[base_at]
        if base.result.errors.rows != base.result.rows_failed or base.result.output.rows != base.result.rows:
            raise MergeError(f"job {base.job_id} shard {base.shard.index}: its output part has "
                             f"{base.result.rows_failed} failed rows of {base.result.output.rows}, its error "
                             f"part {base.result.errors.rows}")
    for run in runs[0 if base_at is None else base_at + 1:]:
        wanted = len(run.shard.only_rows or [])
        if run.result.output.rows != wanted:
            raise MergeError(f"job {run.job_id} shard {run.shard.index} ran {run.result.output.rows} rows of "
                             f"the {wanted} it retried: was the input changed since the first job?")


def merged_records(repository: JobRepository, chain: MergedChain,
                   open_part: OpenPart) -> Iterator[dict[str, Any]]:
    """Every merged row (an output record of the chain's format) in input order."""
    for origin in sorted(chain.ranges):
        yield from _merge_range(repository, chain, chain.ranges[origin], open_part)


def _merge_range(repository: JobRepository, chain: MergedChain, runs: list[_Ran],
                 open_part: OpenPart) -> list[dict[str, Any]]:
    base_at = _base_at(runs)
    if base_at is None:  # only retries of single rows finished here: place them by index
        latest: dict[int, dict[str, Any]] = {}
        for run in runs:
            for index, record in _retried_records(chain, run, open_part):
                if index not in latest or _failed(chain, latest[index]) or not _failed(chain, record):
                    latest[index] = record
        return [latest[index] for index in sorted(latest)]
    base = runs[base_at]
    rows = _part_records(chain, base.result.output, open_part)
    failed_positions = [position for position, record in enumerate(rows) if _failed(chain, record)]
    indices = [index for index, _ in failed_rows(repository, base.result)]
    if len(indices) != len(failed_positions):
        raise MergeError(f"job {base.job_id} shard {base.shard.index}: its output part has "
                         f"{len(failed_positions)} failed rows, its error part {len(indices)}")
    position_of = dict(zip(indices, failed_positions, strict=True))
    for run in runs[base_at + 1:]:
        for index, record in _retried_records(chain, run, open_part):
            position = position_of.get(index)
            if position is not None and (_failed(chain, rows[position]) or not _failed(chain, record)):
                rows[position] = record
    return rows


def _retried_records(chain: MergedChain, run: _Ran, open_part: OpenPart) -> list[tuple[int, dict[str, Any]]]:
    records = _part_records(chain, run.result.output, open_part)
    wanted = run.shard.only_rows or []
    if len(records) != len(wanted):
        raise MergeError(f"job {run.job_id} shard {run.shard.index} ran {len(records)} rows of the "
                         f"{len(wanted)} it retried: was the input changed since the first job?")
    return list(zip(wanted, records, strict=True))


def _is_table(chain: MergedChain) -> bool:
    """Parquet, CSV and TSV parts have an `error_code` column; JSON lines an `error` object."""
    return chain.output_format == InputFormat.PARQUET or chain.output_format in DELIMITED_FORMATS


def _failed(chain: MergedChain, record: dict[str, Any]) -> bool:
    if _is_table(chain):
        return record.get("error_code") is not None
    return record.get("error") is not None


def _part_records(chain: MergedChain, part: PartFile, open_part: OpenPart) -> list[dict[str, Any]]:
    store, key = open_part(part)
    if chain.output_format == InputFormat.PARQUET:
        import pyarrow.parquet as pq

        with store.open_seekable(key) as file:
            return pq.read_table(file).to_pylist()
    if _is_table(chain):
        with closing(store.open_read(key)) as stream:
            return [row for rows in part_rows(stream, chain.output_format) for row in rows]
    return [json.loads(line) for line in store.get_bytes(key).splitlines() if line.strip()]
