"""`POST /v1/batches` on a file whose record is there but whose content is gone (a delete racing
the create, or one cut short between its two steps): a 404 naming the file, as the content route
answers, never a 500, and nothing of a batch or a job left behind."""

from __future__ import annotations

import json

import httpx

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.v1.files import FileStore
from bulkinfer.jobs.layout import area_root
from tests.api.conftest import RunningApi

CHAT = "/v1/chat/completions"
LINE = {"custom_id": "a", "method": "POST", "url": CHAT,
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}}


def _file_store(api: RunningApi) -> FileStore:
    context = ApiContext(settings=api.settings, repository=api.repository,
                         registry=api.settings.model_registry(), tasks=None)  # type: ignore[arg-type]
    return FileStore(context)


def test_a_batch_from_a_file_whose_content_is_gone_is_404_and_leaves_nothing(api: RunningApi) -> None:
    uploaded = httpx.post(f"{api.url}/v1/files", files={
        "purpose": (None, b"batch"), "file": ("requests.jsonl", json.dumps(LINE).encode() + b"\n")})
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    files = _file_store(api)
    record = files.get(Caller(tenant=None, admin=True), file_id)  # the open API's caller
    content_key = files.content_key(record)
    api.store.delete(content_key)  # the content is gone, the record stays

    content = httpx.get(f"{api.url}/v1/files/{file_id}/content")
    created = httpx.post(f"{api.url}/v1/batches", json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})

    assert content.status_code == 404
    assert created.status_code == content.status_code, created.text
    error = created.json()["error"]
    assert file_id in error["message"] and error["param"] == "input_file_id"
    assert content_key not in error["message"] and "/content" not in error["message"]
    # No batch, no job, and no copy of an input under the jobs area.
    assert httpx.get(f"{api.url}/v1/batches").json()["data"] == []
    assert api.repository.list()[0] == []
    jobs_root = area_root("jobs", api.repository.prefix)
    assert [info.key for info in api.store.list(jobs_root)] == []
