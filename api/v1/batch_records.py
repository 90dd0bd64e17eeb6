"""Batch records: what a `/v1` batch adds to the job under it, one small JSON object each.

    <prefix>/batches/<api>/<owner>/<batch_id>.json     (api: openai | anthropic)

A batch's id is its job's id with the wire format's prefix (`batch_…`, `msgbatch_…`), and job ids
begin with their creation time, so a store listing of an owner's folder is the creation order and
a cursor is an id. A tenant's caller only ever reads its own owner folder; an admin reads them all.
The record is written once, before the job is created; the live state comes from the job.
"""

from __future__ import annotations

import os
import time
from typing import Literal

from pydantic import BaseModel, Field

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.v1.batch_lines import LineProblem
from bulkinfer.api.v1.files import owner_of
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound

BatchApi = Literal["openai", "anthropic"]
ID_PREFIXES: dict[str, str] = {"openai": "batch_", "anthropic": "msgbatch_"}
JOB_PREFIX = "job-"
BATCHES_AREA = "batches"


class BatchRecord(BaseModel):
    id: str
    api: BatchApi
    owner: str
    created_at: int  # unix seconds
    job_id: str | None = None  # None: refused before a job was made (its input file had problems)
    model: str | None = None
    requests: int = 0
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    # OpenAI's
    endpoint: str | None = None
    input_file_id: str | None = None
    output_expires_after_s: int | None = None
    errors: list[LineProblem] = Field(default_factory=list)


def new_job_id(at: float | None = None) -> str:
    """`job-<12 hex digits of unix ms><20 random hex digits>`: sorts in creation order."""
    millis = int((time.time() if at is None else at) * 1000)
    return f"{JOB_PREFIX}{millis:012x}{os.urandom(10).hex()}"


def batch_id_for(api: BatchApi, job_id: str) -> str:
    return ID_PREFIXES[api] + job_id.removeprefix(JOB_PREFIX)


class BatchRecords:
    def __init__(self, context: ApiContext, api: BatchApi) -> None:
        self._store = context.store
        self._api = api
        prefix = context.repository.prefix
        self._root = f"{prefix}/{BATCHES_AREA}/{api}/" if prefix else f"{BATCHES_AREA}/{api}/"

    def _key(self, owner: str, batch_id: str) -> str:
        return f"{self._root}{owner}/{batch_id}.json"

    def put(self, record: BatchRecord) -> None:
        try:
            self._store.put_bytes(self._key(record.owner, record.id), record.model_dump_json().encode(),
                                  if_none_match=True)
        except AlreadyExists:
            raise HttpError(409, f"batch {record.id} already exists") from None

    def get(self, caller: Caller, batch_id: str) -> BatchRecord:
        """The caller's batch; 404 for one that does not exist or is another tenant's."""
        if _well_formed(self._api, batch_id):
            for owner in self._owners(caller):
                try:
                    return self._read(owner, batch_id)
                except ObjectNotFound:
                    continue
        raise HttpError(404, f"no batch {batch_id!r}", code="not_found")

    def _read(self, owner: str, batch_id: str) -> BatchRecord:
        return BatchRecord.model_validate_json(self._store.get_bytes(self._key(owner, batch_id)))

    def delete(self, record: BatchRecord) -> None:
        self._store.delete(self._key(record.owner, record.id))

    def _ids(self, caller: Caller) -> list[tuple[str, str]]:
        """(batch id, owner) of every batch the caller sees, newest first."""
        ids: list[tuple[str, str]] = []
        for owner in self._owners(caller):
            folder = f"{self._root}{owner}/"
            ids += [(info.key[len(folder):-len(".json")], owner) for info in self._store.list(folder)
                    if info.key.endswith(".json") and "/" not in info.key[len(folder):]]
        return sorted(ids, reverse=True)

    def page(self, caller: Caller, *, after: str | None = None, before: str | None = None,
             limit: int = 20) -> tuple[list[BatchRecord], bool]:
        """Up to `limit` records, newest first, older than `after` / newer than `before` (ids), and
        whether more lie beyond them in that direction."""
        ids = self._ids(caller)
        if after is not None:
            ids = [entry for entry in ids if entry[0] < after]
        if before is not None:
            ids = [entry for entry in ids if entry[0] > before]
        chosen = ids[-limit:] if before is not None else ids[:limit]  # the ones next to the cursor
        return [self._read(owner, batch_id) for batch_id, owner in chosen], len(ids) > limit

    def _owners(self, caller: Caller) -> list[str]:
        if caller.scope is not None:
            return [owner_of(caller)]
        return sorted({info.key[len(self._root):].split("/", 1)[0] for info in self._store.list(self._root)})


def _well_formed(api: BatchApi, batch_id: str) -> bool:
    body = batch_id.removeprefix(ID_PREFIXES[api])
    return batch_id.startswith(ID_PREFIXES[api]) and 0 < len(body) <= 64 and body.isalnum()

