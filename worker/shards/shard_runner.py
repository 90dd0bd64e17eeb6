"""`run_shard`: one shard's rows through the worker's engine, written once, counted once.

The commit point is the shard result (`shards/part-NNNNN.json`, write-once). A run writes its
output and error parts staged under its fencing token (the lease's generation and its own token),
then tries to commit its result; whoever commits, and every later delivery that finds the result,
publishes that result's staged parts to their deterministic keys (jobs/state/part_publication.py) before
counting the shard. So a run that died before committing left only staged copies nothing reads,
and a run that lost its lease (stalled past the TTL) cannot overwrite the parts of the run that
did commit. A run whose lease lapsed (a Redis outage longer than the TTL, or its process
stalled) still offers its result when it finishes: if no run committed, its work counts instead
of being computed again; if one did, it loses cleanly. Once a result exists, a rerun writes
nothing and only makes sure the shard is published and counted (and the job finalized), so a row
never appears twice.

A `ShardLease` keeps two deliveries of one shard from running at the same time: the second
waits for the first, then finds its result.

Cancel is cooperative: the flag is checked before the shard starts and every `CANCEL_POLL_S`
while its rows run; on cancel the shard's requests are aborted and nothing is written.

While its rows run, a run reports those that finished (`ShardProgress`, at a bounded rate) apart
from the committed counters: counting the shard drops them, and a run that ends without a commit
takes them back, so the job's counts move as rows finish and still count each row once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.log_format import add_to_log_context
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.output_tokens import NaturalLengths, record_natural_lengths
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.counters import CountersMissing
from bulkinfer.jobs.state.live_progress import LiveProgress
from bulkinfer.jobs.state.part_publication import CommitRefused, publish_parts, write_fenced
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import ShardResult, committed_shard_result
from bulkinfer.jobs.state.status import JobState
from bulkinfer.jobs.state.usage import shard_usage_entry
from bulkinfer.worker.hosts.engine_host import EngineUnavailable
from bulkinfer.worker.hosts.model_hosts import HostedModel, embedding_dimension, task_problem
from bulkinfer.worker.hosts.prefix_cache_salt import prefix_cache_salt
from bulkinfer.worker.hosts.row_window import run_rows
from bulkinfer.worker.images.fetcher import ImageFetcher
from bulkinfer.worker.images.job_fetcher import job_image_fetcher
from bulkinfer.worker.process import metrics, shutdown
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.shutdown import ShardHandedBack
from bulkinfer.worker.shards.exclusive_runs import ENGINE_RUNS
from bulkinfer.worker.shards.fault_injection import killing_on_marker
from bulkinfer.worker.shards.job_lifecycle import JobCannotRun, fail_job, resolved_spec
from bulkinfer.worker.shards.outage_cancel import CancelCheck
from bulkinfer.worker.shards.schema_limit import limit_schemas_streamed
from bulkinfer.worker.shards.shard_copies import Stopped, copy_rows, discard_exports, write_exports
from bulkinfer.worker.shards.shard_crashes import CrashHistory, ShardCrashes, run_split
from bulkinfer.worker.shards.shard_lease import ShardLease
from bulkinfer.worker.shards.shard_progress import ShardProgress
from bulkinfer.worker.transient import is_transient

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
    crashes = ShardCrashes(repository.redis, repository.namespace, job_id, shard_index,
                           context.settings.crashes_before_split)
    with lease:
        # A shard that crashed its worker before runs alone there (worker/shards/shard_crashes.py)…
        history = crashes.history()
        gate = ENGINE_RUNS.alone(lambda: shutdown.stopping() or repository.is_cancel_requested(job_id)) \
            if history.split else nullcontext(True)
        with gate as holding:
            if not holding:
                if shutdown.stopping():
                    raise ShardHandedBack(f"job {job_id}: the worker is stopping")
                return {**summary, "status": "cancelled"}
            live = LiveProgress(repository.redis, job_id, repository.namespace)
            progress = ShardProgress(live, shard_index, lease.generation)
            # …and is counted as it starts: a crash leaves the count
            with crashes.delivery(), progress.of_this_run():
                return {**summary, **_run_holding_lease(context, job_id, shard_index, lease, send_finalize,
                                                        (crashes, history), progress)}


def _run_holding_lease(context: WorkerContext, job_id: str, shard_index: int, lease: ShardLease,
                       send_finalize: Callable[[str], None],
                       crashed: tuple[ShardCrashes, CrashHistory], progress: ShardProgress) -> dict[str, Any]:
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
            outputs, engine_facts, dimension = _infer(context, job_id, spec, plan[shard_index], timings,
                                               job.expires_at, crashed, lease.fence, progress)
        except JobCannotRun as error:
            fail_job(repository, job_id, str(error))
            metrics.record_shard(spec.model if spec is not None else "unknown", "failed")
            return {"status": "failed", "error": str(error)}
        except ShardHandedBack:
            metrics.record_shard(spec.model if spec is not None else "unknown", "handed_back")
            raise
        cancel = CancelCheck(repository, job_id)  # waits out a Redis outage instead of dropping the work
        if outputs is None or cancel.before_commit():
            return _stopped(job_id, shard_index, spec)
        progress.flush()  # every row is done: shown while the parts are written and committed
        # A run whose lease lapsed (a Redis outage, or this process stalled) still offers what it
        # computed: the write-once result decides. Another run's result already there: count that.
        standing = None if lease.held else committed_result(repository, layout, shard_index)
        if standing is not None:
            discard_exports(repository, layout, plan[shard_index], lease.fence)
            metrics.record_shard(spec.model, "skipped")
            count_shard(repository, layout, plan, standing, send_finalize, spec)
            return {"already_done": True, "status": "done", "rows": standing.rows,
                    "rows_failed": standing.rows_failed, "committed": False}
        try:
            with timings.phase("write"):
                # Asked again once the parts are staged: a job that failed (or was cancelled) while
                # they were written gets no result from this run, so nothing changes under a retry
                # cut from it.
                result = write_fenced(repository.store, layout, spec, plan[shard_index], outputs,
                                      fence=lease.fence, created=int(job.created_at.timestamp()),
                                      started_at=started_at, dtype=engine_facts.dtype,
                                      quantization=engine_facts.quantization,
                                      may_commit=lambda: not cancel.before_commit(),
                                      embedding_dimension=dimension)
        except CommitRefused:
            return _stopped(job_id, shard_index, spec)
        summary["committed"] = result.fence == lease.fence  # False: another run's result won
        if not summary["committed"]:
            discard_exports(repository, layout, plan[shard_index], lease.fence)
        else:  # what the model's answers measure, for planning rows that set no max_tokens
            record_natural_lengths(repository.redis, repository.namespace, spec.model,
                                   NaturalLengths.of(outputs))
        metrics.record_shard(spec.model, "done", result)
        summary["seconds"] = timings.rounded()
        logger.info("job %s shard %d: %d rows (%d failed), %d prompt / %d cached / %d completion tokens; "
                    "seconds %s", job_id, shard_index, result.rows, result.rows_failed, result.usage.prompt,
                    result.usage.cached, result.usage.completion, summary["seconds"])
    count_shard(repository, layout, plan, result, send_finalize, spec)
    return {**summary, "status": "done", "rows": result.rows, "rows_failed": result.rows_failed}


def _stopped(job_id: str, shard_index: int, spec: JobSpec) -> dict[str, Any]:
    """The job was cancelled, or failed, while the shard ran: nothing of it is committed."""
    logger.info("job %s shard %d stopped (the job was cancelled or failed); nothing written", job_id,
                shard_index)
    metrics.record_shard(spec.model, "cancelled")
    return {"status": "cancelled"}


def committed_result(repository: JobRepository, layout: JobLayout, shard_index: int) -> ShardResult | None:
    return committed_shard_result(repository.store, layout, shard_index)


def _infer(context: WorkerContext, job_id: str, spec: JobSpec, shard: ShardPlan, timings: PhaseTimings,
           expires_at: datetime | None, crashed: tuple[ShardCrashes, CrashHistory], fence: str,
           progress: ShardProgress) -> tuple[list[OutputRow] | None, EngineFacts, int | None]:
    """Every row's outcome in input order (None when the job was cancelled meanwhile; rows still
    running at `expires_at` come back `expired`), the dtype the engine computed them in and its
    weights' quantization, and, for an embed job, the vectors' size.
    `fence`: this run's fencing token, under which it writes its exports."""
    history = crashed[1]
    if history.outside_pieces >= history.split_after:
        raise JobCannotRun(f"shard {shard.index} killed its worker process {history.whole} times, "
                           f"{history.outside_pieces} of them outside its rows' runs (reading the input or "
                           "writing the parts): see the worker's log")
    try:
        with timings.phase("model"):
            hosted = context.hosts.get(spec.model, embed=spec.is_embed)
    except Exception as error:  # noqa: BLE001 - unknown model, files missing, tokenizer unreadable…
        if is_transient(error):  # …but not a store that is down for a moment
            raise
        raise JobCannotRun(f"cannot load model {spec.model!r}: {error}") from error
    _check_task(spec, hosted, timings)
    with timings.phase("engine"):  # rows are read as the engine drains them (worker/hosts/row_window.py)
        items = limit_schemas_streamed(context.repository.redis, context.repository.namespace, job_id,
                                       stream_rows(context, spec, shard),
                                       context.settings.max_schemas_per_job)
        outputs = _outcomes(context, hosted, job_id, spec, shard, items, expires_at, crashed, fence, progress)
    choice = hosted.host.dtype_choice
    facts = EngineFacts(choice.dtype if choice else None, getattr(hosted.host, "quantization", None))
    return outputs, facts, embedding_dimension(spec, hosted)


@dataclass(frozen=True)
class EngineFacts:
    """What a shard's result says of the engine that ran it."""

    dtype: str | None
    quantization: str | None  # the checkpoint's scheme, e.g. "compressed-tensors W4A16 int4 (...)"


def _check_task(spec: JobSpec, hosted: HostedModel, timings: PhaseTimings) -> None:
    """`JobCannotRun` when the model cannot do the job's task (an embed job's `dimensions`, `pooling`
    and `max_length` are checked once the embedding model is loaded: every row would fail the same way)."""
    problem = task_problem(spec, hosted)
    loaded_checks = (spec.dimensions, spec.pooling, spec.max_length)
    if problem is None and spec.is_embed and any(value is not None for value in loaded_checks):
        try:
            with timings.phase("model"):
                hosted.host.wait_ready()
        except EngineUnavailable as error:
            raise JobCannotRun(f"model {hosted.name!r} is unavailable on this worker: {error}") from error
        problem = task_problem(spec, hosted)
    if problem is not None:
        raise JobCannotRun(problem)


def _outcomes(context: WorkerContext, hosted: HostedModel, job_id: str, spec: JobSpec, shard: ShardPlan,
              items: Iterator[Row | RowError], expires_at: datetime | None,
              crashed: tuple[ShardCrashes, CrashHistory], fence: str,
              progress: ShardProgress) -> list[OutputRow] | None:
    """Every row's outcome in input order: the shard's own rows from the engine (read as it drains
    them), then the rows it copies from earlier shards (jobs/planning/job_dedup.py), with its exports written
    for later ones. Only the copies' rows are kept until the end, except in a shard that crashed its
    worker before: that one holds its rows and runs them in pieces, each alone
    (worker/shards/shard_crashes.py)."""
    repository = context.repository
    layout = repository.layout(job_id)
    crashes, history = crashed
    settings = context.settings
    cache_salt = prefix_cache_salt(spec.tenant, settings.share_prefix_cache_across_tenants)
    priority = settings.job_priority(spec)  # capped for its tenant, as the fair queue has it
    cancel = CancelCheck(repository, job_id)  # a Redis outage meanwhile does not stop the rows

    def should_stop() -> bool:
        return shutdown.stopping() or cancel.while_running()

    # Rows' images are read under the job's tenant rules (an upload is its own tenant's to name).
    images = job_image_fetcher(settings, spec, upload_owner=lambda owner: repository.get_spec(owner).tenant)

    def on_engine(rows: Iterable[Row | RowError]) -> list[OutputRow] | None:
        expires_in_s = None if expires_at is None else (expires_at - datetime.now(UTC)).total_seconds()
        with images:
            return _run_on_engine(context, hosted, job_id, rows, priority=MAX_JOB_PRIORITY - priority,
                                  deduplicate=spec.deduplicate, expires_in_s=expires_in_s,
                                  cache_salt=cache_salt, should_stop=should_stop, alone=history.split,
                                  progress=progress, images=images)

    copy_items: dict[int, Row | RowError] = {}
    if history.split:
        held = list(items)
        copy_items.update((position, held[position]) for position in shard.copies if position < len(held))

        def run_alone(members: list[int]) -> dict[int, OutputRow] | None:
            return _keyed(members, on_engine([held[member] for member in members]))

        def run(positions: list[int]) -> dict[int, OutputRow] | None:
            return run_split(held, positions, history, crashes, run_alone)

        outcomes = run([position for position in range(len(held)) if position not in shard.copies])
    else:
        own_positions: list[int] = []

        def own_rows() -> Iterator[Row | RowError]:
            for position, item in enumerate(items):
                if position in shard.copies:
                    copy_items[position] = item
                else:
                    own_positions.append(position)
                    yield item

        def run(positions: list[int]) -> dict[int, OutputRow] | None:
            return _keyed(positions, on_engine([copy_items[position] for position in positions]))

        own = on_engine(own_rows())
        outcomes = None if own is None else _keyed(own_positions, own)
    if outcomes is None:
        return None
    write_exports(repository, layout, shard, outcomes, fence)
    if shard.copies:
        try:
            copied, compute = copy_rows(repository, layout, shard, copy_items, expires_at=expires_at,
                                        should_stop=should_stop)
        except Stopped:
            if shutdown.stopping():
                raise ShardHandedBack(f"job {job_id}: the worker is stopping") from None
            return None
        progress.update(copied.values())
        computed = run(compute) if compute else {}
        if computed is None:
            return None
        outcomes.update(copied)
        outcomes.update(computed)
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


def _keyed(positions: Sequence[int], outputs: list[OutputRow] | None) -> dict[int, OutputRow] | None:
    return None if outputs is None else dict(zip(positions, outputs, strict=True))


def _run_on_engine(context: WorkerContext, hosted: HostedModel, job_id: str, items: Iterable[Row | RowError],
                   priority: int, deduplicate: bool, expires_in_s: float | None,
                   cache_salt: str | None, should_stop: Callable[[], bool],
                   alone: bool = False, progress: ShardProgress | None = None,
                   images: ImageFetcher | None = None) -> list[OutputRow] | None:
    """Every row's outcome in input order; None if `should_stop()` said to stop while its rows ran.
    Raises `ShardHandedBack` when the worker began to stop meanwhile (worker/process/shutdown.py).
    `alone`: the caller holds the process's engines alone (worker/shards/exclusive_runs.py)."""
    try:
        with nullcontext() if alone else ENGINE_RUNS.together():
            # killing_on_marker: off unless a test turned it on (worker/shards/fault_injection.py)
            outputs = run_rows(hosted, killing_on_marker(items), priority, poll_s=CANCEL_POLL_S,
                               deduplicate=deduplicate, expires_in_s=expires_in_s,
                               window_rows=context.settings.shard_window_rows, cache_salt=cache_salt,
                               should_stop=should_stop, progress=progress, images=images)
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
    spec = spec or repository.get_spec(layout.job_id)
    usage = shard_usage_entry(repository.namespace, spec.tenant, spec.model, result)
    try:
        counters.apply_shard(result, usage)  # counts it and adds its usage in one step, once
    except CountersMissing:  # Redis lost them (its usage buckets too): rebuild from the shard results
        counters.rebuild_from_store(repository.store, layout, plan)
    snapshot = counters.read()
    if snapshot.shards.done >= snapshot.shards.total:
        send_finalize(layout.job_id)
