"""Planning a job, failing it with a reason, and finalizing it: the control-queue work.

Each function is safe to run twice (Celery may deliver a task again): plans are written once,
transitions already made are no-ops, and the manifest is built from shard results alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bulkinfer.jobs.deadlines import forget_deadline
from bulkinfer.jobs.formats.detect import resolve_spec
from bulkinfer.jobs.formats.rows import RowErrorCode
from bulkinfer.jobs.layout import JobLayout, output_location
from bulkinfer.jobs.limits import plan_limit_problems
from bulkinfer.jobs.model_registry import UnknownModel
from bulkinfer.jobs.names import dispatched_key, step_lease_key
from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.output_tokens import expected_output_tokens
from bulkinfer.jobs.planning.job_dedup import mark_copies
from bulkinfer.jobs.planning.retry import NothingToRetry, retry_plan
from bulkinfer.jobs.planning.shard_cost import plan_within_bounds
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.public_paths import public_text
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.manifest import IncompleteJob, build_manifest, write_manifest
from bulkinfer.jobs.state.part_publication import settle_staged
from bulkinfer.jobs.state.repository import JobNotFound, JobRepository
from bulkinfer.jobs.state.results import ShardResult, load_shard_results
from bulkinfer.jobs.state.status import IllegalTransition, JobState
from bulkinfer.worker.hosts.engine_rows import job_response_format_problem
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards.shard_lease import Lease
from bulkinfer.worker.transient import is_transient

logger = logging.getLogger(__name__)

SendShard = Callable[[str, int, str], None]  # (job_id, shard_index, queue)
DISPATCHED_TTL_S = 7 * 24 * 3600  # as long as Celery keeps task results


class JobCannotRun(Exception):
    """The job can never succeed (input unreadable, model unknown); the message is for the user."""


def fail_job(repository: JobRepository, job_id: str, message: str) -> None:
    """Move the job to `failed` with `message`, unless it already ended (e.g. it was cancelled), and
    stop its other running shards: one committing after a retry of the job was cut would change what
    the retry was cut from."""
    logger.warning("job %s failed: %s", job_id, message)
    try:  # the user reads it: their upload by its name, no path of the job store's own
        repository.transition(job_id, JobState.FAILED, error=public_text(message))
    except IllegalTransition:
        return
    repository.stop_running_shards(job_id)


def resolved_spec(context: WorkerContext, spec: JobSpec) -> JobSpec:
    """The spec with its input format detected when the submitter left it out."""
    if spec.input_format is not None and spec.effective_output_format is not None:
        return spec
    store, key = store_for_uri(spec.input_uri, endpoint_url=context.settings.s3_endpoint_url)
    with _input_errors_fail_the_job(spec.input_uri):
        return resolve_spec(spec, store, key)


@contextmanager
def _input_errors_fail_the_job(input_uri: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any failure to read the input fails the job…
        if is_transient(error):  # …unless the store is unreachable: the task retries
            raise
        raise JobCannotRun(f"cannot read the input {input_uri}: {error}") from error


def _step_lease(context: WorkerContext, job_id: str, step: str) -> Lease:
    repository = context.repository
    return Lease(repository.redis, step_lease_key(repository.namespace, job_id, step),
                 ttl_s=context.settings.lease_ttl)


def plan_job(context: WorkerContext, job_id: str, send_shard: SendShard) -> dict[str, Any]:
    """Plan shards, save the plan, start the counters, `queued → running`, send one task per shard.

    One planner at a time (a lease). Run again on a job whose planner died (the reaper does that),
    it keeps the saved plan and sends the shards that have no result yet.
    """
    repository = context.repository
    status = repository.get(job_id)
    if status.state.is_terminal or repository.is_cancel_requested(job_id):
        return {"job_id": job_id, "status": f"skipped: job is {status.state.value}"}
    lease = _step_lease(context, job_id, "plan")
    if not lease.acquire(give_up=lambda: repository.is_cancel_requested(job_id)):
        return {"job_id": job_id, "status": "skipped: job is cancelled"}
    with lease:
        return {"job_id": job_id, **_plan_holding_lease(context, job_id, send_shard)}


def _plan_holding_lease(context: WorkerContext, job_id: str, send_shard: SendShard) -> dict[str, Any]:
    repository = context.repository
    status = repository.get(job_id)
    if status.state not in (JobState.QUEUED, JobState.RUNNING):
        return {"status": f"skipped: job is {status.state.value}"}
    dispatched = dispatched_key(repository.namespace, job_id)
    if status.state == JobState.RUNNING and repository.redis.exists(dispatched):
        return {"status": "skipped: already planned"}  # a duplicate plan message
    spec = repository.get_spec(job_id)
    try:
        queue = context.registry.queue_for(spec.model)
        plan = _saved_plan(repository, job_id)
        if plan is None:
            _check_response_format(spec)
            planned = _retry_plan(repository, spec) or _plan(context, resolved_spec(context, spec))
            _check_limits(context, planned, spec)
            plan = repository.save_plan(job_id, planned)
    except (UnknownModel, JobCannotRun) as error:
        fail_job(repository, job_id, str(error))
        return {"status": "failed", "error": str(error)}
    repository.counters(job_id).initialize(plan)
    try:
        repository.transition(job_id, JobState.RUNNING)
    except IllegalTransition:  # cancelled or failed while we planned
        return {"status": "skipped: job ended while planning"}
    layout = repository.layout(job_id)
    resuming = status.state == JobState.RUNNING  # an earlier planner died while sending
    sent = 0
    for shard in plan:
        if resuming and repository.store.exists(layout.shard_result_key(shard.index)):
            continue
        send_shard(job_id, shard.index, queue)
        sent += 1
    repository.redis.set(dispatched, 1, ex=DISPATCHED_TTL_S)
    logger.info("job %s planned: %d shard(s) on %s (%d sent)", job_id, len(plan), queue, sent)
    return {"status": "planned", "shards": len(plan), "sent": sent}


def _retry_plan(repository: JobRepository, spec: JobSpec) -> list[ShardPlan] | None:
    """A retry whose plan the API did not get to save: cut it from the parent again (the same cut,
    the parent having ended). None for a first job, or a parent that was never planned."""
    if spec.parent_job_id is None:
        return None
    try:
        parent_tenant = repository.get_spec(spec.parent_job_id).tenant
    except JobNotFound:
        parent_tenant = spec.tenant  # gone: retry_plan finds no plan and the whole input runs
    if parent_tenant != spec.tenant:  # a spec that got past the API's checks (stored before them)
        raise JobCannotRun(f"parent_job_id {spec.parent_job_id}: no such job of this tenant's")
    try:
        return retry_plan(repository, spec.parent_job_id, spec.retry_error_codes)
    except NothingToRetry as error:
        raise JobCannotRun(str(error)) from None


def _check_limits(context: WorkerContext, plan: Sequence[ShardPlan], spec: JobSpec) -> None:
    """The deployment's max_rows_per_job and max_shards_per_job: a job past them fails, saying so."""
    settings = context.settings
    problems = plan_limit_problems(settings, plan, min(spec.shard_size, settings.max_shard_size))
    if problems:
        raise JobCannotRun(problems[0])


def _saved_plan(repository: JobRepository, job_id: str) -> list[ShardPlan] | None:
    try:
        return repository.load_plan(job_id)
    except ObjectNotFound:
        return None


def _check_response_format(spec: JobSpec) -> None:
    """A job-wide schema that cannot compile fails the job once, instead of every row."""
    problem = job_response_format_problem(spec)
    if problem is not None:
        raise JobCannotRun(problem)


def _plan(context: WorkerContext, spec: JobSpec) -> Sequence[ShardPlan]:
    store, key = store_for_uri(spec.input_uri, endpoint_url=context.settings.s3_endpoint_url)
    repository = context.repository
    expected = expected_output_tokens(repository.redis, repository.namespace, spec.model,
                                      context.settings.output_estimate)
    with _input_errors_fail_the_job(spec.input_uri):
        return mark_copies(store, key, spec, plan_within_bounds(context.settings, store, key, spec, expected),
                           max_keys=context.settings.dedup_max_keys, registry=context.registry)


def finalize_job(context: WorkerContext, job_id: str) -> dict[str, Any]:
    """`running → finalizing`, write manifest.json, `→ succeeded`. Running it again changes nothing;
    one finalizer at a time (a lease); one that died is re-sent by the reaper."""
    repository = context.repository
    status = repository.get(job_id)
    if status.state.is_terminal:
        return {"job_id": job_id, "status": f"skipped: job is {status.state.value}"}
    lease = _step_lease(context, job_id, "finalize")
    if not lease.acquire(give_up=lambda: repository.is_cancel_requested(job_id)):
        return {"job_id": job_id, "status": "skipped: job is cancelled"}
    with lease:
        return {"job_id": job_id, **_finalize_holding_lease(context, job_id)}


def _finalize_holding_lease(context: WorkerContext, job_id: str) -> dict[str, Any]:
    repository = context.repository
    status = repository.get(job_id)
    if status.state.is_terminal:
        return {"status": f"skipped: job is {status.state.value}"}
    spec = repository.get_spec(job_id)
    layout = repository.layout(job_id)
    plan = repository.load_plan(job_id)
    resolved = resolved_spec(context, spec)
    results = load_shard_results(repository.store, layout)
    try:
        manifest = build_manifest(job_id, spec.spec_hash(), str(resolved.effective_output_format), len(plan),
                                  results)
    except IncompleteJob as error:
        if status.shards.done < len(plan):  # sent early (by hand, a stale redelivery): a later shard resends
            return {"status": f"waiting: {error}"}
        # Every shard was counted, yet a result is not there: retried, then the job fails saying so.
        raise
    # `finalizing` while the parts are merged and published, not only for the manifest's write: what
    # the batch APIs report as `finalizing` (with `finalizing_at`) between the last row and the end.
    try:
        if repository.transition(job_id, JobState.FINALIZING).state != JobState.FINALIZING:
            return {"status": "skipped: job ended while finalizing"}  # cancelled (or failed) meanwhile
    except IllegalTransition:
        return {"status": "skipped: job ended while finalizing"}
    _settle_staged_parts(context, resolved, layout, results)
    # A deadline that caught rows before they finished ends the job `expired`, with the rest of its rows.
    expired = sum(result.error_codes.get(RowErrorCode.EXPIRED.value, 0) for result in results)
    final = JobState.EXPIRED if expired else JobState.SUCCEEDED
    try:
        write_manifest(repository.store, layout, manifest)
        repository.transition(job_id, final)
    except IllegalTransition:  # cancelled meanwhile: the parts stay, the job stays cancelled
        return {"status": "skipped: job ended while finalizing"}
    forget_deadline(repository.redis, repository.namespace, job_id)
    _abort_unfinished_writes(context, resolved, layout)
    logger.info("job %s %s: %d rows (%d failed, %d of them expired)", job_id, final.value,
                manifest.rows.total, manifest.rows.failed, expired)
    return {"status": final.value, "rows": manifest.rows.total}


def _settle_staged_parts(context: WorkerContext, resolved: JobSpec, layout: JobLayout,
                         results: list[ShardResult]) -> None:
    """Every committed part published, every losing run's staged part gone, before the manifest."""
    store = context.repository.store
    location = output_location(resolved, store, layout)
    outputs = settle_staged(location.store, location.directory, results)
    errors = settle_staged(store, layout.errors_dir, results)
    published, deleted = outputs[0] + errors[0], outputs[1] + errors[1]
    if published or deleted:
        logger.info("job %s: published %d staged part(s), removed %d staged by runs that did not commit",
                    layout.job_id, published, deleted)


def _abort_unfinished_writes(context: WorkerContext, resolved: JobSpec, layout: JobLayout) -> None:
    """Multipart uploads (or temp files) a killed shard run left in the job's folders: nothing
    writes there once the manifest is in, so whatever is unfinished is garbage. In an output_uri
    folder only this job's own keys: a folder inside it (a retry's) is another job's, maybe running."""
    try:
        store = context.repository.store
        location = output_location(resolved, store, layout)
        removed = store.abort_unfinished_writes(layout.job_dir + "/")
        if location.store is not store or not location.directory.startswith(layout.job_dir):
            removed += location.store.abort_unfinished_writes(location.directory.rstrip("/") + "/",
                                                              only=location.holds_own)
    except Exception:  # noqa: BLE001 - the job has succeeded; leftovers are only storage
        logger.exception("job %s: could not clean up unfinished uploads", layout.job_id)
        return
    if removed:
        logger.info("job %s: aborted %d unfinished upload(s) left by killed runs", layout.job_id, removed)
