"""Retry only what failed: `POST /jobs/{id}/retry` (SDK `jobs.retry`, CLI `bulkinfer retry`) makes a
job over the failed or unrun rows of an ended job, and `results(job, merged=True)` (CLI `results
--merged`) gives one row per input row across the chain, against a live deployment (real worker).

The Parquet job's two bad rows (a null prompt) are fixed in the input between retries, as a user
would fix them; row numbers stay put, so each retry runs only the rows still failing."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.api.client import ApiError, AsyncClient
from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import REPO_ROOT, RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

JOB_TIMEOUT_S = 120
SHARD_ROWS = 2
SAMPLING = {"max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


def _parquet(prompts: list[str | None]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"q": pa.array(prompts, pa.string())}), buffer, row_group_size=SHARD_ROWS)
    return buffer.getvalue()


def _submit(stack: LiveStack, uri: str, **fields: object) -> str:
    job = stack.client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q",
                                    "shard_size": SHARD_ROWS, "sampling": SAMPLING, **fields})
    return job.job_id


def _wait(stack: LiveStack, job_id: str) -> JobState:
    return stack.client.jobs.wait(job_id, timeout=JOB_TIMEOUT_S, progress=False, poll_interval=0.2).state


def test_retries_run_only_the_failed_rows_and_merge_into_one_row_per_input_row(stack: LiveStack) -> None:
    prompts = [f"question {n}" for n in range(6)]
    broken = [None if n in (1, 4) else prompt for n, prompt in enumerate(prompts)]
    uri = stack.put_input("fixable.parquet", _parquet(broken))
    first = _submit(stack, uri)
    assert _wait(stack, first) == JobState.SUCCEEDED
    status = stack.client.jobs.get(first)
    assert (status.rows.succeeded, status.rows.failed) == (4, 2)
    first_rows = list(stack.client.jobs.results(first))

    with pytest.raises(ApiError) as nothing:  # no row failed with that code
        stack.client.jobs.retry(first, error_codes=["engine_error"])
    assert nothing.value.status_code == 409 and "nothing to retry" in nothing.value.message

    stack.put_input("fixable.parquet", _parquet([prompts[n] if n == 1 else p for n, p in enumerate(broken)]))
    second = stack.client.jobs.retry(first)
    assert (second.parent_job_id, second.rows.total) == (first, 2)
    assert _wait(stack, second.job_id) == JobState.SUCCEEDED
    status = stack.client.jobs.get(second.job_id)
    assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (2, 1, 1)
    assert stack.client.jobs.spec(second.job_id).parent_job_id == first

    merged = stack.client.jobs.results(second.job_id, merged=True)
    rows = list(merged)
    assert [row["id"] for row in rows] == [str(n) for n in range(6)]  # one per input row, in order
    assert [row["error"] is None for row in rows] == [True, True, True, True, False, True]
    assert rows[0] == first_rows[0] and rows[5] == first_rows[5]  # untouched rows are the first job's
    assert (merged.chain, merged.missing_shards) == ([first, second.job_id], 0)

    # The CLI: retry the retry (row 4 fixed now), wait, then the merged rows on stdout.
    stack.put_input("fixable.parquet", _parquet(prompts))
    done = _cli(stack, "retry", second.job_id, "--wait", "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    third = json.loads(done.stdout)
    assert (third["state"], third["parent_job_id"], third["rows"]["total"]) == ("succeeded", second.job_id, 1)
    done = _cli(stack, "results", third["job_id"], "--merged")
    assert done.returncode == 0, done.stderr
    merged_rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["id"] for row in merged_rows] == [str(n) for n in range(6)]
    assert all(row["error"] is None and row["text"] is not None for row in merged_rows)
    assert f"merged 6 rows of {first} → {second.job_id} → {third['job_id']}" in done.stderr


def test_a_row_that_fails_again_keeps_its_latest_error_in_jsonl(stack: LiveStack) -> None:
    lines = [json.dumps({"q": "hello"}), "{not json", json.dumps({"q": "world"}), json.dumps({"x": 1})]
    uri = stack.put_input("rows.jsonl", ("\n".join(lines) + "\n").encode())
    first = _submit(stack, uri)
    assert _wait(stack, first) == JobState.SUCCEEDED
    only_json = stack.client.jobs.retry(first, error_codes=["invalid_json"])
    assert only_json.rows.total == 1  # the missing-column row is left alone
    assert _wait(stack, only_json.job_id) == JobState.SUCCEEDED
    rows = list(stack.client.jobs.results(only_json.job_id, merged=True))
    offsets = [0, len(lines[0]) + 1, len(lines[0]) + len(lines[1]) + 2, sum(map(len, lines[:3])) + 3]
    assert [row["id"] for row in rows] == [str(offset) for offset in offsets]  # JSONL ids: byte offsets
    assert [row["error"]["code"] if row["error"] else None for row in rows] == \
        [None, "invalid_json", None, "missing_column"]

    async def merged_async() -> tuple[list[dict], list[str] | None]:
        async with AsyncClient(stack.url) as client:
            merged = client.jobs.results(only_json.job_id, merged=True)
            return await merged.rows(), merged.chain
    async_rows, chain = asyncio.run(merged_async())  # the async SDK reads the same merged rows
    assert async_rows == rows and chain == [first, only_json.job_id]


def test_a_running_job_cannot_be_retried_and_a_cancelled_one_retries_every_row(stack: LiveStack) -> None:
    uri = stack.put_input("waiting.parquet", _parquet([f"q{n}" for n in range(5)]))
    job = stack.client.jobs.create({"input_uri": uri, "model": "small", "prompt_column": "q",
                                    "shard_size": SHARD_ROWS})  # planned; no worker serves `small`
    _until_running(stack, job.job_id)
    with pytest.raises(ApiError) as running:
        stack.client.jobs.retry(job)
    assert running.value.status_code == 409 and "is running" in running.value.message
    stack.client.jobs.cancel(job)
    child = stack.client.jobs.retry(job, error_codes=["not_run"])
    assert (child.parent_job_id, child.rows.total) == (job.job_id, 5)  # every row: none had run
    assert stack.repository.load_plan(child.job_id)[2].origin == 2
    stack.client.jobs.cancel(child)


def test_a_submit_cannot_set_the_retry_fields(stack: LiveStack) -> None:
    uri = stack.put_input("plain.parquet", _parquet(["q"]))
    answer = httpx.post(f"{stack.url}/jobs", json={"input_uri": uri, "model": "tiny", "prompt_column": "q",
                                                   "parent_job_id": "abc"})
    assert answer.status_code == 422 and "parent_job_id" in answer.json()["detail"]
    assert httpx.post(f"{stack.url}/jobs/nosuchjob/retry").status_code == 404
    bad = httpx.post(f"{stack.url}/jobs/nosuchjob/retry", json={"error_codes": "engine_error"})
    assert bad.status_code == 422


def _until_running(stack: LiveStack, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while stack.client.jobs.get(job_id).state != JobState.RUNNING:
        assert time.monotonic() < deadline, "the job was never planned"
        time.sleep(0.1)


def _cli(stack: LiveStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", *args, "--api-url", stack.url],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=stack.cli_env(), timeout=180)
