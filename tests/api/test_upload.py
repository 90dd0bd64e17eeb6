"""POST /jobs as multipart: the file streams into jobs/<id>/input/<name> while it arrives."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.object_store.local import TEMP_PREFIX
from bulkinfer.jobs.state.status import JobState

BIG_ROWS = 40_000  # ~2.4 MiB: more than one write batch


def rows(count: int, column: str = "q") -> bytes:
    return b"".join(json.dumps({column: f"question {n:08d} " + "x" * 30}).encode() + b"\n"
                    for n in range(count))


def test_an_upload_becomes_the_jobs_input(api) -> None:
    data = rows(BIG_ROWS)
    job = api.client.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(data),
                                 filename="../../my rows.jsonl")
    spec = api.client.jobs.spec(job.job_id)
    key = api.repository.layout(job.job_id).input_key("my_rows.jsonl")
    assert spec.input_uri == api.store.uri(key) and spec.input_format == "jsonl"
    assert api.store.get_bytes(key) == data
    assert job.state == JobState.QUEUED


def test_the_upload_reaches_the_store_before_the_body_has_ended(local_api) -> None:
    """Half the file is sent, then the sender waits until the server has written it to the
    store's temp file; only then does the rest follow. A server that buffered the whole body
    first would never write, and the wait would time out."""
    boundary = "bulkinfer-test-boundary"
    data = rows(BIG_ROWS)
    half = len(data) // 2
    jobs_dir = local_api.settings.local_store_root() / "jobs"

    def written_so_far() -> int:
        return sum(path.stat().st_size for path in jobs_dir.glob(f"*/input/{TEMP_PREFIX}*"))

    def body():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"spec\"\r\n\r\n"
               + json.dumps({"model": "tiny", "prompt_column": "q"}) + f"\r\n--{boundary}\r\n"
               'Content-Disposition: form-data; name="file"; filename="rows.jsonl"\r\n'
               "Content-Type: application/octet-stream\r\n\r\n").encode()
        yield data[:half]
        deadline = time.monotonic() + 30
        while written_so_far() < 1 << 20:
            assert time.monotonic() < deadline, "the server did not write the upload while receiving it"
            time.sleep(0.02)
        yield data[half:]
        yield f"\r\n--{boundary}--\r\n".encode()

    response = httpx.post(f"{local_api.url}/jobs", content=body(), timeout=60,
                          headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert response.status_code == 201, response.text
    job_id = response.json()["job_id"]
    assert local_api.store.get_bytes(local_api.repository.layout(job_id).input_key("rows.jsonl")) == data


def test_an_upload_missing_the_column_is_refused_and_not_kept(api) -> None:
    with pytest.raises(ApiError) as error:
        api.client.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(rows(20, "text")),
                               filename="rows.jsonl")
    assert error.value.status_code == 400
    assert "column 'q' is in none of the first 5 rows" in error.value.message
    assert [info.key for info in api.store.list("") if "/input/" in info.key] == []
    assert list(api.client.jobs.list()) == []


def test_an_upload_with_a_bad_spec_or_an_unknown_model_is_refused(api) -> None:
    with pytest.raises(ApiError) as error:
        api.client.jobs.create({"model": "gpt-9", "prompt_column": "q"}, file=io.BytesIO(rows(BIG_ROWS)),
                               filename="rows.jsonl")
    assert error.value.status_code == 400 and "model 'gpt-9' is not served" in error.value.message
    with pytest.raises(ApiError) as error:
        api.client.jobs.create({"model": "tiny", "prompt_column": "q", "input_uri": "/x.jsonl"},
                               file=io.BytesIO(b"{}"), filename="rows.jsonl")
    assert error.value.status_code == 422 and error.value.message.startswith("input_uri: leave it out")
    with pytest.raises(ApiError) as error:
        api.client.jobs.create({"model": "tiny", "prompt_column": "q", "shard_size": 0},
                               file=io.BytesIO(b"{}"), filename="rows.jsonl")
    assert error.value.status_code == 422 and error.value.messages[0].startswith("shard_size:")


def test_the_file_must_follow_the_spec(api) -> None:
    response = httpx.post(f"{api.url}/jobs", files=[
        ("file", ("rows.jsonl", rows(3), "application/octet-stream")),
        ("spec", (None, json.dumps({"model": "tiny", "prompt_column": "q"}))),
    ])
    assert response.status_code == 400
    assert response.json()["detail"] == "send the 'spec' field before the 'file' field"
    spec = json.dumps({"model": "tiny", "prompt_column": "q"})
    response = httpx.post(f"{api.url}/jobs", data={"spec": spec}, files={"rows": ("rows.jsonl", rows(3))})
    assert response.status_code == 400 and "unexpected form field 'rows'" in response.json()["detail"]


def test_an_idempotent_upload_is_one_job_and_another_file_under_its_key_is_409(api, tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(rows(50))
    spec = {"model": "tiny", "prompt_column": "q", "idempotency_key": "upload-1"}
    first = api.client.jobs.create(spec, file=path)
    assert api.client.jobs.create(spec, file=path).job_id == first.job_id
    with pytest.raises(ApiError) as error:
        api.client.jobs.create(spec, file=io.BytesIO(rows(51)), filename="rows.jsonl")
    assert error.value.status_code == 409 and "already used with a different file" in error.value.message
    key = api.repository.layout(first.job_id).input_key("rows.jsonl")
    assert api.store.get_bytes(key) == path.read_bytes()  # the first upload stands
