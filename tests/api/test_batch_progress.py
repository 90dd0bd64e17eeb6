"""A batch's progress and its end as published batch code sees them, through the official `openai`
and `anthropic` packages against a live deployment (Redis, moto S3, a real worker serving `tiny`):
rows are counted (with their tokens) while their shard still runs, and the batch is `finalizing`
(OpenAI, with `finalizing_at`; Anthropic: still `in_progress`) while its parts are merged.

The worker reaches S3 through a proxy that can hold requests (tests/support/s3_fault_proxy.py), so
each phase is held exactly where the test looks at it: a shard whose rows are all done waits as it
writes its parts (nothing committed yet), then finalize waits as it writes the manifest. Nothing
depends on how fast the machine is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anthropic
import httpx
import openai
import pytest

from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server
from tests.support.s3_fault_proxy import FaultPlan, RequestGate, s3_fault_proxy

pytestmark = pytest.mark.timeout(300)

ALIASES = {"gpt-4o-mini": "tiny", "claude-haiku-4-5": "tiny"}
TIMEOUT_S = 120
CHAT = "/v1/chat/completions"
T = TypeVar("T")


def staged_parts(method: str, path: str) -> bool:
    """A shard's parts, written (staged) before its result commits it."""
    return "/_temporary/" in path


def manifest(method: str, path: str) -> bool:
    """finalize_job's last write, after the parts are merged and published."""
    return method == "PUT" and path.split("?")[0].endswith("/manifest.json")


@pytest.fixture(scope="module")
def gate() -> RequestGate:
    return RequestGate()


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, gate: RequestGate,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    no_faults = FaultPlan(["slow"], every=1)
    no_faults.enabled = False
    with s3_fault_proxy(s3_server.endpoint_url, no_faults, gate) as proxy, \
            live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                       settings_fields={"model_aliases": ALIASES},
                       worker_s3_endpoint=proxy.endpoint_url) as live:
        try:
            yield live
        finally:
            gate.open()


def until(read: Callable[[], T], done: Callable[[T], bool], what: str) -> T:
    """Read until `done`, for as long as a loaded machine may need."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done(value := read()):
        assert time.monotonic() < deadline, f"still not {what} after {TIMEOUT_S}s: {value}"
        time.sleep(0.1)
    return value


def job(stack: LiveStack, batch_id: str) -> dict:
    job_id = "job-" + batch_id.split("_", 1)[1]
    return httpx.get(f"{stack.url}/jobs/{job_id}", timeout=30).json()


def chat_line(custom_id: str, text: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                     "temperature": 0, **body}}


def test_an_openai_batch_counts_rows_before_its_shard_commits_then_is_finalizing(
        stack: LiveStack, gate: RequestGate) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    lines = [chat_line(f"q{n}", f"Question {n}?") for n in range(3)]
    lines.append(chat_line("bad", "Too hot?", temperature=-1))  # that request's error
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file_id = sdk.files.create(file=("requests.jsonl", data), purpose="batch").id
    gate.close(staged_parts)
    try:
        batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        # Every row has run; the one shard waits as it writes its parts: nothing is committed yet.
        running = until(lambda: sdk.batches.retrieve(batch.id),
                        lambda b: b.request_counts is not None and b.request_counts.completed == 3
                        and b.request_counts.failed == 1, "3 completed and 1 failed")
        assert running.status == "in_progress" and gate.waiting >= 1
        usage = running.usage
        assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
        uncommitted = job(stack, batch.id)
        assert uncommitted["state"] == "running" and uncommitted["shards"]["done"] == 0
        assert (uncommitted["rows"]["succeeded"], uncommitted["rows"]["failed"]) == (3, 1)

        gate.close(manifest)  # the parts go on; finalize waits as it writes the manifest
        finalizing = until(lambda: sdk.batches.retrieve(batch.id), lambda b: b.status == "finalizing",
                           "finalizing")
        assert finalizing.finalizing_at is not None and finalizing.completed_at is None
        assert finalizing.output_file_id is None  # published once it has completed
        assert job(stack, batch.id)["state"] == "finalizing"
    finally:
        gate.open()
    done = until(lambda: sdk.batches.retrieve(batch.id), lambda b: b.status == "completed", "completed")
    assert done.finalizing_at == finalizing.finalizing_at and done.completed_at is not None
    assert done.completed_at >= done.finalizing_at >= (done.in_progress_at or 0)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.usage == running.usage  # the rows' live figures were the committed ones
    assert job(stack, batch.id)["finalizing_at"] is not None


def test_an_anthropic_batch_counts_requests_before_its_shard_commits_and_stays_in_progress_while_finalizing(
        stack: LiveStack, gate: RequestGate) -> None:
    sdk = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)

    def request(custom_id: str, **params: object) -> dict:
        message = {"role": "user", "content": "Hello?"}
        return {"custom_id": custom_id, "params": {"model": "claude-haiku-4-5", "max_tokens": 4,
                                                   "temperature": 0, "messages": [message], **params}}

    tool = {"name": "lookup", "description": "d", "input_schema": {"type": "object"}}
    gate.close(staged_parts)
    try:
        batch = sdk.messages.batches.create(requests=[request("a"), request("b", system="Be brief."),
                                                      request("tools", tools=[tool])])
        running = until(lambda: sdk.messages.batches.retrieve(batch.id),
                        lambda b: b.request_counts.processing == 0, "every request processed")
        counts = running.request_counts
        assert (counts.succeeded, counts.errored, counts.canceled, counts.expired) == (2, 1, 0, 0)
        assert running.processing_status == "in_progress" and running.results_url is None
        assert job(stack, batch.id)["shards"]["done"] == 0 and gate.waiting >= 1

        gate.close(manifest)
        until(lambda: job(stack, batch.id)["state"], lambda state: state == "finalizing", "finalizing")
        finalizing = sdk.messages.batches.retrieve(batch.id)
        assert finalizing.processing_status == "in_progress"  # Anthropic has no finalizing status
        assert finalizing.ended_at is None and finalizing.results_url is None
    finally:
        gate.open()
    ended = until(lambda: sdk.messages.batches.retrieve(batch.id), lambda b: b.processing_status == "ended",
                  "ended")
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == \
        (0, 2, 1, 0, 0)
