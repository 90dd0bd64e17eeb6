"""OpenAI's `/v1/batches` and `/v1/models`, as the official `openai` SDK calls them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from starlette.concurrency import run_in_threadpool

from bulkinfer.api.auth import CallerDep
from bulkinfer.api.dependencies import Context
from bulkinfer.api.errors import HttpError
from bulkinfer.api.schemas import OpenAIErrorBody, error_responses
from bulkinfer.api.v1.batch_records import BatchRecords
from bulkinfer.api.v1.openai_batches import STATUS_OF, batch_object, create_batch, parse_create
from bulkinfer.jobs.names import CONTROL_QUEUE, DELIVER_WEBHOOK
from bulkinfer.jobs.webhook_claims import claim_delivery

router = APIRouter(prefix="/v1", tags=["openai batches"], responses=error_responses(OpenAIErrorBody, {
    400: "the request or its input file cannot be used", 404: "no such batch or file (or another tenant's)",
    409: "the batch has ended", 422: "a parameter is invalid", 429: "too many jobs in flight or requests"}))


@router.post("/batches", summary="Create a batch (OpenAI Batches API)")
async def create(context: Context, caller: CallerDep, body: Annotated[Any, Body()] = None) -> dict[str, Any]:
    """`{input_file_id, endpoint, completion_window, metadata, output_expires_after}`: runs the
    file's requests as a job. A file with problems gives a `failed` batch saying which lines."""
    request = parse_create(body)
    return await run_in_threadpool(create_batch, context, caller, request)


@router.get("/batches/{batch_id}", summary="A batch (OpenAI Batches API)")
def retrieve(batch_id: str, context: Context, caller: CallerDep) -> dict[str, Any]:
    return batch_object(context, BatchRecords(context, "openai").get(caller, batch_id))


@router.get("/batches", summary="The caller's batches, newest first (OpenAI Batches API)")
def list_batches(context: Context, caller: CallerDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    records, has_more = BatchRecords(context, "openai").page(caller, after=after, limit=limit)
    data = [batch_object(context, record) for record in records]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch (OpenAI Batches API)")
def cancel(batch_id: str, context: Context, caller: CallerDep) -> dict[str, Any]:
    """The rows not yet done stop; those done stay in the output file. 409 for a batch that ended,
    cancelled ones included: only the call that cancels it answers `cancelling`."""
    record = BatchRecords(context, "openai").get(caller, batch_id)
    if record.job_id is None:
        raise HttpError(409, f"batch {batch_id} has failed; there is nothing to cancel")
    status, cancelled_now = context.repository.cancel(record.job_id)
    if not cancelled_now:
        raise HttpError(409, f"batch {batch_id} is already {STATUS_OF[status.state]}; there is nothing "
                             "to cancel")
    if claim_delivery(context.repository, record.job_id):
        context.tasks.send(DELIVER_WEBHOOK, [record.job_id], CONTROL_QUEUE)
    return batch_object(context, record, status, cancelling=True)


@router.get("/models", summary="The served models (OpenAI's or, with anthropic-version, Anthropic's shape)")
def list_models(request: Request, context: Context) -> dict[str, Any]:
    """Every served model and alias, then each LoRA adapter (OpenAI's shape: with its base model as
    `parent`, as vLLM's server lists them). Anthropic's SDK sends `anthropic-version`: its shape then."""
    registry = context.registry
    names = sorted({*registry.names(), *registry.aliases()})
    adapters = sorted({adapter for base in registry.names() for adapter in registry.adapters_of(base)})
    if request.headers.get("anthropic-version"):
        names += adapters
        epoch = datetime.fromtimestamp(0, UTC).isoformat().replace("+00:00", "Z")
        data = [{"type": "model", "id": name, "display_name": name, "created_at": epoch} for name in names]
        return {"data": data, "has_more": False, "first_id": names[0] if names else None,
                "last_id": names[-1] if names else None}
    models = [{"id": name, "object": "model", "created": 0, "owned_by": "bulkinfer"} for name in names]
    # An adapter on one served model names it as parent; one on several has none (name it per job).
    models += [{"id": adapter, "object": "model", "created": 0, "owned_by": "bulkinfer",
                "parent": registry.adapter_parent(adapter)} for adapter in adapters]
    return {"object": "list", "data": models}
