"""An output folder's claim stands only behind a job that was created: a submit that fails after
claiming (an idempotency conflict, a store error, a crash) leaves the folder usable by the next job."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.state.repository import idempotent_job_id

ROWS = b"".join(json.dumps({"id": n, "q": f"question {n}"}).encode() + b"\n" for n in range(3))


def spec(uri: str, **changes) -> dict:  # noqa: ANN003
    return {"input_uri": uri, "model": "tiny", "prompt_column": "q", **changes}


def output_uri(api, name: str) -> str:  # noqa: ANN001
    if api.settings.is_local_store:
        return f"{api.settings.local_store_root() / 'outputs' / name}/"
    return f"s3://{api.settings.store_uri.removeprefix('s3://').split('/')[0]}/outputs/{name}/"


def test_a_submit_refused_for_its_idempotency_key_leaves_its_output_folder_free(api) -> None:
    uri = api.put_input("rows.jsonl", ROWS)
    first = api.client.jobs.create(spec(uri, idempotency_key="nightly", output_uri=output_uri(api, "first")))
    with pytest.raises(ApiError) as conflict:  # the key names `first`, whose spec differs
        api.client.jobs.create(spec(uri, idempotency_key="nightly", output_uri=output_uri(api, "second")))
    assert conflict.value.status_code == 409 and "'nightly' was already used" in conflict.value.message
    other = api.client.jobs.create(spec(uri, output_uri=output_uri(api, "second")))
    assert api.client.jobs.spec(other.job_id).output_uri == output_uri(api, "second")
    # The job the key names keeps its own folder, though a conflicting submit named it too.
    with pytest.raises(ApiError) as taken:
        api.client.jobs.create(spec(uri, idempotency_key="nightly", model="small",
                                    output_uri=output_uri(api, "first")))
    assert taken.value.status_code == 409
    with pytest.raises(ApiError) as still_first:
        api.client.jobs.create(spec(uri, output_uri=output_uri(api, "first")))
    assert f"outputs of job {first.job_id}" in still_first.value.message


def test_a_submit_whose_job_cannot_be_written_leaves_its_output_folder_free(local_api) -> None:
    api = local_api
    uri = api.put_input("rows.jsonl", ROWS)
    job_id = idempotent_job_id("blocked")
    blocker = Path(api.settings.local_store_root(), "jobs", job_id)
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"a file where the job's folder goes: its job.json cannot be written")
    try:  # a 500, or the connection dropped with the error: either way no job
        answer = httpx.post(f"{api.url}/jobs", json=spec(uri, idempotency_key="blocked",
                                                         output_uri=output_uri(api, "o")))
        assert answer.status_code >= 500, answer.text
    except httpx.TransportError:
        pass
    job = api.client.jobs.create(spec(uri, output_uri=output_uri(api, "o")))
    assert api.client.jobs.spec(job.job_id).output_uri == output_uri(api, "o")
