"""The job routes: submit, read, list, cancel and fetch results."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from bulkinfer.api.auth import Caller, CallerDep
from bulkinfer.api.body_limit import IN_LOOP_CHECK_BYTES
from bulkinfer.api.dependencies import ApiContext, Context
from bulkinfer.api.errors import HttpError
from bulkinfer.api.results import finished_manifest, job_results, stream_rows
from bulkinfer.api.retry import RetryRequest, merged_chain, retry_job, stream_merged
from bulkinfer.api.schemas import ERROR_RESPONSES, JobPage, JobResults
from bulkinfer.api.submission import parse_spec, submit_spec
from bulkinfer.api.upload import FILE_FIELD, SPEC_FIELD, submit_upload
from bulkinfer.jobs.layout import JOB_ID_PATTERN
from bulkinfer.jobs.names import CONTROL_QUEUE, DELIVER_WEBHOOK
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.repository import JobNotFound
from bulkinfer.jobs.state.status import COMPLETED_STATES, JobState, JobStatus
from bulkinfer.jobs.webhook_claims import claim_delivery

MAX_JSON_BODY_BYTES = 1 << 20
CURSOR_PATTERN = r"^\d{17}:[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"

router = APIRouter(tags=["jobs"], responses=ERROR_RESPONSES)

SUBMIT_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
        "multipart/form-data": {"schema": {
            "type": "object", "required": [SPEC_FIELD, FILE_FIELD],
            "properties": {
                SPEC_FIELD: {"type": "string", "contentMediaType": "application/json",
                             "description": "the JobSpec as JSON, without input_uri; send it before "
                                            "the file"},
                FILE_FIELD: {"type": "string", "format": "binary", "description": "the input rows: "
                             "Parquet, JSONL, OpenAI-batch JSONL, CSV or TSV (by its name's extension); "
                             "streamed to the job's folder"}}}},
    },
}


def _known_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.match(job_id):
        raise JobNotFound(job_id)
    return job_id


async def _read_json_body(request: Request) -> object:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BODY_BYTES:
            raise HttpError(413, f"a JSON job spec must be under {MAX_JSON_BODY_BYTES} bytes; upload rows as "
                                "a file (multipart) or reference them by input_uri")
    try:  # a big one parsed off the event loop, as the body check before it was (api/body_limit.py)
        if len(body) <= IN_LOOP_CHECK_BYTES:
            return json.loads(body)
        return await run_in_threadpool(json.loads, body)
    except ValueError as error:
        raise HttpError(422, f"the body is not JSON: {error}") from None


@router.post("/jobs", status_code=201, response_model=JobStatus, summary="Submit a job",
             openapi_extra={"requestBody": SUBMIT_BODY},
             responses={200: {"model": JobEstimate, "description": "a dry run's estimate (nothing created)"}})
async def create_job(request: Request, context: Context, caller: CallerDep) -> JobStatus | JSONResponse:
    """A JobSpec as JSON whose `input_uri` names an `s3://` object or a file in the local store;
    or multipart with the spec and the input file. The job is validated against the head of its
    input, created, and queued for planning. The same `idempotency_key` and spec return the same job.
    With `"dry_run": true`, the same checks, then 200 with an estimate (rows, tokens, run time)
    instead of a job.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        return _answer(await submit_upload(context, request, caller.tenant))
    if content_type in ("application/json", ""):
        spec = parse_spec(await _read_json_body(request)).model_copy(update={"tenant": caller.tenant})
        return _answer(await run_in_threadpool(submit_spec, context, spec))
    raise HttpError(415, f"unsupported content type {content_type!r}: send the spec as application/json, "
                        f"or multipart/form-data with {SPEC_FIELD!r} and {FILE_FIELD!r}")


def _answer(outcome: JobStatus | JobEstimate) -> JobStatus | JSONResponse:
    if isinstance(outcome, JobEstimate):
        return JSONResponse(outcome.model_dump(mode="json"), status_code=200)
    return outcome


@router.get("/jobs", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(context: Context, caller: CallerDep, status: JobState | None = None,
              cursor: Annotated[str | None, Query(pattern=CURSOR_PATTERN)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> JobPage:
    """The caller's tenant's jobs (an admin key: every tenant's)."""
    jobs, next_cursor = context.repository.list(state=status, cursor=cursor, limit=limit, tenant=caller.scope)
    return JobPage(jobs=jobs, next_cursor=next_cursor)


def owned_job(context: ApiContext, caller: Caller, job_id: str) -> JobStatus:
    """The job, if the caller may see it; another tenant's job is not found, as if it did not exist."""
    status = context.repository.get(_known_id(job_id))
    if not caller.sees(status.tenant):
        raise JobNotFound(job_id)
    return status


@router.get("/jobs/{job_id}", response_model=JobStatus, summary="A job's state, counts and usage")
def get_job(job_id: str, context: Context, caller: CallerDep) -> JobStatus:
    return owned_job(context, caller, job_id)


@router.get("/jobs/{job_id}/spec", response_model=JobSpec, summary="The spec the job runs (job.json)")
def get_job_spec(job_id: str, context: Context, caller: CallerDep) -> JobSpec:
    owned_job(context, caller, job_id)
    return context.repository.get_spec(job_id)


@router.post("/jobs/{job_id}/cancel", response_model=JobStatus, summary="Cancel a job")
def cancel_job(job_id: str, context: Context, caller: CallerDep) -> JobStatus:
    """Cancelling a cancelled job is a no-op; a job that already succeeded or failed answers 409."""
    owned_job(context, caller, job_id)
    status = context.repository.request_cancel(job_id)
    if status.state != JobState.CANCELLED:
        raise HttpError(409, f"job {job_id} already {status.state.value}; there is nothing to cancel")
    # The job may sit behind other work (or on a model no worker serves): its webhook goes now.
    if claim_delivery(context.repository, job_id):
        context.tasks.send(DELIVER_WEBHOOK, [job_id], CONTROL_QUEUE)
    return status


@router.post("/jobs/{job_id}/retry", status_code=201, response_model=JobStatus,
             summary="Run a job's failed rows again")
def retry(job_id: str, context: Context, caller: CallerDep,
          body: Annotated[RetryRequest | None, Body()] = None) -> JobStatus:
    """A new job (its `parent_job_id` this one) over the rows of this ended job that failed, expired or
    never ran, with the same spec; `error_codes` narrows it to rows that failed with those codes
    (`not_run`: rows that never ran); no body retries every such row. 409 while the job has not
    ended, or when nothing qualifies."""
    parent = owned_job(context, caller, job_id)
    return retry_job(context, parent, body or RetryRequest())


@router.get("/jobs/{job_id}/results/merged", summary="One row per input row across a retry chain",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}}, "description": "the merged rows"}})
def get_merged_results(job_id: str, context: Context, caller: CallerDep) -> StreamingResponse:
    """Every input row once, in input order, across this job and the jobs it retried
    (`parent_job_id`, back to the first): the latest success, else the latest error, as JSON lines.
    Rows of shards no job in the chain has finished are left out; `X-Bulkinfer-Missing-Shards` says
    how many such shards there are (0: every row is there)."""
    owned_job(context, caller, job_id)
    chain = merged_chain(context, caller, job_id)
    headers = {"Content-Disposition": f'attachment; filename="{job_id}-merged.jsonl"',
               "X-Bulkinfer-Chain": ",".join(chain.job_ids), "X-Bulkinfer-Missing-Shards": str(chain.missing)}
    return StreamingResponse(stream_merged(context, chain), media_type="application/x-ndjson",
                             headers=headers)


@router.get("/jobs/{job_id}/results", response_model=JobResults, summary="A job's output",
            responses={200: {"content": {"application/x-ndjson": {}}, "description":
                             "the part list; with ?download=true, every output row as JSON lines"}})
def get_results(job_id: str, context: Context, caller: CallerDep, download: bool = False,
                partial: bool = False) -> JobResults | StreamingResponse:
    """The output parts with presigned URLs; `?download=true` streams every row, in input order,
    as JSON lines (Parquet parts are converted). A job that has not succeeded answers 409, unless
    `?partial=true`: then the parts of the shards finished so far (running, failed or cancelled
    jobs), marked `partial` (and, when downloading, an `X-Bulkinfer-Partial: true` header)."""
    status = owned_job(context, caller, job_id)
    if not download:
        return job_results(context, status, partial)
    manifest = finished_manifest(context, status, partial)
    headers = {"Content-Disposition": f'attachment; filename="{job_id}.jsonl"',
               "X-Bulkinfer-Partial": "false" if status.state in COMPLETED_STATES else "true"}
    return StreamingResponse(stream_rows(context, manifest), media_type="application/x-ndjson",
                             headers=headers)
