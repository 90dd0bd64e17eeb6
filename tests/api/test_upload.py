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


CSV_ROWS = ('\ufeffid,q,team\r\n1,"What is 2+2, really?",red\r\n2,"A ""quoted""\nquestion",\r\n').encode()


def test_a_csv_or_tsv_upload_becomes_a_job_that_writes_csv(api) -> None:
    job = api.client.jobs.create({"model": "tiny", "prompt_column": "q", "id_column": "id"},
                                 file=io.BytesIO(CSV_ROWS), filename="Rows.CSV")
    spec = api.client.jobs.spec(job.job_id)
    assert (spec.input_format, spec.output_format) == ("csv", "csv")
    assert job.state == JobState.QUEUED
    tsv = api.client.jobs.create({"model": "tiny", "prompt_column": "q", "output_format": "parquet"},
                                 file=io.BytesIO(b"q\tteam\nhello\tx\n"), filename="rows.tsv")
    tsv_spec = api.client.jobs.spec(tsv.job_id)
    assert (tsv_spec.input_format, tsv_spec.output_format) == ("tsv", "parquet")


def test_a_bad_upload_is_refused_naming_the_users_file_and_no_place_in_the_store(api) -> None:
    def refused_upload(data: bytes, filename: str, **spec) -> str:
        with pytest.raises(ApiError) as error:
            api.client.jobs.create({"model": "tiny", "prompt_column": "q", **spec}, file=io.BytesIO(data),
                                   filename=filename)
        assert error.value.status_code == 400, error.value.message
        message = error.value.message
        store_places = ["jobs/", "/input/", "deploy", "bulkinfer-api", str(api.settings.store_uri)]
        if api.settings.is_local_store:
            store_places.append(str(api.settings.local_store_root()))
        assert not [place for place in store_places if place in message], message
        return message

    assert refused_upload(b"PK\x03\x04 not a table", "report.xlsx").startswith(
        "cannot tell the format of report.xlsx: name it .parquet, .jsonl, .csv or .tsv")
    message = refused_upload(b"id,question\n1,hi\n", "my rows.csv")
    assert message.startswith("column 'q' is not in the header row of 'my rows.csv' (its columns: 'id', ")
    assert refused_upload(b"", "empty.csv") == "the uploaded file 'empty.csv': the file is empty"
    message = refused_upload(b"q\x81\n1\n", "export.csv", csv_encoding="cp1252")
    assert message.startswith("the header row of 'export.csv' cannot be read (")
    assert [info.key for info in api.store.list("") if "/input/" in info.key] == []  # nothing was kept
