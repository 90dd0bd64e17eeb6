"""The file store behind OpenAI's Files API: uploads (purpose `batch`) and batch outputs.

    <prefix>/files/<owner>/<file_id>/meta.json   the FileRecord, written once, after the content
    <prefix>/files/<owner>/<file_id>/content     the bytes
    <prefix>/files/<owner>/<file_id>/deleted     a batch output that was deleted (or expired): its
                                                 id derives from the job, and it is never written again

`<owner>` is the caller's tenant, or `_open` for a caller with none (an open API, an admin key):
a tenant's caller only ever reads its own owner folder, so another tenant's file is not found by
construction; an admin looks in every folder. Ids sort by creation time (`file-<12 hex of unix
ms><12 hex random>`), so a listing of a folder is the creation order.

An upload streams from the request into the store (a local temp file renamed into place, or an S3
multipart upload) a MiB at a time, never held whole, and a `batch` file's lines are checked as they
pass (api/v1/batch_lines.py). A file past its `expires_at` is gone: 404, and deleted when touched.
"""

from __future__ import annotations

import builtins
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from bulkinfer.api.auth import TENANT_PATTERN, Caller, parse_keys
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.upload import PartData, PartEnd, PartStart, StreamedUpload, iter_multipart
from bulkinfer.api.v1.batch_lines import BatchLinesScanner, BatchLinesSummary
from bulkinfer.jobs.layout import FILE_CONTENT_NAME, FILE_RECORD_NAME, FILE_TOMBSTONE_NAME, area_root
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound

# no tenant's name: tenants start with a letter or digit (bulkinfer.api.auth.TENANT_PATTERN)
OPEN_OWNER = "_open"
FILE_ID_PATTERN = re.compile(r"^file-[A-Za-z0-9_-]{1,120}$")
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSES = ("batch_output", "batch_error")  # set by us, for a batch's results
EXPIRES_AFTER_ANCHOR = "created_at"
MIN_EXPIRES_AFTER_S = 3600  # OpenAI's bounds: one hour to thirty days
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600
MAX_FIELD_BYTES = 256  # purpose, expires_after[...]
MAX_FILENAME_CHARS = 255

PURPOSE_FIELD = "purpose"
FILE_FIELD = "file"
ANCHOR_FIELD = "expires_after[anchor]"
SECONDS_FIELD = "expires_after[seconds]"
FORM_FIELDS = (PURPOSE_FIELD, FILE_FIELD, ANCHOR_FIELD, SECONDS_FIELD)


class FileRecord(BaseModel):
    """What meta.json holds."""

    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int  # unix seconds
    expires_at: int | None = None
    batch_lines: BatchLinesSummary | None = None  # purpose == "batch": the upload's scan

    def file_object(self) -> dict[str, Any]:
        """The OpenAI FileObject."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


def owner_of(caller: Caller) -> str:
    """The owner folder of what `caller` creates."""
    return caller.tenant if caller.tenant is not None else OPEN_OWNER


def new_file_id(at_ms: int | None = None) -> str:
    at_ms = int(time.time() * 1000) if at_ms is None else at_ms
    return f"file-{at_ms:012x}{secrets.token_hex(6)}"


def not_found(file_id: str, param: str | None = None) -> HttpError:
    """OpenAI's 404 for a file, naming its id (never where its bytes were kept)."""
    return HttpError(404, f"No such File object: {file_id}", param=param)


class FileStore:
    def __init__(self, context: ApiContext, clock: Callable[[], float] = time.time) -> None:
        self.context = context
        self.store = context.store
        self.root = area_root("files", context.repository.prefix)
        self.clock = clock

    # -- keys ------------------------------------------------------------------------------------

    def folder(self, owner: str, file_id: str) -> str:
        return f"{self.root}{owner}/{file_id}/"

    def meta_key(self, owner: str, file_id: str) -> str:
        return self.folder(owner, file_id) + FILE_RECORD_NAME

    def content_key(self, record: FileRecord) -> str:
        """Where the file's bytes are in `context.store`."""
        return self.folder(record.owner, record.id) + FILE_CONTENT_NAME

    def tombstone_key(self, owner: str, file_id: str) -> str:
        return self.folder(owner, file_id) + FILE_TOMBSTONE_NAME

    # -- reading ---------------------------------------------------------------------------------

    def get(self, caller: Caller, file_id: str) -> FileRecord:
        """The caller's file; 404 when there is none, it is another tenant's, or it has expired."""
        if not FILE_ID_PATTERN.match(file_id):
            raise not_found(file_id)
        owners = self._owners_to_search() if caller.admin else [owner_of(caller)]
        for owner in owners:
            record = self._read(owner, file_id)
            if record is not None:
                return record
        if caller.admin:  # an owner whose key is no longer configured
            for owner, found in self._owned_ids(self.root):
                if found == file_id and (record := self._read(owner, file_id)) is not None:
                    return record
        raise not_found(file_id)

    def list(self, caller: Caller, *, after: str | None, limit: int, order: str,
             purpose: str | None) -> tuple[list[FileRecord], bool]:
        """One page of the caller's files (every owner's, for an admin), by id in `order`, those
        after the id `after`; and whether more follow."""
        folder = self.root if caller.admin else f"{self.root}{owner_of(caller)}/"
        # (id, owner) sorts by creation time; an admin's listing is every owner's, interleaved.
        found = sorted(((file_id, owner) for owner, file_id in self._owned_ids(folder)),
                       reverse=order == "desc")
        if after is not None:
            found = [item for item in found if (item[0] < after if order == "desc" else item[0] > after)]
        page: list[FileRecord] = []
        for file_id, owner in found:
            record = self._read(owner, file_id)
            if record is None or (purpose is not None and record.purpose != purpose):
                continue
            if len(page) == limit:
                return page, True
            page.append(record)
        return page, False

    def _owned_ids(self, folder: str) -> Iterator[tuple[str, str]]:
        """(owner, file_id) of every record under `folder`."""
        for info in self.store.list(folder):
            parts = info.key[len(self.root):].split("/")
            if len(parts) == 3 and parts[2] == FILE_RECORD_NAME:
                yield parts[0], parts[1]

    def _owners_to_search(self) -> builtins.list[str]:
        settings = self.context.settings
        keys = parse_keys(settings.api_keys, settings.admin_api_keys)
        tenants = {caller.tenant for _digest, caller in keys}
        return [OPEN_OWNER, *sorted(tenant for tenant in tenants if tenant is not None)]

    def _read(self, owner: str, file_id: str) -> FileRecord | None:
        """The record, or None when there is none; an expired one is deleted and is None."""
        try:
            record = FileRecord.model_validate_json(self.store.get_bytes(self.meta_key(owner, file_id)))
        except ObjectNotFound:
            return None
        if record.expires_at is not None and record.expires_at <= self.clock():
            self._remove(record)
            return None
        return record

    # -- writing ---------------------------------------------------------------------------------

    def delete(self, caller: Caller, file_id: str) -> None:
        self._remove(self.get(caller, file_id))

    def _remove(self, record: FileRecord) -> None:
        # A batch's output is published by whoever reads the batch while the file is missing: the
        # tombstone first, so a deleted (or expired) one stays deleted, as OpenAI's do.
        if record.purpose in OUTPUT_PURPOSES:
            self.store.put_bytes(self.tombstone_key(record.owner, record.id), b"deleted\n")
        # The content first: a delete cut short leaves a record whose content is gone (the next
        # delete finishes it), never bytes that no record names.
        self.store.delete(self.content_key(record))
        self.store.delete(self.meta_key(record.owner, record.id))

    async def save_upload(self, caller: Caller, request: Request) -> FileRecord:
        """The multipart upload (`purpose`, `file`, `expires_after[anchor|seconds]`), stored; on any
        error nothing of it stays."""
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "multipart/form-data":
            raise HttpError(400, "upload a file as multipart/form-data with the fields 'purpose' and 'file'")
        receiver = _UploadReceiver(self, owner_of(caller))
        events = iter_multipart(request)
        try:
            return await receiver.receive(events)
        except Exception:
            async for _event in events:  # read the rest, so the client gets our answer, not a reset
                pass
            await run_in_threadpool(receiver.discard)
            raise

    def write_output(self, owner: str, file_id: str, filename: str, purpose: str,
                     chunks: Iterable[bytes], created_at: int,
                     expires_at: int | None = None) -> FileRecord | None:
        """Publish a batch's output or error file, once: with the same id again (a second finalize,
        a racing request), the record already there is returned and `chunks` is not read. None for
        a file that was deleted (or expired) since: it is never written again."""
        if not FILE_ID_PATTERN.match(file_id):
            raise ValueError(f"file id {file_id!r} must match {FILE_ID_PATTERN.pattern}")
        if owner != OPEN_OWNER and not re.match(TENANT_PATTERN, owner):
            raise ValueError(f"owner {owner!r} is neither a tenant nor {OPEN_OWNER!r} (see owner_of)")
        if purpose not in OUTPUT_PURPOSES:
            raise ValueError(f"purpose {purpose!r}: an output file's is one of {OUTPUT_PURPOSES}")
        meta_key = self.meta_key(owner, file_id)
        existing = self._existing(meta_key)
        if existing is not None:
            return existing
        tombstone_key = self.tombstone_key(owner, file_id)
        if self.store.exists(tombstone_key):
            return None
        record = FileRecord(id=file_id, owner=owner, filename=filename, purpose=purpose, bytes=0,
                            created_at=created_at, expires_at=expires_at)
        content_key = self.content_key(record)
        try:
            with self.store.open_write(content_key, if_none_match=True) as writer:
                for chunk in chunks:
                    writer.write(chunk)
            size = writer.size
        except AlreadyExists:  # an earlier write of the same output stopped before its record
            size = self.store.head(content_key).size
        record = record.model_copy(update={"bytes": size})
        try:
            self.store.put_bytes(meta_key, record.model_dump_json().encode(), if_none_match=True)
        except AlreadyExists:
            return self._existing(meta_key) or record
        if self.store.exists(tombstone_key):  # deleted while this (late) writer wrote it again
            self._remove(record)
            return None
        return record

    def _existing(self, meta_key: str) -> FileRecord | None:
        try:
            return FileRecord.model_validate_json(self.store.get_bytes(meta_key))
        except ObjectNotFound:
            return None


class _UploadReceiver:
    """Walks the parts of one upload, in whatever order they come: the small fields into memory,
    the file into the store (and its lines through the batch check)."""

    def __init__(self, files: FileStore, owner: str) -> None:
        self.files = files
        self.owner = owner
        self.fields: dict[str, bytearray] = {}
        self.file_id: str | None = None
        self.filename = ""
        self.received = 0
        self.upload: StreamedUpload | None = None
        self.content_key: str | None = None
        self.scanner = BatchLinesScanner()
        self.summary: BatchLinesSummary | None = None

    async def receive(self, events: AsyncIterator[PartStart | PartData | PartEnd]) -> FileRecord:
        current: str | None = None
        async for event in events:
            if isinstance(event, PartStart):
                current = event.name
                await self._start(event)
            elif isinstance(event, PartData):
                if current == FILE_FIELD:
                    await self._write(event.data)
                else:
                    value = self.fields[current or ""]
                    value += event.data
                    if len(value) > MAX_FIELD_BYTES:
                        raise HttpError(400, f"the form field {current!r} is longer than {MAX_FIELD_BYTES} "
                                             "bytes")
            elif current == FILE_FIELD:
                await self._finish_file()
            elif current == PURPOSE_FIELD:
                _check_purpose(self._field(PURPOSE_FIELD))  # refused before any of the file is stored
        if self.summary is None:
            raise HttpError(400, "the upload has no 'file' field: send the file as a multipart part named "
                                 "'file'")
        purpose = self._field(PURPOSE_FIELD)
        if purpose is None:
            raise HttpError(400, "missing required parameter 'purpose' (one of "
                                 f"{', '.join(UPLOAD_PURPOSES)})")
        _check_purpose(purpose)
        created_at = int(self.files.clock())
        record = FileRecord(id=self.file_id, owner=self.owner, filename=self.filename, purpose=purpose,
                            bytes=self.received, created_at=created_at,
                            expires_at=self._expires_at(created_at), batch_lines=self.summary)
        meta_key = self.files.meta_key(self.owner, record.id)
        await run_in_threadpool(self.files.store.put_bytes, meta_key, record.model_dump_json().encode(), True)
        return record

    def _field(self, name: str) -> str | None:
        value = self.fields.get(name)
        if value is None:
            return None
        try:
            return value.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise HttpError(400, f"the form field {name!r} is not UTF-8 text") from None

    async def _start(self, event: PartStart) -> None:
        if event.name not in FORM_FIELDS:
            raise HttpError(400, f"unexpected form field {event.name!r}; an upload takes "
                                 f"{', '.join(repr(name) for name in FORM_FIELDS)}")
        if event.name in self.fields or (event.name == FILE_FIELD and self.file_id is not None):
            raise HttpError(400, f"the form field {event.name!r} is sent twice")
        if event.name != FILE_FIELD:
            self.fields[event.name] = bytearray()
            return
        base = (event.filename or "").replace("\\", "/").rsplit("/", 1)[-1]
        self.filename = base[:MAX_FILENAME_CHARS] or "file"
        at_ms = int(self.files.clock() * 1000)
        self.file_id = new_file_id(at_ms)
        self.content_key = self.files.folder(self.owner, self.file_id) + FILE_CONTENT_NAME
        self.upload = await run_in_threadpool(StreamedUpload, self.files.store, self.content_key,
                                              self.scanner.feed)

    async def _write(self, data: bytes) -> None:
        limit = self.files.context.settings.max_upload_bytes
        self.received += len(data)
        if self.received > limit:
            raise HttpError(413, f"the uploaded file is larger than this deployment's max_upload_bytes "
                                 f"({limit:,} bytes); nothing of it was kept")
        assert self.upload is not None
        await self.upload.write(data)

    async def _finish_file(self) -> None:
        assert self.upload is not None
        await self.upload.finish()  # a fresh id: never written before
        self.summary = self.scanner.finish()

    def _expires_at(self, created_at: int) -> int | None:
        anchor, seconds = self._field(ANCHOR_FIELD), self._field(SECONDS_FIELD)
        if anchor is None and seconds is None:
            return None
        if anchor != EXPIRES_AFTER_ANCHOR:
            raise HttpError(400, f"expires_after[anchor] must be {EXPIRES_AFTER_ANCHOR!r}, not {anchor!r}")
        try:
            after = int(seconds or "")
        except ValueError:
            raise HttpError(400, "expires_after[seconds] must be a whole number of seconds, not "
                                 f"{seconds!r}") from None
        if not MIN_EXPIRES_AFTER_S <= after <= MAX_EXPIRES_AFTER_S:
            raise HttpError(400, f"expires_after[seconds] must be between {MIN_EXPIRES_AFTER_S} (one hour) "
                                 f"and {MAX_EXPIRES_AFTER_S} (30 days), not {after}")
        return created_at + after

    def discard(self) -> None:
        """After a failed upload: drop a half-written file, or the one this request wrote."""
        if self.upload is not None:
            self.upload.abort_now()  # nothing if it was made visible
        if self.content_key is not None:
            self.files.store.delete(self.content_key)


def _check_purpose(purpose: str | None) -> None:
    if purpose is not None and purpose not in UPLOAD_PURPOSES:
        accepted = ", ".join(repr(name) for name in UPLOAD_PURPOSES)
        raise HttpError(400, f"purpose {purpose!r} is not accepted here; an upload's purpose is one of "
                             f"{accepted} ({', '.join(OUTPUT_PURPOSES)} files are a batch's results, "
                             "written by the service)")


def file_list_object(records: list[FileRecord], has_more: bool) -> dict[str, Any]:
    """The OpenAI list page of FileObjects."""
    return {"object": "list", "data": [record.file_object() for record in records],
            "first_id": records[0].id if records else None, "last_id": records[-1].id if records else None,
            "has_more": has_more}

