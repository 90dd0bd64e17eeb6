"""OpenAI's Batches API over our jobs: a batch is a job whose input is an uploaded file's copy.

Create checks the file's scan (api/v1/batch_lines.py: made once, at upload) the way OpenAI
validates a batch: a file with problems gives a `failed` batch with `errors.data[{code, line,
message, param}]` and no job. Otherwise the file is copied into the job's folder (deleting the file
later never breaks the batch) and a job with OpenAI-batch input and output runs it, with the
tenant, limits, deadlines, dedup and fair share of any job.

The batch's state is the job's, read live. Once the job has ended, its output rows are published
as two files (`batch_output`: the succeeded lines as the job wrote them; `batch_error`: the failed
ones, an expired row's code `batch_expired` as OpenAI writes it), once, with ids that derive from
the job, so every reader gets the same ones.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.submission import check_in_flight, create_and_enqueue, validate_input
from bulkinfer.api.v1.batch_lines import MAX_PROBLEMS, LineProblem
from bulkinfer.api.v1.batch_records import BatchRecord, BatchRecords, batch_id_for, new_job_id
from bulkinfer.api.v1.files import FileRecord, FileStore, not_found, owner_of
from bulkinfer.api.v1.job_outputs import output_records
from bulkinfer.jobs.formats.openai_batch import SUPPORTED_URLS
from bulkinfer.jobs.formats.openai_embeddings import EMBEDDINGS_URL
from bulkinfer.jobs.model_registry import UnknownModel
from bulkinfer.jobs.object_store.base import ObjectNotFound
from bulkinfer.jobs.spec import InputFormat, JobSpec, JobTask, metadata_within_limits, validation_messages
from bulkinfer.jobs.state.repository import JobNotFound
from bulkinfer.jobs.state.status import JobState, JobStatus

STATUS_OF = {JobState.QUEUED: "validating", JobState.RUNNING: "in_progress",
             JobState.FINALIZING: "finalizing", JobState.SUCCEEDED: "completed", JobState.EXPIRED: "expired",
             JobState.FAILED: "failed", JobState.CANCELLED: "cancelled"}
ENDED_AT_FIELD = {JobState.SUCCEEDED: "completed_at", JobState.EXPIRED: "expired_at",
                  JobState.FAILED: "failed_at", JobState.CANCELLED: "cancelled_at"}
ERROR_CODE_NAMES = {"expired": "batch_expired"}  # ours → OpenAI's, in the error file


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: str = Field(pattern="^created_at$")
    seconds: int = Field(ge=3600, le=30 * 86400)


class CreateBatch(BaseModel):
    """`POST /v1/batches`: what `client.batches.create(...)` sends."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(max_length=128)
    completion_window: str = Field("24h", max_length=32)
    metadata: dict[str, str] | None = None  # kept with the batch, so OpenAI's limits apply
    output_expires_after: OutputExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else metadata_within_limits(value)


def parse_create(body: object) -> CreateBatch:
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    try:
        return CreateBatch.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise HttpError(400, "invalid batch: " + "; ".join(validation_messages(error)), param=param,
                        code="invalid_request") from None


def create_batch(context: ApiContext, caller: Caller, request: CreateBatch) -> dict[str, Any]:
    if request.endpoint not in SUPPORTED_URLS:
        raise HttpError(400, f"endpoint {request.endpoint!r} is not served here; use one of "
                             f"{', '.join(SUPPORTED_URLS)}", param="endpoint", code="invalid_value")
    file = FileStore(context).get(caller, request.input_file_id)
    if file.purpose != "batch":
        raise HttpError(400, f"file {file.id} has purpose {file.purpose!r}; a batch's input file needs "
                             "purpose 'batch'", param="input_file_id", code="invalid_value")
    job_id = new_job_id()
    record = BatchRecord(id=batch_id_for("openai", job_id), api="openai", owner=owner_of(caller),
                         created_at=int(time.time()), endpoint=request.endpoint, input_file_id=file.id,
                         completion_window=request.completion_window, metadata=request.metadata,
                         output_expires_after_s=(request.output_expires_after.seconds
                                                 if request.output_expires_after else None))
    summary = file.batch_lines
    requests = summary.requests if summary else 0
    model, problems = _file_problems(context, file, request.endpoint)
    records = BatchRecords(context, "openai")
    if problems:
        record = record.model_copy(update={"errors": problems, "requests": requests, "model": model})
        records.put(record)
        return batch_object(context, record)
    spec = _job_spec(context, caller, request, file, job_id, model)
    status = create_and_enqueue(context, spec, job_id)
    record = record.model_copy(update={"job_id": status.job_id, "model": model, "requests": requests})
    records.put(record)
    return batch_object(context, record, status)


def _file_problems(context: ApiContext, file: FileRecord,
                   endpoint: str) -> tuple[str | None, list[LineProblem]]:
    """(the served model the lines name, what stops the file from running as a batch)."""
    summary = file.batch_lines
    if summary is None:
        return None, [LineProblem(code="invalid_file", line=0, message=f"file {file.id} was not read as "
                                  "batch input", param="input_file_id")]
    problems = list(summary.problems)
    for url, line in summary.urls.items():
        if url != endpoint:
            problems.append(LineProblem(code="mismatched_endpoint", line=line, param="url",
                                        message=f"the request's url {url!r} is not the batch's endpoint "
                                                f"{endpoint!r}"))
    # Each line's model names a served model, an alias, or a LoRA adapter registered on one: a batch
    # runs one base model, its lines each on the base or one of its adapters.
    model = None
    for name, line in sorted(summary.models.items(), key=lambda item: item[1]):
        try:
            base, _adapter = context.registry.resolve_requested(name)
        except UnknownModel as error:
            problems.append(LineProblem(code="model_not_found", line=line, param="body.model",
                                        message=str(error)))
            continue
        if model is None:
            model, first, first_line = base, name, line
        elif base != model:
            problems.append(LineProblem(code="mismatched_model", line=line, param="body.model",
                                        message=f"every request of a batch must use the same model (or its "
                                                f"LoRA adapters): line {first_line} uses {first!r} (model "
                                                f"{model!r}), line {line} uses {name!r} (model {base!r})"))
    # The first MAX_PROBLEMS by line: the batch object (returned by every listing) stays small.
    return model, sorted(problems, key=lambda problem: problem.line or 0)[:MAX_PROBLEMS]


def _job_spec(context: ApiContext, caller: Caller, request: CreateBatch, file: FileRecord, job_id: str,
              model: str | None) -> JobSpec:
    """The job that runs the batch, its input a copy of the file in the job's folder."""
    store = context.store
    input_key = context.repository.layout(job_id).input_key(f"{file.id}.jsonl")
    try:
        store.copy(FileStore(context).content_key(file), input_key)
    except ObjectNotFound:
        # A delete raced this create (or one was cut short after the content went): the file is
        # gone, as the content route says, not a server error. Nothing was written yet.
        raise not_found(file.id, param="input_file_id") from None
    try:
        spec = JobSpec(input_uri=store.uri(input_key), input_format=InputFormat.OPENAI_BATCH,
                       output_format=InputFormat.OPENAI_BATCH, model=model or "", tenant=caller.tenant,
                       completion_window=request.completion_window, metadata=request.metadata or {},
                       task=JobTask.EMBED if request.endpoint == EMBEDDINGS_URL else JobTask.GENERATE)
    except ValidationError as error:
        store.delete(input_key)
        first = error.errors()[0]
        raise HttpError(400, "invalid batch: " + "; ".join(validation_messages(error)),
                        param=".".join(str(part) for part in first["loc"]) or None) from None
    try:
        check_in_flight(context, spec, job_id)
        return validate_input(context, spec, store, input_key)
    except Exception:
        store.delete(input_key)
        raise


def batch_object(context: ApiContext, record: BatchRecord, status: JobStatus | None = None,
                 cancelling: bool = False) -> dict[str, Any]:
    """The SDK's `Batch`, its state read from the job (or `status`, just read)."""
    batch: dict[str, Any] = {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "model": record.model,
        "errors": None, "input_file_id": record.input_file_id, "completion_window": record.completion_window,
        "status": "failed", "output_file_id": None, "error_file_id": None, "created_at": record.created_at,
        "in_progress_at": None, "expires_at": None, "finalizing_at": None, "completed_at": None,
        "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": record.requests, "completed": 0, "failed": 0},
        "metadata": record.metadata, "usage": _usage(None)}
    if record.job_id is None:
        batch.update(errors={"object": "list", "data": [problem.model_dump() for problem in record.errors]},
                     failed_at=record.created_at)
        return batch
    try:
        status = status or context.repository.get(record.job_id)
    except JobNotFound:
        batch.update(errors=_errors("batch_failed", f"the job {record.job_id} under this batch is gone"),
                     failed_at=record.created_at)
        return batch
    batch.update(status=STATUS_OF[status.state], in_progress_at=_seconds(status.started_at),
                 finalizing_at=_seconds(status.finalizing_at),
                 expires_at=_seconds(status.expires_at), usage=_usage(status),
                 request_counts={"total": record.requests or status.rows.total,
                                 "completed": status.rows.succeeded, "failed": status.rows.failed})
    if status.state.is_terminal:
        batch[ENDED_AT_FIELD[status.state]] = _seconds(status.finished_at)
    if status.state == JobState.CANCELLED:
        batch["cancelling_at"] = _seconds(status.finished_at)
        if cancelling:
            batch.update(status="cancelling", cancelled_at=None)
    if status.state == JobState.FAILED:
        batch["errors"] = _errors("batch_failed", status.error or "the job failed")
    if status.state.is_terminal and not cancelling:
        batch["output_file_id"], batch["error_file_id"] = publish_outputs(context, record, status)
    return batch


def _errors(code: str, message: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": message, "line": None, "param": None}]}


def _usage(status: JobStatus | None) -> dict[str, Any]:
    usage = status.usage if status is not None else None
    prompt, cached, completion = (usage.prompt, usage.cached, usage.completion) if usage else (0, 0, 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _seconds(moment: Any) -> int | None:
    return None if moment is None else int(moment.timestamp())


# -- the output and error files ---------------------------------------------------------------


def output_file_id(job_id: str, kind: str, at: int) -> str:
    """The id of a job's `kind` file: the same for every reader (it derives from the job)."""
    digest = hashlib.sha256(f"{job_id}:{kind}".encode()).hexdigest()[:12]
    return f"file-{at * 1000:012x}{digest}"


def publish_outputs(context: ApiContext, record: BatchRecord,
                    status: JobStatus) -> tuple[str | None, str | None]:
    """(output file id, error file id) of an ended batch, writing the files the first time: None
    for a file that would be empty."""
    at = _seconds(status.finished_at) or record.created_at
    files = FileStore(context)
    counts = {False: status.rows.succeeded, True: status.rows.failed}
    expires_at = at + record.output_expires_after_s if record.output_expires_after_s else None
    ids: list[str | None] = []
    # Both are `batch_output` files, as OpenAI's are.
    for kind, purpose, failed in (("output", "batch_output", False), ("error", "batch_output", True)):
        if not counts[failed]:
            ids.append(None)
            continue
        file_id = output_file_id(status.job_id, kind, at)
        files.write_output(record.owner, file_id, f"{record.id}_{kind}.jsonl", purpose,
                           _lines(context, status, failed), at, expires_at=expires_at)
        ids.append(file_id)
    return ids[0], ids[1]


def _lines(context: ApiContext, status: JobStatus, failed: bool) -> Iterator[bytes]:
    """The job's output lines of succeeded (or failed) rows, in input order."""
    for data, record in output_records(context, status):
        # A failed row may still carry the response it produced (JSON cut off at max_tokens): the
        # error decides which file it is in, as the counts do.
        if (record.get("error") is not None) != failed:
            continue
        if failed and isinstance(record.get("error"), dict):
            code = record["error"].get("code")
            record["error"]["code"] = ERROR_CODE_NAMES.get(code, code)
            data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        yield data + b"\n"
