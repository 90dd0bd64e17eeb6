"""Anthropic's `/v1/messages/batches`, as the official `anthropic` SDK calls them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from bulkinfer.api.auth import CallerDep
from bulkinfer.api.dependencies import Context
from bulkinfer.api.errors import HttpError
from bulkinfer.api.schemas import AnthropicErrorBody, error_responses
from bulkinfer.api.spooled_body import spooled_body
from bulkinfer.api.v1.anthropic_batches import batch_object, create_batch, result_lines
from bulkinfer.api.v1.batch_records import BatchRecords
from bulkinfer.jobs.names import CONTROL_QUEUE, DELIVER_WEBHOOK
from bulkinfer.jobs.state.status import JobState
from bulkinfer.jobs.webhook_claims import claim_delivery

PATH = "/v1/messages/batches"
CREATE_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["requests"],
    "properties": {"requests": {"type": "array", "items": {
        "type": "object", "required": ["custom_id", "params"],
        "properties": {"custom_id": {"type": "string"}, "params": {"type": "object"}}}}}}}}}
router = APIRouter(prefix=PATH, tags=["anthropic batches"], responses=error_responses(AnthropicErrorBody, {
    400: "the requests cannot be used", 404: "no such batch (or another tenant's)",
    409: "the batch is still processing, or has ended", 413: "the body is over max_message_batch_bytes",
    422: "a parameter is invalid", 429: "too many jobs in flight or requests"}))


@router.post("", summary="Create a Message Batch (Anthropic Message Batches API)",
             openapi_extra={"requestBody": CREATE_BODY})
async def create(request: Request, context: Context, caller: CallerDep) -> dict[str, Any]:
    """`{requests: [{custom_id, params}]}`, each `params` a Messages request. The body is spooled to
    a temporary file as it arrives and read from there a request at a time, off the event loop."""
    with await spooled_body(request) as body:
        batch = await run_in_threadpool(create_batch, context, caller, body)
    return {**batch, "results_url": None}


@router.get("/{message_batch_id}", summary="A Message Batch")
def retrieve(message_batch_id: str, request: Request, context: Context, caller: CallerDep) -> dict[str, Any]:
    record = BatchRecords(context, "anthropic").get(caller, message_batch_id)
    return batch_object(context, record, str(request.base_url))


@router.get("", summary="The caller's Message Batches, newest first")
def list_batches(request: Request, context: Context, caller: CallerDep, before_id: str | None = None,
                 after_id: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
    if before_id is not None and after_id is not None:
        raise HttpError(400, "give before_id or after_id, not both")
    records, has_more = BatchRecords(context, "anthropic").page(caller, after=after_id, before=before_id,
                                                                limit=limit)
    data = [batch_object(context, record, str(request.base_url)) for record in records]
    return {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.post("/{message_batch_id}/cancel", summary="Cancel a Message Batch")
def cancel(message_batch_id: str, request: Request, context: Context, caller: CallerDep) -> dict[str, Any]:
    """Requests not yet done are `canceled`; those done keep their results. 409 once it has ended,
    cancelled by an earlier call included."""
    record = BatchRecords(context, "anthropic").get(caller, message_batch_id)
    status, cancelled_now = context.repository.cancel(str(record.job_id))
    if not cancelled_now:
        how = "was already canceled" if status.state == JobState.CANCELLED else "has already ended"
        raise HttpError(409, f"message batch {message_batch_id} {how}; there is nothing to cancel")
    if claim_delivery(context.repository, str(record.job_id)):
        context.tasks.send(DELIVER_WEBHOOK, [record.job_id], CONTROL_QUEUE)
    return batch_object(context, record, str(request.base_url), status, canceling=True)


@router.delete("/{message_batch_id}", summary="Delete an ended Message Batch")
def delete(message_batch_id: str, context: Context, caller: CallerDep) -> dict[str, Any]:
    """Only once it has ended (cancel it first): it leaves /v1/messages/batches; its job stays at /jobs."""
    records = BatchRecords(context, "anthropic")
    record = records.get(caller, message_batch_id)
    if not context.repository.get(str(record.job_id)).state.is_terminal:
        raise HttpError(409, f"message batch {message_batch_id} is still processing; cancel it before "
                             "deleting it")
    records.delete(record)
    return {"id": message_batch_id, "type": "message_batch_deleted"}


@router.get("/{message_batch_id}/results", summary="A Message Batch's results (JSON lines)",
            response_class=StreamingResponse)
def results(message_batch_id: str, context: Context, caller: CallerDep) -> StreamingResponse:
    """One line per request `{custom_id, result}`, once the batch has ended."""
    record = BatchRecords(context, "anthropic").get(caller, message_batch_id)
    status = context.repository.get(str(record.job_id))
    if not status.state.is_terminal:
        raise HttpError(409, f"message batch {message_batch_id} is still processing: its results are "
                             "ready once it has ended")
    return StreamingResponse(result_lines(context, record, status), media_type="application/x-jsonl")
