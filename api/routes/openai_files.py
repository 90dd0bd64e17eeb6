"""OpenAI's Files API (`/v1/files`), as the official SDK calls it: upload a batch input file, list,
read, download and delete files, batch outputs included. Each caller sees only its tenant's files
(an admin key every tenant's); another tenant's file id is 404, as a missing one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from bulkinfer.api.auth import CallerDep
from bulkinfer.api.dependencies import Context
from bulkinfer.api.schemas import OpenAIErrorBody, error_responses
from bulkinfer.api.v1.files import (
    ANCHOR_FIELD,
    FILE_FIELD,
    PURPOSE_FIELD,
    SECONDS_FIELD,
    FileStore,
    file_list_object,
    not_found,
)
from bulkinfer.jobs.object_store.base import ObjectNotFound

READ_CHUNK_BYTES = 1 << 20
MAX_LIST_LIMIT = 10_000

# The errors each route may answer, for the schema (the /v1 error body is api/errors.py's).
FILE_ERRORS: dict[int | str, dict[str, Any]] = error_responses(OpenAIErrorBody, {
    400: "the upload's fields are wrong", 404: "no such file (or another tenant's, or expired)",
    413: "the upload is larger than max_upload_bytes", 422: "a query parameter is invalid",
    503: "a backing service is down"})

router = APIRouter(prefix="/v1", tags=["openai files"])


class FileObject(BaseModel):
    """OpenAI's FileObject."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    expires_at: int | None
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: FILE_ERRORS[code] for code in (*codes, 503)}

UPLOAD_BODY = {
    "required": True,
    "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": [PURPOSE_FIELD, FILE_FIELD],
        "properties": {
            PURPOSE_FIELD: {"type": "string", "enum": ["batch"]},
            ANCHOR_FIELD: {"type": "string", "enum": ["created_at"]},
            SECONDS_FIELD: {"type": "integer", "minimum": 3600, "maximum": 2592000,
                            "description": "the file expires this long after it was created"},
            FILE_FIELD: {"type": "string", "format": "binary",
                         "description": "OpenAI batch JSONL: one request a line; streamed to the store"}}}}},
}


@router.post("/files", summary="Upload a file", openapi_extra={"requestBody": UPLOAD_BODY},
             response_model=FileObject, responses=_errors(400, 413))
async def create_file(request: Request, context: Context, caller: CallerDep) -> dict[str, Any]:
    """Multipart `purpose` (`batch`), `file`, and optionally `expires_after[anchor]` (`created_at`)
    with `expires_after[seconds]`. A batch file's lines are checked as it arrives; what they get
    wrong fails the batch created from it, with each problem's line."""
    record = await FileStore(context).save_upload(caller, request)
    return record.file_object()


@router.get("/files", summary="List files", response_model=FileList, responses=_errors(422))
def list_files(context: Context, caller: CallerDep,
               after: Annotated[str | None, Query(max_length=200)] = None,
               limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = MAX_LIST_LIMIT,
               order: Literal["asc", "desc"] = "desc",
               purpose: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    """The caller's files by creation time (`order`), those after the id `after`, at most `limit`."""
    records, has_more = FileStore(context).list(caller, after=after, limit=limit, order=order,
                                                purpose=purpose)
    return file_list_object(records, has_more)


@router.get("/files/{file_id}", summary="Retrieve a file", response_model=FileObject,
            responses=_errors(404))
def retrieve_file(file_id: str, context: Context, caller: CallerDep) -> dict[str, Any]:
    return FileStore(context).get(caller, file_id).file_object()


@router.get("/files/{file_id}/content", summary="Download a file's content",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "the bytes"},
                       **_errors(404)})
def file_content(file_id: str, context: Context, caller: CallerDep) -> StreamingResponse:
    files = FileStore(context)
    record = files.get(caller, file_id)
    try:  # opened here, so a file whose content is gone is a 404, not a broken stream
        stream = files.store.open_read(files.content_key(record))
    except ObjectNotFound:
        raise not_found(file_id) from None

    def chunks() -> Iterator[bytes]:
        with stream:
            while chunk := stream.read(READ_CHUNK_BYTES):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes)})


@router.delete("/files/{file_id}", summary="Delete a file", response_model=FileDeleted,
               responses=_errors(404))
def delete_file(file_id: str, context: Context, caller: CallerDep) -> dict[str, Any]:
    FileStore(context).delete(caller, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
