"""OpenAI's Files API with the official `openai` SDK as the client, over real HTTP: upload (streamed
to the store), retrieve, list across pages, download, delete, expiry, limits and tenants."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Iterator

import httpx
import openai
import pytest

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.v1.files import FileRecord, FileStore, new_file_id
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, RunningApi, serve

KEYS = "acme=acme-secret,globex=globex-secret"
ADMIN = "root-secret"
OPEN = Caller(tenant=None, admin=True)  # the open API's caller


def line(custom_id: str, model: str = "tiny") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}).encode()


ROWS = line("a") + b"\n" + line("b") + b"\n"


def sdk(api: RunningApi, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=0)


def file_store(api: RunningApi) -> FileStore:
    """The API's own file store over the same settings (the lead's batch code uses it this way)."""
    context = ApiContext(settings=api.settings, repository=api.repository,
                         registry=api.settings.model_registry(), tasks=None)  # type: ignore[arg-type]
    return FileStore(context)


def stored_keys(api: RunningApi) -> list[str]:
    """Everything under files/: its objects and unfinished writes (a local store's temp files, which
    a listing skips, included)."""
    files = file_store(api)
    if api.settings.is_local_store:
        root = api.settings.local_store_root()
        on_disk = (root / files.root).rglob("*")
        keys = [path.relative_to(root).as_posix() for path in on_disk if path.is_file()]
    else:
        keys = [info.key for info in api.store.list(files.root)]
    return keys + [write.key for write in api.store.unfinished_writes(files.root)]


def status_of(call) -> openai.APIStatusError:  # noqa: ANN001
    with pytest.raises(openai.APIStatusError) as refused:
        call()
    return refused.value


@pytest.fixture
def keyed_api(redis_url, tmp_path) -> Iterator[RunningApi]:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys=ADMIN, max_upload_bytes=64 << 10)
    with serve(settings) as running:
        yield running


def test_an_upload_comes_back_byte_for_byte_and_is_gone_once_deleted(api) -> None:
    # Several MiB with a line across every chunk boundary: streamed through the store's writer.
    data = b"".join(line(f"row-{n:06d}-" + "x" * 900) + b"\n" for n in range(3500)) + line("last")
    client = sdk(api)
    created = client.files.create(file=("rows.jsonl", data), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file" and created.status == "processed"
    assert (created.bytes, created.filename, created.purpose, created.expires_at) == \
        (len(data), "rows.jsonl", "batch", None)
    assert abs(created.created_at - time.time()) < 60
    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).read() == data
    record = file_store(api).get(OPEN, created.id)
    assert record.batch_lines is not None and record.batch_lines.requests == 3501
    assert record.batch_lines.problems == [] and record.batch_lines.models == {"tiny": 1}
    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(created.id)
    assert client.files.list().data == [] and stored_keys(api) == []


def test_expires_after_sets_expires_at_within_openais_bounds(local_api) -> None:
    client = sdk(local_api)
    created = client.files.create(file=("rows.jsonl", ROWS), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    assert created.expires_at == created.created_at + 3600
    for bad, says in (({"anchor": "created_at", "seconds": 60}, "between 3600"),
                      ({"anchor": "last_active_at", "seconds": 3600}, "'created_at'")):
        error = status_of(lambda: client.files.create(file=("rows.jsonl", ROWS), purpose="batch",  # noqa: B023
                                                      expires_after=bad))  # noqa: B023
        assert error.status_code == 400 and says in error.response.text
    assert [f.id for f in client.files.list()] == [created.id]  # nothing of the refused ones stayed
    assert len(stored_keys(local_api)) == 2


def test_an_expired_file_is_not_found_and_is_deleted(local_api) -> None:
    client = sdk(local_api)
    created = client.files.create(file=("rows.jsonl", ROWS), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
    kept = client.files.create(file=("kept.jsonl", ROWS), purpose="batch")
    files = file_store(local_api)
    record = files.get(OPEN, created.id)
    past = record.model_copy(update={"expires_at": int(time.time()) - 1})
    local_api.store.put_bytes(files.meta_key(record.owner, record.id), past.model_dump_json().encode())
    assert [f.id for f in client.files.list()] == [kept.id]
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    assert not any(created.id in key for key in stored_keys(local_api))
    # Expiry is to the second, by the store's clock; a file without one is kept until deleted.
    soon = client.files.create(file=("soon.jsonl", ROWS), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    at = soon.expires_at
    assert FileStore(files.context, clock=lambda: at - 1).get(OPEN, soon.id).id == soon.id
    with pytest.raises(HttpError) as gone:
        FileStore(files.context, clock=lambda: at).get(OPEN, soon.id)
    assert gone.value.status_code == 404
    with pytest.raises(openai.NotFoundError):  # deleted when that lookup touched it
        client.files.retrieve(soon.id)
    assert FileStore(files.context, clock=lambda: time.time() + 400 * 86400).get(OPEN, kept.id).id == kept.id


def test_listing_pages_by_creation_time_with_after_limit_order_and_purpose(local_api) -> None:
    client = sdk(local_api)
    ids = [client.files.create(file=(f"{n}.jsonl", ROWS), purpose="batch").id for n in range(5)]
    assert ids == sorted(ids)  # ids sort by creation time
    output = file_store(local_api).write_output("_open", new_file_id(), "batch_out.jsonl", "batch_output",
                                                [ROWS], created_at=int(time.time()))
    newest_first = [output.id, *ids[::-1]]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    second = client.files.list(limit=2, after=first.data[-1].id)
    assert [f.id for f in second.data] == newest_first[2:4] and second.has_more
    last = client.files.list(limit=2, after=second.data[-1].id)
    assert [f.id for f in last.data] == newest_first[4:] and not last.has_more
    assert [f.id for f in client.files.list(limit=2)] == newest_first  # the SDK's auto-pagination
    assert [f.id for f in client.files.list(limit=4, order="asc")] == newest_first[::-1]
    assert [f.id for f in client.files.list(purpose="batch", limit=2)] == ids[::-1]
    assert [f.id for f in client.files.list(purpose="batch_output")] == [output.id]
    raw = httpx.get(f"{local_api.url}/v1/files", params={"limit": 3, "order": "asc"}).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", ids[0], ids[2], True)
    assert httpx.get(f"{local_api.url}/v1/files", params={"limit": 0}).status_code == 422


def test_a_tenant_never_sees_another_tenants_files_and_an_admin_sees_all(keyed_api) -> None:
    acme, globex = sdk(keyed_api, "acme-secret"), sdk(keyed_api, "globex-secret")
    admin = sdk(keyed_api, ADMIN)
    mine = acme.files.create(file=("a.jsonl", ROWS), purpose="batch")
    theirs = globex.files.create(file=("g.jsonl", ROWS + ROWS), purpose="batch")
    for call in (globex.files.retrieve, globex.files.content, globex.files.delete):
        error = status_of(lambda: call(mine.id))  # noqa: B023
        assert error.status_code == 404 and "acme" not in error.response.text
    assert [f.id for f in globex.files.list()] == [theirs.id]
    assert [f.id for f in acme.files.list()] == [mine.id]
    assert {f.id for f in admin.files.list()} == {mine.id, theirs.id}
    assert admin.files.retrieve(mine.id) == mine and admin.files.content(theirs.id).read() == ROWS + ROWS
    assert acme.files.content(mine.id).read() == ROWS  # globex's delete changed nothing
    assert admin.files.delete(theirs.id).deleted
    assert [f.id for f in globex.files.list()] == []


def test_an_upload_past_max_upload_bytes_is_413_and_leaves_nothing(keyed_api) -> None:
    acme = sdk(keyed_api, "acme-secret")
    big = line("a" * 1000) * 80  # ~90 KiB past the 64 KiB limit
    error = status_of(lambda: acme.files.create(file=("big.jsonl", big), purpose="batch"))
    assert error.status_code == 413 and "max_upload_bytes (65,536 bytes)" in error.response.text
    assert stored_keys(keyed_api) == [] and acme.files.list().data == []


def test_a_purpose_other_than_batch_is_400_naming_the_accepted_one(keyed_api) -> None:
    acme = sdk(keyed_api, "acme-secret")
    for purpose in ("fine-tune", "batch_output"):
        error = status_of(lambda: acme.files.create(file=("a.jsonl", ROWS), purpose=purpose))  # noqa: B023
        assert error.status_code == 400 and f"purpose {purpose!r}" in error.response.text
        assert "one of 'batch'" in error.response.text
    assert stored_keys(keyed_api) == []


def test_the_fields_may_come_in_any_order_and_a_late_bad_purpose_keeps_nothing(keyed_api) -> None:
    """curl -F or another client may send the file before the purpose (the SDK sends it last)."""
    headers = {"Authorization": "Bearer acme-secret"}

    def upload(*parts: tuple) -> httpx.Response:
        return httpx.post(f"{keyed_api.url}/v1/files", files=list(parts), headers=headers)

    answer = upload(("file", ("late.jsonl", ROWS)), ("purpose", (None, b"batch")),
                    ("expires_after[seconds]", (None, b"7200")),
                    ("expires_after[anchor]", (None, b"created_at")))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["purpose"] == "batch" and body["expires_at"] == body["created_at"] + 7200
    assert sdk(keyed_api, "acme-secret").files.content(body["id"]).read() == ROWS
    refused = upload(("file", ("late.jsonl", ROWS)), ("purpose", (None, b"assistants")))
    assert refused.status_code == 400 and "'assistants'" in refused.text
    purpose, file = ("purpose", (None, b"batch")), ("file", ("x.jsonl", ROWS))
    for parts, says in (([purpose], "no 'file' field"), ([file], "'purpose'"),
                        ([purpose, ("model", (None, b"x")), file], "unexpected form field 'model'")):
        answer = upload(*parts)
        assert answer.status_code == 400 and says in answer.text, answer.text
    json_body = httpx.post(f"{keyed_api.url}/v1/files", json={"purpose": "batch"}, headers=headers)
    assert json_body.status_code == 400 and "multipart/form-data" in json_body.text
    assert len(stored_keys(keyed_api)) == 2  # the one good upload: its meta.json and content


def test_a_batch_files_line_problems_are_kept_with_its_record(local_api) -> None:
    data = line("a") + b"\nnot json\n" + line("a") + b"\n"
    created = sdk(local_api).files.create(file=("bad.jsonl", data), purpose="batch")
    record = file_store(local_api).get(OPEN, created.id)
    assert record.batch_lines is not None
    assert [(p.code, p.line) for p in record.batch_lines.problems] == \
        [("invalid_json_line", 2), ("duplicate_custom_id", 3)]


def test_an_output_file_is_written_once_and_served_to_its_owner_only(keyed_api) -> None:
    files = file_store(keyed_api)
    file_id = new_file_id()
    first = files.write_output("acme", file_id, "batch_output.jsonl", "batch_output", [ROWS[:10], ROWS[10:]],
                               created_at=1_700_000_000)
    assert isinstance(first, FileRecord) and first.bytes == len(ROWS)

    def never_read() -> Iterator[bytes]:
        raise AssertionError("a second write_output of the same id read its chunks")
        yield b""

    again = files.write_output("acme", file_id, "batch_output.jsonl", "batch_output", never_read(),
                               created_at=1_800_000_000)
    assert again == first  # the record already there, created_at and all
    acme = sdk(keyed_api, "acme-secret")
    served = acme.files.retrieve(file_id)
    assert (served.purpose, served.bytes, served.created_at) == ("batch_output", len(ROWS), 1_700_000_000)
    assert acme.files.content(file_id).read() == ROWS
    assert status_of(lambda: sdk(keyed_api, "globex-secret").files.content(file_id)).status_code == 404
    # An earlier write that stopped between its content and its record is completed, not refused.
    half = new_file_id()
    keyed_api.store.put_bytes(f"{files.folder('acme', half)}content", b"partial run\n")
    finished = files.write_output("acme", half, "errors.jsonl", "batch_error", [b"partial run\n"], 5)
    assert finished.bytes == len(b"partial run\n") and acme.files.content(half).read() == b"partial run\n"
    with pytest.raises(ValueError, match="purpose"):
        files.write_output("acme", new_file_id(), "x.jsonl", "batch", [ROWS], 5)
    with pytest.raises(ValueError, match="file id"):
        files.write_output("acme", "../escape", "x.jsonl", "batch_output", [ROWS], 5)
    with pytest.raises(ValueError, match="owner"):
        files.write_output("acme/../globex", new_file_id(), "x.jsonl", "batch_output", [ROWS], 5)


def test_a_deleted_or_expired_batch_output_is_never_written_again(keyed_api) -> None:
    files, acme = file_store(keyed_api), sdk(keyed_api, "acme-secret")
    deleted = new_file_id()
    files.write_output("acme", deleted, "out.jsonl", "batch_output", [ROWS], created_at=5)
    acme.files.delete(deleted)
    assert files.write_output("acme", deleted, "out.jsonl", "batch_output", [ROWS], created_at=5) is None
    assert status_of(lambda: acme.files.retrieve(deleted)).status_code == 404

    expired = new_file_id()
    files.write_output("acme", expired, "out.jsonl", "batch_output", [ROWS], created_at=5, expires_at=10)
    assert status_of(lambda: acme.files.content(expired)).status_code == 404  # gone when touched
    assert files.write_output("acme", expired, "out.jsonl", "batch_output", [ROWS], 5, expires_at=10) is None

    # A writer already streaming when the file was published (by a quicker reader) and deleted takes
    # what it wrote back out.
    late = new_file_id()

    def published_and_deleted_meanwhile() -> Iterator[bytes]:
        files.write_output("acme", late, "out.jsonl", "batch_output", [ROWS], created_at=5)
        acme.files.delete(late)
        yield ROWS

    assert files.write_output("acme", late, "out.jsonl", "batch_output", published_and_deleted_meanwhile(),
                              created_at=5) is None
    assert status_of(lambda: acme.files.retrieve(late)).status_code == 404
    assert not keyed_api.store.exists(f"{files.folder('acme', late)}content")


def test_an_upload_streams_to_the_store_and_is_never_held_whole(local_api) -> None:
    """48 MiB go through the API with well under that allocated at any time (the request body, the
    multipart parts and the line check all hold a MiB or so)."""
    boundary = "bulkinfer-test-boundary"
    row = line("r" + "x" * 16000) + b"\n"
    count = (48 << 20) // len(row)

    def body() -> Iterator[bytes]:
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
               "Content-Type: application/octet-stream\r\n\r\n").encode()
        for n in range(count):
            yield row.replace(b'"r' + b"x" * 9, f'"{n:010d}'.encode(), 1)  # unique custom_ids, same size
        yield f"\r\n--{boundary}--\r\n".encode()

    tracemalloc.start()
    try:
        answer = httpx.post(f"{local_api.url}/v1/files", content=body(), timeout=120,
                            headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["bytes"] == count * len(row)
    assert peak < 16 << 20, f"{peak / (1 << 20):.1f} MiB allocated at the peak of a 48 MiB upload"
    record = file_store(local_api).get(OPEN, answer.json()["id"])
    assert record.batch_lines is not None and record.batch_lines.requests == count
    assert record.batch_lines.problem_count == 0
