"""Deadlines: a job's `completion_window` passes → its rows not done become `expired` row errors, a
running shard stops within seconds, the job ends `expired` with its finished rows, manifest and
webhook-ready final state, and `retry` runs the expired rows again. Against a live deployment (real
worker, reaper ticking every half second)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

ROWS = 256
SHARD_ROWS = 128
LONG = {"max_tokens": 240, "ignore_eos": True, "temperature": 0}  # far longer than the window allows


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    settings_fields={"reaper_interval_s": 0.5, "max_completion_window": "2d"}) as live:
        yield live


def _rows(stack: LiveStack, name: str, count: int = ROWS) -> str:
    lines = b"".join(json.dumps({"q": f"q{n}"}).encode() + b"\n" for n in range(count))
    return stack.put_input(name, lines)


def _wait_final(stack: LiveStack, job_id: str, timeout: float = 120) -> float:
    """Seconds until the job ended."""
    started = time.monotonic()
    stack.client.jobs.wait(job_id, timeout=timeout, progress=False, poll_interval=0.1)
    return time.monotonic() - started


def test_a_running_job_stops_at_its_deadline_and_ends_expired_with_every_row(stack: LiveStack) -> None:
    job = stack.client.jobs.create({"input_uri": _rows(stack, "long.jsonl"), "model": "tiny",
                                    "prompt_column": "q", "shard_size": SHARD_ROWS, "sampling": LONG,
                                    "completion_window": "2s"})
    assert job.expires_at is not None and (job.expires_at - job.created_at).total_seconds() == 2
    waited = _wait_final(stack, job.job_id)
    status = stack.client.jobs.get(job.job_id)
    assert status.state == JobState.EXPIRED
    assert waited < 2 + 20  # the running shards stopped within seconds of the deadline, not after 240 tokens
    assert status.rows.total == ROWS and status.rows.failed > 0
    assert status.manifest_uri is not None and status.output_uris  # its finished rows are published
    rows = list(stack.client.jobs.results(job))  # an expired job's results are not partial: every row is here
    assert len(rows) == ROWS
    expired = [row for row in rows if row["error"]]
    assert {row["error"]["code"] for row in expired} == {"expired"}
    assert all(row["usage"]["completion_tokens"] == LONG["max_tokens"] for row in rows if not row["error"])
    assert len(expired) == status.rows.failed

    retry = stack.client.jobs.retry(job, error_codes=["expired"])  # the expired rows run again
    assert retry.rows.total == len(expired)
    stack.client.jobs.cancel(retry)


def test_shards_that_never_started_are_expired_by_the_sweep(stack: LiveStack) -> None:
    # `small` is planned but no worker serves it: its shards never start, so the sweep expires them.
    job = stack.client.jobs.create({"input_uri": _rows(stack, "waiting.jsonl", 5), "model": "small",
                                    "prompt_column": "q", "shard_size": 2, "completion_window": 2})
    waited = _wait_final(stack, job.job_id)
    status = stack.client.jobs.get(job.job_id)
    assert status.state == JobState.EXPIRED and waited < 2 + 15
    assert (status.rows.total, status.rows.failed, status.shards.done) == (5, 5, 3)
    ids = [row["id"] for row in stack.client.jobs.results(job)]
    assert len(ids) == 5 and len(set(ids)) == 5  # each row by its own id


@pytest.mark.parametrize(("window", "problem"), [
    ("tomorrow", "does not parse"), ("3d", "max_completion_window"), (0, "longer than zero"),
    ("-5m", "does not parse")])
def test_a_completion_window_that_does_not_parse_or_is_too_long_is_422(stack: LiveStack, window: object,
                                                                       problem: str) -> None:
    answer = httpx.post(f"{stack.url}/jobs", json={"input_uri": _rows(stack, "one.jsonl", 1), "model": "tiny",
                                                   "prompt_column": "q", "completion_window": window})
    assert answer.status_code == 422 and problem in answer.json()["detail"], answer.text
