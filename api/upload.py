"""`POST /jobs` as multipart: a `spec` field (JSON, sent first) and a `file` streamed to the store.

The file goes straight from the request body into `jobs/<id>/input/<name>` through the store's
streaming writer (a temp file renamed into place, or an S3 multipart upload), a chunk at a time:
an upload is never held in memory. The spec comes first so the job id, and with it the upload's
key, is known before the first byte of the file arrives.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.estimate import estimate_spec
from bulkinfer.api.json_body import json_problem
from bulkinfer.api.submission import (
    check_in_flight,
    check_model,
    claimed_output,
    create_and_enqueue,
    parse_spec,
    validate_input,
)
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectStore, ObjectWriter
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobStatus

SPEC_FIELD = "spec"
FILE_FIELD = "file"
MAX_SPEC_BYTES = 1 << 20
# A multipart upload's body beyond its file: the spec (or purpose) field and the parts' headers.
UPLOAD_FORM_BYTES = MAX_SPEC_BYTES + (64 << 10)
WRITE_BATCH_BYTES = 1 << 20  # hand the store ~1 MiB at a time: few thread hops, bounded memory
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# What a placeholder input_uri stands for while the spec is checked before the upload exists.
PENDING_UPLOAD_URI = "/upload/pending.bin"


@dataclass(frozen=True)
class PartStart:
    name: str
    filename: str | None


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


async def iter_multipart(request: Request) -> AsyncIterator[PartStart | PartData | PartEnd]:
    """The request body's parts as events, parsed as the bytes arrive."""
    _kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise HttpError(400, "multipart body without a boundary")
    events: list[PartStart | PartData | PartEnd] = []
    header_name, header_value = bytearray(), bytearray()
    headers: dict[bytes, bytes] = {}

    def on_header_end() -> None:
        headers[bytes(header_name).lower()] = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        _disposition, params = parse_options_header(headers.get(b"content-disposition", b""))
        filename = params.get(b"filename")
        events.append(PartStart(params.get(b"name", b"").decode(errors="replace"),
                                filename.decode(errors="replace") if filename is not None else None))
        headers.clear()

    callbacks = {
        "on_header_field": lambda data, start, end: header_name.extend(data[start:end]),
        "on_header_value": lambda data, start, end: header_value.extend(data[start:end]),
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": lambda data, start, end: events.append(PartData(bytes(data[start:end]))),
        "on_part_end": lambda: events.append(PartEnd()),
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    async for chunk in request.stream():
        try:
            parser.write(chunk)
        except Exception as error:  # noqa: BLE001 - python-multipart raises several types
            raise HttpError(400, f"malformed multipart body: {error}") from None
        for event in events:
            yield event
        events.clear()
    parser.finalize()
    for event in events:
        yield event


def input_name(filename: str | None) -> str:
    """A plain file name for `jobs/<id>/input/` that keeps the extension (it hints the format)."""
    cleaned = SAFE_NAME.sub("_", shown_name(filename)).lstrip(".")[:128]
    return cleaned or "input"


def shown_name(filename: str | None) -> str:
    """The uploaded file's name as the user gave it (without a folder): what messages call the input."""
    return (filename or "").replace("\\", "/").rsplit("/", 1)[-1][:256] or "input"


class StreamedUpload:
    """One file part on its way into the store (write-once), hashed as it goes and handed over about
    1 MiB at a time; `on_chunk` sees each piece as it is stored (in the thread pool)."""

    def __init__(self, store: ObjectStore, key: str,
                 on_chunk: Callable[[bytes], None] | None = None) -> None:
        self.store = store
        self.key = key
        self.sha256 = hashlib.sha256()
        self._pending = bytearray()
        self._on_chunk = on_chunk
        self._writer: ObjectWriter = store.open_write(key, if_none_match=True)

    async def write(self, data: bytes) -> None:
        self.sha256.update(data)
        self._pending += data
        if len(self._pending) >= WRITE_BATCH_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        if self._pending:
            chunk, self._pending = bytes(self._pending), bytearray()
            await run_in_threadpool(self._store, chunk)

    def _store(self, chunk: bytes) -> None:
        self._writer.write(chunk)
        if self._on_chunk is not None:
            self._on_chunk(chunk)

    async def finish(self) -> bool:
        """Make the object visible; False if an earlier upload already wrote this key."""
        await self._flush()
        try:
            await run_in_threadpool(self._writer.close)
        except AlreadyExists:
            return False
        return True

    async def abort(self) -> None:
        await run_in_threadpool(self._writer.abort)

    def abort_now(self) -> None:
        """`abort` from a thread that may block (nothing if the upload was already made visible)."""
        self._writer.abort()


def _stored_sha256(store: ObjectStore, key: str) -> str:
    digest = hashlib.sha256()
    with store.open_read(key) as stream:
        while chunk := stream.read(WRITE_BATCH_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _spec_for_upload(context: ApiContext, raw: bytes, tenant: str | None) -> dict[str, object]:
    """The spec field, checked (fields, model, adapter) before any of the file is read, as the
    caller's tenant's (whose folders a lora location must lie in)."""
    problem = json_problem(raw, f"the {SPEC_FIELD!r} field")
    if problem is not None:
        raise HttpError(422, problem)
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise HttpError(422, f"the {SPEC_FIELD!r} field is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise HttpError(422, f"the {SPEC_FIELD!r} field must be a JSON object")
    if "input_uri" in data:
        raise HttpError(422, "input_uri: leave it out when uploading a file; the upload is the input")
    checked = check_model(context, parse_spec({**data, "input_uri": PENDING_UPLOAD_URI, "tenant": tenant}))
    return {**data, "model": checked.model}  # an alias: the served model it names


async def _drain(events: AsyncIterator[PartStart | PartData | PartEnd]) -> None:
    # Read the rest of the body before answering, so the client sees our error, not a broken pipe.
    async for _event in events:
        pass


async def submit_upload(context: ApiContext, request: Request,
                        tenant: str | None = None) -> JobStatus | JobEstimate:
    """The spec and the file of a multipart submit; the job belongs to `tenant` (a dry run: the
    estimate, and the upload is removed)."""
    events = iter_multipart(request)
    receiver = _Receiver(context, tenant)
    try:
        spec, upload = await receiver.receive(events)
        resolved = await run_in_threadpool(validate_input, context, spec, upload.store, upload.key,
                                           receiver.filename)
    except Exception:
        await _drain(events)
        await receiver.discard()
        raise
    assert receiver.job_id is not None
    if resolved.dry_run:  # estimated from the upload, which is then removed: nothing stays
        try:
            return await run_in_threadpool(estimate_spec, context, resolved, upload.store, upload.key)
        finally:
            await receiver.discard()
    await run_in_threadpool(check_in_flight, context, resolved, receiver.job_id)
    return await run_in_threadpool(create_claimed, context, resolved, receiver.job_id)


def create_claimed(context: ApiContext, spec: JobSpec, job_id: str) -> JobStatus:
    """Claim the output folder, then create and queue the job (the claim released if that fails)."""
    with claimed_output(context, spec, job_id):
        return create_and_enqueue(context, spec, job_id)


class _Receiver:
    """Walks the parts: the spec first, then the file into `jobs/<id>/input/<name>`."""

    def __init__(self, context: ApiContext, tenant: str | None) -> None:
        self.context = context
        self.tenant = tenant
        self.received = 0  # bytes of the file so far
        self.job_id: str | None = None
        self.upload: StreamedUpload | None = None
        self.filename: str | None = None  # as the user named the file
        self._wrote = False

    async def receive(
            self, events: AsyncIterator[PartStart | PartData | PartEnd]) -> tuple[JobSpec, StreamedUpload]:
        spec_data: dict[str, object] | None = None
        spec: JobSpec | None = None
        spec_bytes = bytearray()
        current: str | None = None
        async for event in events:
            if isinstance(event, PartStart):
                current = event.name
                if current == FILE_FIELD:
                    if spec_data is None:
                        raise HttpError(400, f"send the {SPEC_FIELD!r} field before the {FILE_FIELD!r} field")
                    spec = await self._start_file(spec_data, event.filename)
                elif current != SPEC_FIELD:
                    raise HttpError(400, f"unexpected form field {current!r} (expected {SPEC_FIELD!r}, then "
                                        f"{FILE_FIELD!r})")
            elif isinstance(event, PartData):
                if current == SPEC_FIELD:
                    spec_bytes += event.data
                    if len(spec_bytes) > MAX_SPEC_BYTES:
                        raise HttpError(413, f"the {SPEC_FIELD!r} field is larger than {MAX_SPEC_BYTES} "
                                             "bytes")
                elif self.upload is not None:
                    limit = self.context.settings.max_upload_bytes
                    self.received += len(event.data)
                    if self.received > limit:
                        raise HttpError(413, f"the uploaded file is larger than this deployment's "
                                            f"max_upload_bytes ({limit:,} bytes); nothing of it was kept")
                    await self.upload.write(event.data)
            elif current == SPEC_FIELD:
                spec_data = _spec_for_upload(self.context, bytes(spec_bytes), self.tenant)
            elif current == FILE_FIELD and self.upload is not None:
                await self._finish_file(spec_data or {})
        if spec is None or self.upload is None:
            raise HttpError(400, f"a multipart submit needs a {SPEC_FIELD!r} field, then a {FILE_FIELD!r} "
                                "field")
        return spec, self.upload

    async def _start_file(self, spec_data: dict[str, object], filename: str | None) -> JobSpec:
        if self.upload is not None:
            raise HttpError(400, f"one {FILE_FIELD!r} per job")
        spec_data = {**spec_data, "tenant": self.tenant}  # the caller's, whatever the spec said
        self.filename = shown_name(filename)
        self.job_id = JobRepository.job_id_for(parse_spec({**spec_data, "input_uri": PENDING_UPLOAD_URI}))
        key = self.context.repository.layout(self.job_id).input_key(input_name(filename))
        spec = parse_spec({**spec_data, "input_uri": self.context.store.uri(key)})
        self.upload = await run_in_threadpool(StreamedUpload, self.context.store, key)
        return spec

    async def _finish_file(self, spec_data: dict[str, object]) -> None:
        assert self.upload is not None
        self._wrote = await self.upload.finish()
        if self._wrote:
            return
        # An earlier submit with this idempotency key uploaded here: the same file, or a conflict.
        stored = await run_in_threadpool(_stored_sha256, self.upload.store, self.upload.key)
        if stored != self.upload.sha256.hexdigest():
            raise HttpError(409, f"idempotency_key {spec_data.get('idempotency_key')!r} was already used "
                                "with a different file")

    async def discard(self) -> None:
        """After a failed submit: drop a half-written upload, or one this request wrote."""
        if self.upload is None:
            return
        await self.upload.abort()
        if self._wrote:
            await run_in_threadpool(self.upload.store.delete, self.upload.key)
