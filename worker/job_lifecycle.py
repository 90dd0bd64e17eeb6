"""Planning a job, failing it with a reason, and finalizing it: the control-queue work.

Each function is safe to run twice (Celery may deliver a task again): plans are written once,
transitions already made are no-ops, and the manifest is built from shard results alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from jobs.formats.detect import resolve_spec
from jobs.manifest import IncompleteJob, build_manifest, write_manifest
from jobs.models import UnknownModel
from jobs.object_store.factory import store_for_uri
from jobs.repository import JobRepository
from jobs.results import load_shard_results
from jobs.sharding import ShardPlan, plan_shards
from jobs.spec import JobSpec
from jobs.status import IllegalTransition, JobState
from worker.context import WorkerContext
from worker.prompts import job_response_format_problem
from worker.transient import is_transient

logger = logging.getLogger(__name__)

SendShard = Callable[[str, int, str], None]  # (job_id, shard_index, queue)


class JobCannotRun(Exception):
    """The job can never succeed (input unreadable, model unknown); the message is for the user."""


def fail_job(repository: JobRepository, job_id: str, message: str) -> None:
    """Move the job to `failed` with `message`, unless it already ended (e.g. it was cancelled)."""
    logger.warning("job %s failed: %s", job_id, message)
    try:
        repository.transition(job_id, JobState.FAILED, error=message)
    except IllegalTransition:
        pass


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


def plan_job(context: WorkerContext, job_id: str, send_shard: SendShard) -> dict[str, Any]:
    """Plan shards, save the plan, start the counters, `queued → running`, send one task per shard."""
    repository = context.repository
    status = repository.get(job_id)
    if status.state.is_terminal or repository.is_cancel_requested(job_id):
        return {"job_id": job_id, "status": f"skipped: job is {status.state.value}"}
    spec = repository.get_spec(job_id)
    try:
        queue = context.registry.queue_for(spec.model)
        _check_response_format(spec)
        plan = _plan(context, resolved_spec(context, spec))
    except (UnknownModel, JobCannotRun) as error:
        fail_job(repository, job_id, str(error))
        return {"job_id": job_id, "status": "failed", "error": str(error)}
    plan = repository.save_plan(job_id, plan)  # a second planner gets the first plan back
    repository.counters(job_id).initialize(plan)
    try:
        repository.transition(job_id, JobState.RUNNING)
    except IllegalTransition:  # cancelled or failed while we planned
        return {"job_id": job_id, "status": "skipped: job ended while planning"}
    for shard in plan:
        send_shard(job_id, shard.index, queue)
    logger.info("job %s planned: %d shard(s) on %s", job_id, len(plan), queue)
    return {"job_id": job_id, "status": "planned", "shards": len(plan)}


def _check_response_format(spec: JobSpec) -> None:
    """A job-wide schema that cannot compile fails the job once, instead of every row."""
    problem = job_response_format_problem(spec)
    if problem is not None:
        raise JobCannotRun(problem)


def _plan(context: WorkerContext, spec: JobSpec) -> Sequence[ShardPlan]:
    store, key = store_for_uri(spec.input_uri, endpoint_url=context.settings.s3_endpoint_url)
    with _input_errors_fail_the_job(spec.input_uri):
        return plan_shards(store, key, spec)


def finalize_job(context: WorkerContext, job_id: str) -> dict[str, Any]:
    """`running → finalizing`, write manifest.json, `→ succeeded`. Running it again changes nothing."""
    repository = context.repository
    status = repository.get(job_id)
    if status.state.is_terminal:
        return {"job_id": job_id, "status": f"skipped: job is {status.state.value}"}
    spec = repository.get_spec(job_id)
    layout = repository.layout(job_id)
    plan = repository.load_plan(job_id)
    output_format = resolved_spec(context, spec).effective_output_format
    try:
        manifest = build_manifest(job_id, spec.spec_hash(), str(output_format), len(plan),
                                  load_shard_results(repository.store, layout))
    except IncompleteJob as error:  # sent early (by hand, or a stale redelivery): a later shard resends
        return {"job_id": job_id, "status": f"waiting: {error}"}
    try:
        repository.transition(job_id, JobState.FINALIZING)
        write_manifest(repository.store, layout, manifest)
        repository.transition(job_id, JobState.SUCCEEDED)
    except IllegalTransition:  # cancelled meanwhile: the parts stay, the job stays cancelled
        return {"job_id": job_id, "status": "skipped: job ended while finalizing"}
    logger.info("job %s succeeded: %d rows (%d failed)", job_id, manifest.rows.total, manifest.rows.failed)
    return {"job_id": job_id, "status": "succeeded", "rows": manifest.rows.total}
