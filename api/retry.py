"""`POST /jobs/{id}/retry`: a job over the rows of an ended job that failed or never ran, and the
merged rows of such a chain (`GET /jobs/{id}/results/merged`)."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from api.dependencies import ApiContext
from api.results import part_store, parts_published
from api.submission import check_in_flight, check_model, claim_output, create_and_enqueue
from jobs.formats.jsonl_writer import dumps_line
from jobs.merge import MergedChain, load_chain, merged_records
from jobs.repository import new_job_id
from jobs.retry import check_retryable, retry_plan
from jobs.status import JobStatus

MERGED_BATCH_ROWS = 256


class RetryRequest(BaseModel):
    """The body of `POST /jobs/{id}/retry` (optional: an empty body retries every failed row)."""

    model_config = ConfigDict(extra="forbid")

    error_codes: list[str] | None = Field(None, min_length=1, description="only rows that failed with one of "
                                          "these codes (not_run: rows that never ran); default: all of them")
    idempotency_key: str | None = Field(None, min_length=1, max_length=256,
                                        description="the same key returns the retry made with it")


def retry_job(context: ApiContext, parent: JobStatus, request: RetryRequest) -> JobStatus:
    """Create and queue the retry job (its plan saved before it is queued, so the planner keeps it)."""
    repository = context.repository
    check_retryable(parent)
    plan = retry_plan(repository, parent.job_id, request.error_codes)  # NothingToRetry: 409
    spec = repository.get_spec(parent.job_id)
    changes: dict[str, object] = {"parent_job_id": parent.job_id, "retry_error_codes": request.error_codes,
                                  "idempotency_key": request.idempotency_key}
    provisional = spec.model_copy(update=changes)
    job_id = repository.job_id_for(provisional) if request.idempotency_key else new_job_id()
    if spec.output_uri:  # the parent's folder is the parent's: the retry's parts go in a folder of their own
        changes["output_uri"] = f"{spec.output_uri.rstrip('/')}/retry-{job_id}/"
    child = spec.model_copy(update=changes)
    check_model(context, child)
    check_in_flight(context, child, job_id)
    claim_output(context, child, job_id)
    if plan is not None:
        plan = repository.save_plan(job_id, plan)
        repository.counters(job_id).initialize(plan)  # the answer already counts the rows to retry
    return create_and_enqueue(context, child, job_id)


def merged_chain(context: ApiContext, job_id: str) -> MergedChain:
    return load_chain(context.repository, job_id, lambda result: parts_published(context, result))


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
