"""`run_shard`: one shard's rows through the worker's engine, written once, counted once.

The commit point is the shard result (`shards/part-NNNNN.json`, write-once). A run writes its
output and error parts staged under its fencing token (the lease's generation and its own token),
then tries to commit its result; whoever commits, and every later delivery that finds the result,
publishes that result's staged parts to their deterministic keys (jobs/part_publication.py) before
counting the shard. So a run that died before committing left only staged copies nothing reads,
and a run that lost its lease (stalled past the TTL) cannot overwrite the parts of the run that
did commit. Once a result exists, a rerun writes nothing and only makes sure the shard is
published and counted (and the job finalized), so a row never appears twice.

A `ShardLease` keeps two deliveries of one shard from running at the same time: the second
waits for the first, then finds its result.

Cancel is cooperative: the flag is checked before the shard starts and every `CANCEL_POLL_S`
while its rows run; on cancel the shard's requests are aborted and nothing is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from jobs.counters import CountersMissing
from jobs.formats.output import OutputRow
from jobs.formats.readers import read_shard_rows
from jobs.formats.rows import Row, RowError
from jobs.layout import JobLayout
from jobs.log_format import add_to_log_context
from jobs.object_store.base import ObjectNotFound
from jobs.object_store.factory import store_for_uri
from jobs.part_publication import publish_parts, write_fenced
from jobs.repository import JobRepository
from jobs.results import ShardResult
from jobs.sharding import ShardPlan
from jobs.spec import JobSpec
from jobs.status import JobState
from jobs.usage import record_shard_usage
from worker import metrics, shutdown
from worker.context import WorkerContext
from worker.engine_host import EngineUnavailable
from worker.job_lifecycle import JobCannotRun, fail_job, resolved_spec
from worker.model_hosts import HostedModel
from worker.row_window import run_rows
from worker.schema_limit import limit_schemas_streamed
from worker.shard_copies import Stopped, copy_rows, write_exports
from worker.shard_lease import ShardLease
from worker.shutdown import ShardHandedBack
from worker.transient import is_transient

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5
MAX_JOB_PRIORITY = 9  # JobSpec.priority: 0-9, higher sooner; the engine runs lower values first


class PhaseTimings:
    """Seconds spent per phase of a shard (read, model, engine, write), for the log and the result."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started

    def rounded(self) -> dict[str, float]:
        return {name: round(value, 3) for name, value in self.seconds.items()}


def run_shard(context: WorkerContext, job_id: str, shard_index: int,
              send_finalize: Callable[[str], None]) -> dict[str, Any]:
    repository = context.repository
    summary: dict[str, Any] = {"job_id": job_id, "shard_index": shard_index}
    if repository.is_cancel_requested(job_id):
        return {**summary, "status": "cancelled"}
    # A second delivery of a shard that is still running waits here, then finds its result.
    lease = ShardLease(repository.redis, job_id, shard_index, ttl_s=context.settings.lease_ttl,
                       namespace=repository.namespace)
    if not lease.acquire(give_up=lambda: repository.is_cancel_requested(job_id)):
        return {**summary, "status": "cancelled"}
    with lease:
        return {**summary, **_run_holding_lease(context, job_id, shard_index, lease, send_finalize)}


def _run_holding_lease(context: WorkerContext, job_id: str, shard_index: int, lease: ShardLease,
                       send_finalize: Callable[[str], None]) -> dict[str, Any]:
    repository = context.repository
    job = repository.get(job_id)
    add_to_log_context(tenant=job.tenant)
    if job.state == JobState.CANCELLED:  # cancelled between the first check and the lease: as that check
        return {"status": "cancelled"}
    if job.state.is_terminal:
        return {"status": f"skipped: job is {job.state.value}"}
    layout = repository.layout(job_id)
    plan = repository.load_plan(job_id)
    result = committed_result(repository, layout, shard_index)
    summary: dict[str, Any] = {"already_done": result is not None}
    spec: JobSpec | None = None  # read when the shard runs here; count_shard reads it otherwise
    if result is None:
        started_at = datetime.now(UTC)
        timings = PhaseTimings()
        try:
            with timings.phase("read"):
                spec = resolved_spec(context, repository.get_spec(job_id))
            outputs, dtype = _infer(context, job_id, spec, plan[shard_index], timings, job.expires_at)
        except JobCannotRun as error:
            fail_job(repository, job_id, str(error))
            metrics.record_shard(spec.model if spec is not None else "unknown", "failed")
            return {"status": "failed", "error": str(error)}
        except ShardHandedBack:
            metrics.record_shard(spec.model if spec is not None else "unknown", "handed_back")
            raise
        if outputs is None or repository.is_cancel_requested(job_id):
            logger.info("job %s shard %d cancelled; nothing written", job_id, shard_index)
            metrics.record_shard(spec.model, "cancelled")
            return {"status": "cancelled"}
        if not lease.held:  # this process stalled past the lease's TTL: another run owns the shard now
            metrics.record_shard(spec.model, "skipped")
            return {"status": "skipped: lost the shard lease to another run"}
        with timings.phase("write"):
            result = write_fenced(repository.store, layout, spec, plan[shard_index], outputs,
                                  fence=lease.fence, created=int(job.created_at.timestamp()),
                                  started_at=started_at, dtype=dtype)
        metrics.record_shard(spec.model, "done", result)
        summary["seconds"] = timings.rounded()
        logger.info("job %s shard %d: %d rows (%d failed), %d prompt / %d cached / %d completion tokens; "
                    "seconds %s", job_id, shard_index, result.rows, result.rows_failed, result.usage.prompt,
                    result.usage.cached, result.usage.completion, summary["seconds"])
    count_shard(repository, layout, plan, result, send_finalize, spec)
    return {**summary, "status": "done", "rows": result.rows, "rows_failed": result.rows_failed}


def committed_result(repository: JobRepository, layout: JobLayout, shard_index: int) -> ShardResult | None:
    try:
        data = repository.store.get_bytes(layout.shard_result_key(shard_index))
    except ObjectNotFound:
        return None
    return ShardResult.model_validate_json(data)


def _infer(context: WorkerContext, job_id: str, spec: JobSpec, shard: ShardPlan, timings: PhaseTimings,
           expires_at: datetime | None = None) -> tuple[list[OutputRow] | None, str | None]:
    """Every row's outcome in input order (None when the job was cancelled meanwhile; rows still
    running at `expires_at` come back `expired`) and the dtype the engine computed them in."""
    try:
        with timings.phase("model"):
            hosted = context.hosts.get(spec.model)
    except Exception as error:  # noqa: BLE001 - unknown model, files missing, tokenizer unreadable…
        if is_transient(error):  # …but not a store that is down for a moment
            raise
        raise JobCannotRun(f"cannot load model {spec.model!r}: {error}") from error
    with timings.phase("engine"):  # rows are read as the engine drains them (worker/row_window.py)
        items = limit_schemas_streamed(context.repository.redis, context.repository.namespace, job_id,
                                       stream_rows(context, spec, shard),
                                       context.settings.max_schemas_per_job)
        outputs = _outcomes(context, hosted, job_id, spec, shard, items, expires_at)
    choice = hosted.host.dtype_choice
    return outputs, choice.dtype if choice else None


def _outcomes(context: WorkerContext, hosted: HostedModel, job_id: str, spec: JobSpec, shard: ShardPlan,
              items: Iterator[Row | RowError], expires_at: datetime | None) -> list[OutputRow] | None:
    """Every row's outcome in input order: the shard's own rows from the engine (read as it drains
    them), then the rows it copies from earlier shards (jobs/job_dedup.py), with its exports written
    for later ones. Only the copies' rows are kept until the end."""
    repository = context.repository
    layout = repository.layout(job_id)
    copy_items: dict[int, Row | RowError] = {}
    own_positions: list[int] = []

    def own_rows() -> Iterator[Row | RowError]:
        for position, item in enumerate(items):
            if position in shard.copies:
                copy_items[position] = item
            else:
                own_positions.append(position)
                yield item

    def run(rows: Iterable[Row | RowError]) -> list[OutputRow] | None:
        expires_in_s = None if expires_at is None else (expires_at - datetime.now(UTC)).total_seconds()
        return _run_on_engine(context, hosted, job_id, rows, priority=MAX_JOB_PRIORITY - spec.priority,
                              deduplicate=spec.deduplicate, expires_in_s=expires_in_s)

    own = run(own_rows())
    if own is None:
        return None
    outcomes = dict(zip(own_positions, own, strict=True))
    write_exports(repository, layout, shard, outcomes)
    if shard.copies:
        try:
            copied, compute = copy_rows(repository, layout, shard, copy_items, expires_at=expires_at,
                                        should_stop=lambda: shutdown.stopping()
                                        or repository.is_cancel_requested(job_id))
        except Stopped:
            if shutdown.stopping():
                raise ShardHandedBack(f"job {job_id}: the worker is stopping") from None
            return None
        computed = run([copy_items[position] for position in compute]) if compute else []
        if computed is None:
            return None
        outcomes.update(copied)
        outcomes.update(zip(compute, computed, strict=True))
    return [outcomes[position] for position in range(len(outcomes))]


def read_rows(context: WorkerContext, spec: JobSpec, shard: ShardPlan) -> list[Row | RowError]:
    """The shard's rows; `JobCannotRun` when the input cannot be read (a store down: raised as is)."""
    return list(stream_rows(context, spec, shard))


def stream_rows(context: WorkerContext, spec: JobSpec, shard: ShardPlan) -> Iterator[Row | RowError]:
    """The shard's rows, read as they are asked for; `JobCannotRun` when the input cannot be read
    (a store down: raised as is, the task retries)."""
    store, key = store_for_uri(spec.input_uri, endpoint_url=context.settings.s3_endpoint_url)
    try:
        yield from read_shard_rows(store, key, spec, shard)
    except Exception as error:  # noqa: BLE001 - any failure to read the input fails the job…
        if is_transient(error):  # …unless the store is unreachable: the task retries
            raise
        raise JobCannotRun(f"cannot read the input {spec.input_uri}: {error}") from error


def _run_on_engine(context: WorkerContext, hosted: HostedModel, job_id: str, items: Iterable[Row | RowError],
                   priority: int, deduplicate: bool, expires_in_s: float | None) -> list[OutputRow] | None:
    """Every row's outcome in input order; None if the job was cancelled while its rows ran.
    Raises `ShardHandedBack` when the worker began to stop meanwhile (worker/shutdown.py)."""
    try:
        outputs = run_rows(hosted, items, priority, poll_s=CANCEL_POLL_S, deduplicate=deduplicate,
                           expires_in_s=expires_in_s, window_rows=context.settings.shard_window_rows,
                           should_stop=lambda: shutdown.stopping()
                           or context.repository.is_cancel_requested(job_id))
    except EngineUnavailable as error:
        if shutdown.stopping():  # the engine was stopped with the worker
            raise ShardHandedBack(f"job {job_id}: the worker is stopping") from error
        if hosted.host.loaded:  # it ran, then died: the shard is retried on a fresh engine
            raise EngineDied(f"model {hosted.name!r}: the engine died while running the shard: {error}") \
                from error
        raise JobCannotRun(f"model {hosted.name!r} is unavailable on this worker: {error}") from error
    if outputs is None and shutdown.stopping():
        raise ShardHandedBack(f"job {job_id}: the worker is stopping")
    return outputs


class EngineDied(RuntimeError):
    """The engine was stopped or could not be rebuilt after a crash; the next attempt loads a new one."""


def count_shard(repository: JobRepository, layout: JobLayout, plan: Sequence[ShardPlan], result: ShardResult,
                send_finalize: Callable[[str], None], spec: JobSpec | None = None) -> None:
    """Publish the committed result's parts, then count the shard once (and add it to its tenant's
    and model's usage: `spec`, read when not given); whoever sees every shard done sends finalize
    (it may go twice: harmless)."""
    publish_parts(repository.store, result)
    counters = repository.counters(layout.job_id)
    try:
        if counters.apply_shard(result):
            spec = spec or repository.get_spec(layout.job_id)
            record_shard_usage(repository.redis, repository.namespace, spec.tenant, spec.model, result)
    except CountersMissing:  # Redis lost them (its usage buckets too): rebuild from the shard results
        counters.rebuild_from_store(repository.store, layout, plan)
    snapshot = counters.read()
    if snapshot.shards.done >= snapshot.shards.total:
        send_finalize(layout.job_id)
