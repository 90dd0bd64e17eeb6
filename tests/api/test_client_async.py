"""The async SDK against a live deployment over real HTTP: the same calls as the sync client, awaited
(see tests/api/live_stack.py for the models and what each one does)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest

from bulkinfer.api.client import ApiError, AsyncClient, JobState, WaitTimeout
from tests.api.live_stack import LiveStack, live_stack

pytestmark = pytest.mark.timeout(300)

ROWS = [{"id": "a", "q": "def add(a, b):"}, {"id": "b", "q": "import os"}, {"id": "c", "q": "class Point:"}]
JOB_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


def run(scenario):
    return asyncio.run(scenario)


def test_a_job_is_submitted_waited_for_and_read_back(stack, tmp_path) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.url, backoff=0.05) as client:
            job = await client.jobs.create(ROWS, model="tiny", id_column="id", prompt_column="q",
                                           sampling={"temperature": 0, "max_tokens": 4}, shard_size=2)
            assert job.state == JobState.QUEUED
            seen = []
            done = await client.jobs.wait(job, poll_interval=0.1, timeout=JOB_TIMEOUT_S,
                                          on_progress=seen.append)
            assert done.state == JobState.SUCCEEDED and (done.rows.total, done.rows.failed) == (3, 0)
            assert seen[-1] == done and (await client.jobs.get(job.job_id)).state == JobState.SUCCEEDED
            assert (await client.jobs.spec(job)).input_uri.endswith(f"/{job.job_id}/input/input.jsonl")

            results = client.jobs.results(job)
            rows = [row async for row in results]
            assert [row["id"] for row in rows] == ["a", "b", "c"]
            assert all(row["error"] is None for row in rows)
            assert rows == list(stack.client.jobs.results(job)) == await results.rows()
            assert (await results.to_arrow()).column("id").to_pylist() == ["a", "b", "c"]
            copied = await client.jobs.download(job, tmp_path / "rows.jsonl")
            assert [json.loads(line) for line in copied.read_text().splitlines()] == rows
            written = await results.download(tmp_path / "rows.parquet")
            assert pq.read_table(written).column("text").to_pylist() == [row["text"] for row in rows]
            parts = await client.jobs.result_parts(job)
            assert sum(part.rows for part in parts.parts) == 3 and len(parts.parts) == 2

    run(scenario())


def test_list_cancel_wait_and_errors(stack) -> None:
    uri = stack.put_input("rows.jsonl", b"".join(json.dumps(row).encode() + b"\n" for row in ROWS))

    async def scenario() -> None:
        async with AsyncClient(stack.url, backoff=0.05) as client:
            stuck = [await client.jobs.create(uri, model="small", prompt_column="q", metadata={"n": str(n)})
                     for n in range(3)]
            everything = [job.job_id for job in (await client.jobs.page(limit=1000)).jobs]
            assert [job.job_id async for job in client.jobs.list(page_size=2)] == everything
            assert [job.job_id async for job in client.jobs.list(page_size=2, limit=2)] == everything[:2]
            assert set(everything) >= {job.job_id for job in stuck}

            with pytest.raises(WaitTimeout) as timeout:
                await client.jobs.wait(stuck[0], poll_interval=0.05, timeout=0.3)
            assert not timeout.value.status.state.is_terminal
            assert (await client.jobs.cancel(stuck[0])).state == JobState.CANCELLED
            assert (await client.jobs.wait(stuck[0].job_id, timeout=5)).state == JobState.CANCELLED
            with pytest.raises(ApiError) as not_ready:
                await client.jobs.results(stuck[0]).to_arrow()
            assert not_ready.value.status_code == 409

            retired = await client.jobs.create(uri, model="retired", prompt_column="q")
            failed = await client.jobs.wait(retired, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
            assert failed.state == JobState.FAILED and "retired" in failed.error

            key = {"model": "small", "prompt_column": "q", "idempotency_key": "async-1"}
            first = await client.jobs.create(uri, **key)
            assert (await client.jobs.create(uri, **key)).job_id == first.job_id
            with pytest.raises(ApiError) as conflict:
                await client.jobs.create(uri, **{**key, "prompt_column": None, "template": "{q}"})
            assert conflict.value.status_code == 409 and "'async-1' was already used for job" in \
                conflict.value.message
            with pytest.raises(ApiError) as missing:
                await client.jobs.get("job-nope")
            assert (missing.value.status_code, missing.value.message) == (404, "no job 'job-nope'")
            assert await client.models() == ["retired", "small", "tiny"]
            assert (await client.health())["status"] == "ok"

    run(scenario())
