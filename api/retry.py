"""`POST /jobs/{id}/retry`: a job over the rows of an ended job that failed or never ran, and the
merged rows of such a chain (`GET /jobs/{id}/results/merged`)."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.results import part_store, parts_published
from bulkinfer.api.submission import check_in_flight, check_model, claimed_output, enqueue_created
from bulkinfer.jobs.formats.jsonl_writer import dumps_line
from bulkinfer.jobs.planning.retry import check_retryable, retry_plan
from bulkinfer.jobs.state.merge import MergedChain, chain_of, load_chain, merged_records
from bulkinfer.jobs.state.repository import JobNotFound
from bulkinfer.jobs.state.status import JobState, JobStatus

MERGED_BATCH_ROWS = 256


class RetryRequest(BaseModel):
    """The body of `POST /jobs/{id}/retry` (optional: an empty body retries every failed row)."""

    model_config = ConfigDict(extra="forbid")

    error_codes: list[str] | None = Field(None, min_length=1, description="only rows that failed with one of "
                                          "these codes (not_run: rows that never ran); default: all of them")
    idempotency_key: str | None = Field(None, min_length=1, max_length=256,
                                        description="the same key returns the retry made with it")


def retry_job(context: ApiContext, parent: JobStatus, request: RetryRequest) -> JobStatus:
    """Create the retry job, then save its plan, then queue it (so the planner keeps the plan).

    Its id comes from the retry's own idempotency key space (jobs/state/repository.py), and job.json is
    written (once) before the plan: a key that names some other job is a 409 before anything of that
    job is touched, and the same retry asked again finds its job and plan as they are."""
    repository = context.repository
    check_retryable(parent)
    plan = retry_plan(repository, parent.job_id, request.error_codes)  # NothingToRetry: 409
    spec = repository.get_spec(parent.job_id)
    changes: dict[str, object] = {"parent_job_id": parent.job_id, "retry_error_codes": request.error_codes,
                                  "idempotency_key": request.idempotency_key}
    job_id = repository.job_id_for(spec.model_copy(update=changes))
    if spec.output_uri:  # the parent's folder is the parent's: the retry's parts go in a folder of their own
        changes["output_uri"] = f"{spec.output_uri.rstrip('/')}/retry-{job_id}/"
    child = spec.model_copy(update=changes)
    check_model(context, child)
    check_in_flight(context, child, job_id)
    with claimed_output(context, child, job_id):  # released if the retry job is not created
        created = repository.create(child, job_id=job_id)  # IdempotencyConflict: 409, nothing else written
        if plan is not None and created.state == JobState.QUEUED:
            plan = repository.save_plan(job_id, plan)  # write-once: a planner that got there first stands
            repository.counters(job_id).initialize(plan)  # the answer already counts the rows to retry
        return enqueue_created(context, repository.get(job_id))


def merged_chain(context: ApiContext, caller: Caller, job_id: str) -> MergedChain:
    """The chain to merge, checked whole before a byte is sent: every job in it the caller's (a
    chain reaching another tenant's job is not found, as that job would be), and its parts lining up
    (`MergeError`: 409)."""
    repository = context.repository
    for chain_id in chain_of(repository, job_id):
        if not caller.sees(repository.get_spec(chain_id).tenant):
            raise JobNotFound(job_id)
    return load_chain(repository, job_id, lambda result: parts_published(context, result))


def stream_merged(context: ApiContext, chain: MergedChain) -> Iterator[bytes]:
    """The merged rows as JSON lines, a batch of lines per write."""
    batch: list[bytes] = []
    for record in merged_records(context.repository, chain, lambda part: part_store(context, part.uri)):
        batch.append(dumps_line(record))
        if len(batch) == MERGED_BATCH_ROWS:
            yield b"".join(batch)
            batch = []
    if batch:
        yield b"".join(batch)
