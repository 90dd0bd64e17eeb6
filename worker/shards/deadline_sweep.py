"""The expiry sweep: jobs whose completion_window passed end within a reaper tick, not when their
last shard finally reaches a worker.

Each reaper tick looks at the jobs whose deadline is due (jobs/deadlines.py):
- a `queued` job (never planned: no row ran) becomes `expired` at once;
- in a `running` job, every shard with no result whose lease no run holds is written now with
  each of its rows an `expired` row error (read from the input, so each row keeps its id), under
  that shard's lease, as a run would write it; a shard a run holds expires its own rows within a
  poll (worker/hosts/engine_rows.py). The last shard counted sends finalize, which ends the job `expired`
  with its finished rows, manifest and webhook. An embed job's expired parts have the job's vector
  column type, the size read from the model's checkpoint (worker/models/embedding_size.py).
A shard task still waiting in a queue later finds its result and only counts it (once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from bulkinfer.jobs.deadlines import due_jobs, forget_deadline
from bulkinfer.jobs.formats.output import expired_row
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.part_publication import write_fenced
from bulkinfer.jobs.state.repository import JobNotFound
from bulkinfer.jobs.state.status import IllegalTransition, JobState, JobStatus
from bulkinfer.worker.models.embedding_size import job_vector_size
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards.job_lifecycle import JobCannotRun, fail_job, resolved_spec
from bulkinfer.worker.shards.shard_lease import ShardLease
from bulkinfer.worker.shards.shard_runner import committed_result, count_shard, read_rows

logger = logging.getLogger(__name__)

SendJobStep = Callable[[str], None]
Notify = Callable[[str], object]  # starts a job's webhook (whatever it returns is not used)


def expire_due(context: WorkerContext, send_finalize: SendJobStep, notify: Notify,
               now: datetime | None = None) -> list[tuple[str, int]]:
    """One pass over the jobs whose deadline passed; returns the (job, shard) pairs it expired.
    `notify(job_id)` starts the webhook of a job this pass ended."""
    repository = context.repository
    now = now or datetime.now(UTC)
    expired: list[tuple[str, int]] = []
    for job_id in due_jobs(repository.redis, repository.namespace, now):
        try:
            status = repository.get(job_id)
        except JobNotFound:
            status = None
        if status is None or status.state.is_terminal:
            forget_deadline(repository.redis, repository.namespace, job_id)
            continue
        try:
            if status.state == JobState.QUEUED:
                _expire_unplanned(context, status, notify)
            elif status.state == JobState.RUNNING:
                expired += [(job_id, index) for index in _expire_shards(context, status, send_finalize, now)]
        except Exception:  # noqa: BLE001 - one odd job must not stop the others
            logger.exception("expiry sweep: job %s skipped", job_id)
    return expired


def _expire_unplanned(context: WorkerContext, status: JobStatus, notify: Notify) -> None:
    repository = context.repository
    try:
        repository.transition(status.job_id, JobState.EXPIRED)
    except IllegalTransition:  # planned meanwhile: the next pass treats it as running
        return
    forget_deadline(repository.redis, repository.namespace, status.job_id)
    logger.warning("job %s expired before it was planned: its completion_window passed at %s",
                   status.job_id, status.expires_at)
    notify(status.job_id)


def _expire_shards(context: WorkerContext, status: JobStatus, send_finalize: SendJobStep,
                   now: datetime) -> list[int]:
    repository = context.repository
    job_id = status.job_id
    try:
        plan = repository.load_plan(job_id)
    except ObjectNotFound:
        return []  # the planner is saving it now: the next pass sees it
    spec = resolved_spec(context, repository.get_spec(job_id))
    layout = repository.layout(job_id)
    expired = []
    vector_size: int | None = None  # an embed job's, read when a shard of it is expired here
    for shard in plan:
        if repository.store.exists(layout.shard_result_key(shard.index)):
            continue
        lease = ShardLease(repository.redis, job_id, shard.index, ttl_s=context.settings.lease_ttl,
                           namespace=repository.namespace)
        if not lease.acquire(give_up=lambda: True):
            continue  # a run holds it: it expires its own rows
        with lease:
            if committed_result(repository, layout, shard.index) is not None:
                continue
            outputs = [expired_row(item) for item in _rows(context, job_id, spec, shard)]
            if vector_size is None:
                vector_size = _vector_size(context, spec)
            result = write_fenced(repository.store, layout, spec, shard, outputs, fence=lease.fence,
                                  created=int(status.created_at.timestamp()), started_at=now,
                                  embedding_dimension=vector_size)
        count_shard(repository, layout, plan, result, send_finalize, spec)
        expired.append(shard.index)
    if expired:
        logger.warning("job %s: completion_window passed; %d shard(s) that had not started written as "
                       "expired", job_id, len(expired))
    return expired


def _rows(context: WorkerContext, job_id: str, spec: JobSpec, shard: ShardPlan) -> list[Row | RowError]:
    try:
        return read_rows(context, spec, shard)
    except JobCannotRun as error:
        fail_job(context.repository, job_id, f"its completion_window passed and it {error}")
        raise


def _vector_size(context: WorkerContext, spec: JobSpec) -> int | None:
    """An embed job's vector size for its expired parts; None (a plain float-list column) only when
    the model's files cannot be had now: the job still ends at its deadline."""
    if not spec.is_embed:
        return None
    settings = context.settings
    try:
        return job_vector_size(spec, context.registry.location(spec.model), settings.model_cache_dir,
                               endpoint_url=settings.s3_endpoint_url)
    except Exception:  # noqa: BLE001 - an unknown or unreachable model must not keep the job running
        logger.exception("expiry sweep: the vector size of model %s is unknown; its expired parts hold "
                         "a float-list column", spec.model)
        return None
